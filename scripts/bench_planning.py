"""Benchmark the --moe-mem configurator (docs/planning.md) against today's fixed-rule plan and a sweep of fixed
ubatch sizes, each run in a fresh memory cgroup (scripts/bench_paging.py's run_one: page cache dropped first, peak
cgroup memory, prompt/generation tok/s of llama-cli, the cache table's hits and slots).

    sudo .venv/bin/python scripts/bench_planning.py MODEL --limit-mib 450 700 -c 4096 -n 32 --repeat 3 \\
         --arms today configured ub=512 ub=256 ub=128 ub=64 ub=32 --out /tmp/plan-bench

Arms per budget: `today` (VIS_MOE_CONFIGURE=off, -ub 512: the fixed-rule plan), `default` (what --moe-mem runs
with no knob set: the configurator and borrowed slots, both auto), `configured` (the configurator, VIS_MOE_CONFIGURE=auto,
-ub 512 asked, no borrowed slots), `forced` (VIS_MOE_CONFIGURE=on), `borrowed` (today's -ub 512 with VIS_MOE_BORROW=on:
decode ubatches run the slots of the compute buffer's idle bytes), `configured+borrowed` (both on: the default but
for VIS_MOE_BORROW=on), and `ub=N` (VIS_MOE_CONFIGURE=off, -ub N) and `ub=N+borrowed` (the same with
VIS_MOE_BORROW=on) for the sweep; every arm but `default` sets VIS_MOE_BORROW (on where its name says borrowed, else
off); --moe-mem auto (the cgroup's limit).  With --repeat N every budget runs N rounds, each round every arm once in
turn (arms interleaved, so a slow minute of a shared machine hits all of them).

The objective is the configurator's: the seconds of one request of --request P G tokens (default 512 + 128, the
VIS_MOE_PLAN_PROMPT/GEN defaults), P / prefill tok/s + G / decode tok/s of each run.  The prompt is made --prompt-tokens
tokens long (default: P, counted on the model's own --moe-trace once, outside the cgroup), so the prefill tok/s
measured is that of a prompt of the request's length: a shorter one cut in fewer ubatches would favour small ubatches.
Per budget and arm the table shows the medians over the rounds and the spread of the request time; the oracle is the
arm with the shortest median request.  Needs root (cgroups, drop_caches).  Results: OUT/results.json (every run) and
OUT/summary.json (the medians).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paging import PROMPT_WORDS, calibrate_prompt, run_one  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def request_s(r: dict, p: int, g: int) -> float | None:
    """seconds of one request of p prompt + g generated tokens at a run's measured tok/s (None: not finished)"""
    if not r.get("finished") or not r.get("prefill_tps") or not r.get("decode_tps"):
        return None
    return p / r["prefill_tps"] + g / r["decode_tps"]


