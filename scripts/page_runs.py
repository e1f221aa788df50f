#!/usr/bin/env python3
"""How physically contiguous a running process's anonymous memory is (docs/planning.md#borrowed-slots).

Reads /proc/PID/smaps and /proc/PID/pagemap (root: page frame numbers are hidden from others) and prints, for the
process's private writable anonymous mappings grouped by locked / unlocked and by size, the resident MiB and the
mean number of pages per physically contiguous run.  An O_DIRECT read into memory of short runs is a request of
many segments; on this project's virtual disk such reads into slots of 1-2 pages per run took longer than the same
reads into slots of 60+ pages per run (docs/planning.md).

    sudo scripts/page_runs.py PID [--min-kib 256]
"""
from __future__ import annotations

import argparse
import re
import struct
import sys

PAGE = 4096
VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def vmas(pid: int) -> list[dict]:
    out: list[dict] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = VMA.match(line)
            if m:
                out.append(dict(a=int(m[1], 16), b=int(m[2], 16), perm=m[3], anon=not m[4].strip(), locked=0))
            elif line.startswith("Locked:") and out:
                out[-1]["locked"] = int(line.split()[1])
    return out


def runs(pagemap, a: int, b: int) -> tuple[int, int, bool]:
    """(resident pages, physically contiguous runs among them, any page frame number seen) of [a, b)"""
    pagemap.seek(a // PAGE * 8)
    data = pagemap.read((b - a) // PAGE * 8)
    n = r = 0
    prev = None
    seen = False
    for (e,) in struct.iter_unpack("<Q", data):
        pfn = e & ((1 << 55) - 1) if e >> 63 else None
        if pfn is not None:
            n += 1
            seen = seen or pfn != 0
            if prev is None or pfn != prev + 1:
                r += 1
        prev = pfn
    return n, r, seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pid", type=int)
    ap.add_argument("--min-kib", type=int, default=256, help="skip mappings smaller than this (default 256)")
    a = ap.parse_args()
    if a.pid <= 0 or a.min_kib < 0:
        ap.error("PID must be positive and --min-kib >= 0")
    try:
        maps = vmas(a.pid)
        pagemap = open(f"/proc/{a.pid}/pagemap", "rb")
    except OSError as e:
        print(f"page_runs: cannot read process {a.pid}: {e}", file=sys.stderr)
        return 1
    groups: dict[str, list[int]] = {}
    seen = False
    with pagemap:
        for v in maps:
            if not (v["perm"].startswith("rw") and v["anon"]) or v["b"] - v["a"] < a.min_kib << 10:
                continue
            n, r, s = runs(pagemap, v["a"], v["b"])
            seen = seen or s
            key = ("locked" if v["locked"] else "unlocked") + (" < 8 MiB" if v["b"] - v["a"] < 8 << 20 else " >= 8 MiB")
            g = groups.setdefault(key, [0, 0, 0, 0])
            g[0] += 1
            g[1] += v["b"] - v["a"]
            g[2] += n
            g[3] += r
    for key, (c, size, n, r) in sorted(groups.items()):
        print(f"{key:20s} {c:5d} mappings {size >> 20:7d} MiB, {n * PAGE >> 20:7d} MiB resident, "
              f"{n / max(r, 1):7.1f} pages per contiguous run")
    if groups and not seen:
        print("page_runs: no page frame number could be read (run as root)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
