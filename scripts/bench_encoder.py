#!/usr/bin/env python3
"""The vision encoder in the --moe-mem budget, measured (issue #24 item 2, docs/planning.md#the-vision-encoder).

llama-mtmd-cli with --moe-mem auto in a fresh memory cgroup (v1 or v2) per run and limit: the cgroup's peak, the exit
status, the slots per layer, and prefill / decode tok/s from llama_perf (-v), for this build (the encoder planned)
and for a plan that ignores the encoder, as before patch 0015: either a build without it (--today-bindir) or this
build with llama_vis_moe_plan_encoder made a no-op by an LD_PRELOAD shim (--ignore-by-preload: same binaries,
only the hand-over skipped).  Where both arms finish at a limit, the ignored row says whether the generated text
is the planned row's (same_text).  --released adds the arm 'released': this build with VIS_MOE_ENCODER_RELEASE=on
(the encoder freed after the image, its bytes given to the slots for the decode; the other arms run it off), with
same_text against the planned row.  Each row has the decode's expert misses and MiB loaded (--moe-stats' total
line: prefill and decode together).  Limits in MiB (--limit-mib) or in % of the text model's file (--limit-pct).
--lock FILE holds flock(2) on FILE around each run (page-cache drop included), to share the machine with other
benchmarks that take the same lock.  Root; page cache dropped before each run.

  sudo .venv/bin/python scripts/bench_encoder.py -m MODEL --mmproj MMPROJ --image IMG --limit-mib 140 160 \\
       --today-bindir /path/to/old/build/bin -- -c 2048 -ub 32 --image-max-tokens 1024 -n 16
  sudo .venv/bin/python scripts/bench_encoder.py -m MODEL --mmproj MMPROJ --image IMG --limit-pct 50 25 12.5 \\
       --ignore-by-preload --lock /tmp/vis-bench48.lock -- -c 4096 -ub 32 --image-max-tokens 1024 -n 16
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_paging import memory_cgroup  # noqa: E402  (the tests' cgroup helper)

MIB = 1 << 20


def _perf(err: str, what: str) -> float | None:
    m = re.search(rf"llama_perf_context_print: +{what} += +[\d.]+ ms / +\d+ \w+ +\( *[\d.]+ ms per token, +([\d.]+) "
                  r"tokens per second\)", err)
    return float(m.group(1)) if m else None


# the arm "ignored" with --ignore-by-preload: the tools' hand-over of the mmproj (patch 0015) does nothing
SHIM_C = "int llama_vis_moe_plan_encoder(const char *p, int t, int fa, int w) { (void) p; (void) t; (void) fa; " \
         "(void) w; return 0; }\n"


def build_shim(d: Path) -> Path:
    (d / "shim.c").write_text(SHIM_C)
    so = d / "ignore-encoder.so"
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", so, d / "shim.c"], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--ignore-by-preload: compiling the shim with `cc` failed ({getattr(e, 'stderr', '') or e}); "
                         "install a C compiler, or pass --today-bindir with a build without patch 0015 instead")
    return so


@contextlib.contextmanager
def held(lock: Path | None):
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def one(bindir: Path, args, limit_mib: int, extra: list[str], preload: Path | None = None, release: bool = False) -> dict:
    cmd = [bindir / "llama-mtmd-cli", "-m", args.model, "--mmproj", args.mmproj, "--image", args.image,
           "-p", args.prompt, "--temp", "0", "-t", str(args.threads), "-v", "--moe-mem", "auto", "--moe-stats", *extra]
    env = os.environ | {"VIS_MOE_CONFIGURE": "off", "VIS_MOE_ENCODER_RELEASE": "on" if release else "off"} | \
        ({"LD_PRELOAD": str(preload)} if preload else {})
    with held(args.lock):
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
        load0, t0 = os.getloadavg()[0], time.monotonic()
        with memory_cgroup(limit_mib * MIB) as (wrap, peak):
            r = subprocess.run([str(c) for c in wrap(cmd)], capture_output=True, text=True, errors="replace", env=env,
                               timeout=args.timeout)
            used = peak()
        wall, load1 = time.monotonic() - t0, os.getloadavg()[0]
    slots = sorted({int(m.group(1)) for m in re.finditer(r"vis-moe: +\d+ +(\d+) +\d+", r.stderr)})
    enc = re.search(r"vision encoder (\d+) MiB of it", r.stderr)
    tot = re.search(r"vis-moe: total +\d+ +\d+ +(\d+) +[\d.]+% +([\d.]+)", r.stderr)   # misses, MiB loaded
    freed = re.search(r"the vision encoder is freed: slots (\d+) -> (\d+)", r.stderr)
    return {"limit_mib": limit_mib, "rc": r.returncode, "peak_mib": round(used / MIB, 1), "slots": slots,
            "encoder_mib": int(enc.group(1)) if enc else 0,
            "freed_slots": [int(freed.group(1)), int(freed.group(2))] if freed else None,
            "misses": int(tot.group(1)) if tot else None, "loaded_mib": float(tot.group(2)) if tot else None,
            "prefill_tps": _perf(r.stderr, "prompt eval time"),
            "decode_tps": _perf(r.stderr, "eval time"), "text": r.stdout, "wall_s": round(wall, 1),
            "load1": [round(load0, 2), round(load1, 2)],
            "killed": r.returncode in (-9, 137) or "Killed" in r.stderr,
            "last_log": [ln for ln in r.stderr.splitlines() if ln.strip()][-3:] if r.returncode else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("-p", "--prompt", default="Describe the image.")
    ap.add_argument("-t", "--threads", type=int, default=2)
    lim = ap.add_mutually_exclusive_group(required=True)
    lim.add_argument("--limit-mib", type=int, nargs="+")
    lim.add_argument("--limit-pct", type=float, nargs="+", help="limits in %% of the text model's file size")
    ign = ap.add_mutually_exclusive_group()
    ign.add_argument("--today-bindir", type=Path, default=None, help="a build without patch 0015 (the arm 'ignored')")
    ign.add_argument("--ignore-by-preload", action="store_true",
                     help="the arm 'ignored' is this build with the mmproj hand-over made a no-op (LD_PRELOAD)")
    ap.add_argument("--released", action="store_true",
                    help="add the arm 'released': VIS_MOE_ENCODER_RELEASE=on (the encoder freed after the image)")
    ap.add_argument("--lock", type=Path, default=None, help="flock this file around each run")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("extra", nargs="*", help="after --: llama-mtmd-cli options (-c, -ub, --image-max-tokens, -n)")
    args = ap.parse_args()
    from pyvis import _paths
    for f in (args.model, args.mmproj, args.image):
        if not Path(f).is_file():
            ap.error(f"no such file: {f}")
    if args.out and args.out.exists() and any(args.out.resolve() == Path(f).resolve()
                                              for f in (args.model, args.mmproj, args.image)):
        ap.error(f"--out {args.out} is one of the inputs; name another file")
    if args.limit_mib and not all(m > 0 for m in args.limit_mib):
        ap.error("--limit-mib: each limit must be a positive number of MiB")
    if args.limit_pct and not all(0 < p <= 100 for p in args.limit_pct):
        ap.error("--limit-pct: each limit must be in (0, 100]")
    limits = args.limit_mib or [int(Path(args.model).stat().st_size * p / 100 / MIB) for p in args.limit_pct]
    tmp = tempfile.TemporaryDirectory(prefix="bench-encoder-")
    arms = [("planned", _paths.lib_dir(), None, False)]
    if args.released:
        arms.append(("released", _paths.lib_dir(), None, True))
    if args.today_bindir:
        arms.append(("ignored", args.today_bindir, None, False))
    elif args.ignore_by_preload:
        arms.append(("ignored", _paths.lib_dir(), build_shim(Path(tmp.name)), False))
    rows = []
    for limit in limits:
        done: dict[str, dict] = {}
        for name, bindir, preload, release in arms:
            row = {"arm": name} | one(bindir, args, limit, args.extra, preload, release)
            if name != "planned" and row["rc"] == 0 and done.get("planned", {}).get("rc") == 0:
                row["same_text"] = row["text"] == done["planned"]["text"]
            done[name] = row
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
