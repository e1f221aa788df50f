"""Benchmark the --moe-mem configurator (docs/planning.md) against today's fixed-rule plan and a sweep of fixed
ubatch sizes, each run in a fresh memory cgroup (scripts/bench_paging.py's run_one: page cache dropped first, peak
cgroup memory, prompt/generation tok/s of llama-cli, the cache table's hits and slots).

    sudo .venv/bin/python scripts/bench_planning.py MODEL --limit-mib 450 400 -c 1024 --out /tmp/plan-bench

Arms per budget: `today` (VIS_MOE_CONFIGURE=off, -ub 512: the fixed-rule plan), `configured` (the configurator as
shipped, VIS_MOE_CONFIGURE=auto, -ub 512 asked), `forced` (VIS_MOE_CONFIGURE=on), and `ub=N` (VIS_MOE_CONFIGURE=off, -ub N) for the sweep; --moe-mem auto (the cgroup's limit).  The
oracle is the sweep's best decode point.  Needs root (cgroups, drop_caches).  Results: OUT/results.json.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paging import PROMPT_WORDS, run_one  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--limit-mib", type=int, nargs="+", required=True, help="cgroup limits, MiB")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--sweep", type=int, nargs="+", default=[256, 128, 64, 32, 16], help="fixed ubatch sizes")
    ap.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                    help="run only these arms (today, configured, ub=N) at every limit (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    prompt = PROMPT_WORDS * 3
    results = []
    for limit in a.limit_mib:
        arms = [("today", 512, "off"), ("configured", 512, "auto"), ("forced", 512, "on")] + \
               [(f"ub={u}", u, "off") for u in a.sweep]
        arms = [x for x in arms if a.arms is None or x[0] in a.arms]
        for name, ub, conf in arms:
            cmd = [ROOT / "build/bin/llama-cli", "-m", a.model, "-p", prompt, "-n", a.n_predict, "-c", a.ctx_size,
                   "-ub", ub, "-st", "-t", "2", "--temp", "0", "--moe-mem", "auto", "--moe-stats"]
            log = a.out / f"{limit}-{name.replace('=', '')}.log"
            r = run_one(f"{limit}/{name}", cmd, limit * MIB, a.timeout, a.n_predict, log=log,
                        env={"VIS_MOE_CONFIGURE": conf})
            out = log.read_text(errors="replace")
            m = re.search(r"-ub (\d+) lowered to (\d+)", out)
            r.update(limit_mib=limit, arm=name, ub_asked=ub, ub_run=int(m.group(2)) if m else ub,
                     lowered=out[m.start():out.find("\n", m.start())] if m else "")
            results.append(r)
            (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n| cgroup MiB | arm | ubatch | slots | hit % | decode tok/s | prefill tok/s | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        hit = 100.0 * r["hits"] / r["routed"] if r.get("routed") else float("nan")
        print(f"| {r['limit_mib']} | {r['arm']} | {r['ub_run']} | {r.get('slots', '-')} | {hit:.1f} | "
              f"{r.get('decode_tps', '-')} | {r.get('prefill_tps', '-')} | {r['peak_bytes'] / MIB:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
