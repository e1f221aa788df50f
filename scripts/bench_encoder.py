#!/usr/bin/env python3
"""The vision encoder in the --moe-mem budget, measured (issue #24 item 2, docs/planning.md#the-vision-encoder).

llama-mtmd-cli with --moe-mem auto in a fresh memory cgroup (v1 or v2) per run and limit: the cgroup's peak, the exit
status, the slots per layer, and prefill / decode tok/s from llama_perf (-v), for this build (the encoder planned)
and for a build without patch 0015 (--today-bindir: the plan ignores the encoder, as before).  Root; page cache
dropped before each run.

  sudo .venv/bin/python scripts/bench_encoder.py -m MODEL --mmproj MMPROJ --image IMG --limit-mib 140 160 \\
       --today-bindir /path/to/old/build/bin -- -c 2048 -ub 32 --image-max-tokens 1024 -n 16
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_paging import memory_cgroup  # noqa: E402  (the tests' cgroup helper)

MIB = 1 << 20


def _perf(err: str, what: str) -> float | None:
    m = re.search(rf"llama_perf_context_print: +{what} += +[\d.]+ ms / +\d+ \w+ +\( *[\d.]+ ms per token, +([\d.]+) "
                  r"tokens per second\)", err)
    return float(m.group(1)) if m else None


def one(bindir: Path, args, limit_mib: int, extra: list[str]) -> dict:
    cmd = [bindir / "llama-mtmd-cli", "-m", args.model, "--mmproj", args.mmproj, "--image", args.image,
           "-p", args.prompt, "--temp", "0", "-t", str(args.threads), "-v", "--moe-mem", "auto", "--moe-stats", *extra]
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    env = os.environ | {"VIS_MOE_CONFIGURE": "off"}
    with memory_cgroup(limit_mib * MIB) as (wrap, peak):
        r = subprocess.run([str(c) for c in wrap(cmd)], capture_output=True, text=True, errors="replace", env=env,
                           timeout=args.timeout)
        used = peak()
    slots = sorted({int(m.group(1)) for m in re.finditer(r"vis-moe: +\d+ +(\d+) +\d+", r.stderr)})
    enc = re.search(r"vision encoder (\d+) MiB of it", r.stderr)
    return {"limit_mib": limit_mib, "rc": r.returncode, "peak_mib": round(used / MIB, 1), "slots": slots,
            "encoder_mib": int(enc.group(1)) if enc else 0, "prefill_tps": _perf(r.stderr, "prompt eval time"),
            "decode_tps": _perf(r.stderr, "eval time"), "text": r.stdout[-200:],
            "killed": r.returncode in (-9, 137) or "Killed" in r.stderr,
            "last_log": [ln for ln in r.stderr.splitlines() if ln.strip()][-3:] if r.returncode else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("-p", "--prompt", default="Describe the image.")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--limit-mib", type=int, nargs="+", required=True)
    ap.add_argument("--today-bindir", type=Path, default=None, help="a build without patch 0015 (the arm 'ignored')")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("extra", nargs="*", help="after --: llama-mtmd-cli options (-c, -ub, --image-max-tokens, -n)")
    args = ap.parse_args()
    from pyvis import _paths
    arms = [("planned", _paths.lib_dir())] + ([("ignored", args.today_bindir)] if args.today_bindir else [])
    rows = []
    for limit in args.limit_mib:
        for name, bindir in arms:
            row = {"arm": name} | one(bindir, args, limit, args.extra)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