def summarize(results: list[dict]) -> list[dict]:
    """per (budget, arm): medians over its finished runs, the request time's spread, and per budget the oracle"""
    rows = []
    for limit in dict.fromkeys(r["limit_mib"] for r in results):
        cell = [r for r in results if r["limit_mib"] == limit]
        for arm in dict.fromkeys(r["arm"] for r in cell):
            rs = [r for r in cell if r["arm"] == arm]
            ok = [r for r in rs if r.get("request_s") is not None]
            med = lambda k: statistics.median([r[k] for r in ok]) if ok else None  # noqa: E731
            t = [r["request_s"] for r in ok]
            rows.append(dict(limit_mib=limit, arm=arm, runs=len(rs), finished=len(ok),
                             ub_run=sorted({r["ub_run"] for r in rs}), slots=sorted({r.get("slots") or 0 for r in ok}),
                             decode_tps=med("decode_tps"), prefill_tps=med("prefill_tps"), request_s=med("request_s"),
                             request_min=min(t) if t else None, request_max=max(t) if t else None,
                             peak_mib=max(r["peak_bytes"] for r in rs) / MIB,
                             load=sorted({r["load_avg"] for r in rs})))
        done = [x for x in rows if x["limit_mib"] == limit and x["request_s"] is not None]
        best = min(done, key=lambda x: x["request_s"]) if done else None
        for x in rows:
            if x["limit_mib"] == limit:
                x["oracle_arm"] = best["arm"] if best else None
                x["vs_oracle"] = best["request_s"] / x["request_s"] if best and x["request_s"] else None
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--limit-mib", type=int, nargs="+", required=True, help="cgroup limits, MiB")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--sweep", type=int, nargs="+", default=[256, 128, 64, 32, 16], help="fixed ubatch sizes")
    ap.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                    help="run only these arms (today, default, configured, forced, borrowed, configured+borrowed, "
                         "ub=N, ub=N+borrowed) at every limit (default: all; an ub=N arm named here need not be in "
                         "--sweep)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds per budget, the arms interleaved (default 1)")
    ap.add_argument("--request", type=int, nargs=2, default=[512, 128], metavar=("P", "G"),
                    help="the objective: one request of P prompt + G generated tokens (default 512 128)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="the prompt's length in tokens (default: the request's P; 0: the former fixed prompt, "
                         "three sentences, 130 tokens on the testbed)")
    ap.add_argument("--bindir", type=Path, default=ROOT / "build/bin")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error(f"--repeat {a.repeat}: need at least one round")
    if a.out.resolve() == a.model.resolve().parent:
        ap.error("--out: give a directory of its own, not the model's")
    a.out.mkdir(parents=True, exist_ok=True)
    req_p, req_g = a.request
    n_prompt = req_p if a.prompt_tokens is None else a.prompt_tokens
    if n_prompt > 0:
        prompt, n_prompt = calibrate_prompt(a.bindir, a.model, n_prompt, a.out,
                                  ["-c", str(2 * n_prompt + 64), "-ub", str(2 * n_prompt), "--moe-mem", "100000"],
                                  exact=False, what="--prompt-tokens")
    else:
        prompt, n_prompt = PROMPT_WORDS * 3, None   # not counted (130 tokens on the testbed, its template included)
    (a.out / "prompt.txt").write_text(prompt)
    arms = [("today", 512, "off"), ("default", 512, "auto"), ("configured", 512, "auto"), ("forced", 512, "on"),
            ("borrowed", 512, "off"), ("configured+borrowed", 512, "auto")] + \
           [(f"ub={u}", u, "off") for u in a.sweep]
    if a.arms is not None:
        named = {x[0] for x in arms}
        for x in a.arms:
            m = re.fullmatch(r"ub=(\d+)(\+borrowed)?", x)
            if x not in named and not m:
                ap.error(f"--arms {x}: not an arm (today, default, configured, forced, borrowed, configured+borrowed, "
                         f"ub=N, ub=N+borrowed)")
            if m and x not in named:
                arms.append((x, int(m.group(1)), "off"))
        arms = [x for x in arms if x[0] in a.arms]
    results = []
    for limit in a.limit_mib:
        for rnd in range(a.repeat):
            for name, ub, conf in arms:
                cmd = [a.bindir / "llama-cli", "-m", a.model, "-p", prompt, "-n", a.n_predict, "-c", a.ctx_size,
                       "-ub", ub, "-st", "-t", "2", "--temp", "0", "--moe-mem", "auto", "--moe-stats"]
                tag = name.replace("=", "") + (f"-r{rnd + 1}" if a.repeat > 1 else "")
                log = a.out / f"{limit}-{tag}.log"
                r = run_one(f"{limit}/{name}#{rnd + 1}", cmd, limit * MIB, a.timeout, a.n_predict, log=log,
                            env={"VIS_MOE_CONFIGURE": conf,
                                 "VIS_MOE_BORROW": "auto" if name == "default" else "on" if "borrowed" in name else "off"})
                out = log.read_text(errors="replace")
                m = re.search(r"-ub (\d+) lowered to (\d+)", out)
                r.update(limit_mib=limit, arm=name, round=rnd + 1, ub_asked=ub,
                         ub_run=int(m.group(2)) if m else ub, prompt_tokens=n_prompt, n_predict=a.n_predict,
                         lowered=out[m.start():out.find("\n", m.start())] if m else "")
                r["request_s"] = request_s(r, req_p, req_g)
                results.append(r)
                (a.out / "results.json").write_text(json.dumps(results, indent=1))
    rows = summarize(results)
    (a.out / "summary.json").write_text(json.dumps(dict(request=a.request, prompt_tokens=n_prompt, rows=rows), indent=1))
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    print(f"\nmedians of {a.repeat} round(s); request = {req_p} prompt + {req_g} generated tokens "
          f"(the prompt run: {n_prompt or 'not counted'} tokens)")
    print("| cgroup MiB | arm | ubatch | slots | finished | decode tok/s | prefill tok/s | request s (min-max) | "
          "oracle / arm | peak MiB | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['limit_mib']} | {x['arm']} | {'/'.join(map(str, x['ub_run']))} | "
              f"{'/'.join(str(s or 'all') for s in x['slots']) or '-'} | {x['finished']}/{x['runs']} | "
              f"{f(x['decode_tps'])} | {f(x['prefill_tps'])} | {f(x['request_s'], 2)} ({f(x['request_min'], 2)}-"
              f"{f(x['request_max'], 2)}) | {f(x['vs_oracle'], 3)} | {x['peak_mib']:.0f} | "
              f"{'/'.join(map(str, x['load']))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
