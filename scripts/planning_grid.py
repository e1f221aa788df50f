#!/usr/bin/env python3
"""Predicted vs measured tok/s on a planning grid (docs/planning.md#across-budgets-and-two-contexts): for every arm
that finished in scripts/bench_planning.py's results (one results.json per context, or per cell: cN=DIR may repeat),
the medians of its runs (bench_planning --repeat) against the cost model's decode and prefill at that arm's budget,
context and ubatch (pyvis.runtime.plan.configure_plan, the runtime's cost model: llama_vis_moe_cost_probe with its
knobs), and per grid cell the configured arm against the best arm (the oracle) by the configurator's own objective:
the median over an arm's runs of the measured seconds of one request of VIS_MOE_PLAN_PROMPT prompt + VIS_MOE_PLAN_GEN
generated tokens (--pool-plans: of one plan, over every arm that ran it).

    .venv/bin/python scripts/planning_grid.py MODEL c1024=DIR c4096=DIR [--prompt-tokens 130] [--plot PNG] [--pool-plans]

The prediction of an arm is priced for the bench's own prompt and generated tokens (recorded in results.json by
bench_planning; older results: --prompt-tokens, llama-cli's prompt in tokens, and --gen-tokens), so that the ubatch
count matches; the choice is priced for the configurator's request (VIS_MOE_PLAN_PROMPT/GEN)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyvis.runtime import plan as P  # noqa: E402


def predict(shape, cost, budget, n_ctx, ub, prompt_tokens, gen_tokens):
    """(decode tok/s, prefill tok/s, ubatch the configurator chooses) of the plan at -ub ub, as the runtime prices it."""
    c = dict(cost, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens)
    conf = P.configure_plan(shape, n_ubatch=ub, cost=c, budget_mib=budget, n_ctx=n_ctx)
    k = conf["configuration"]
    if k.get("resident"):   # loaded whole, -ub lowered to fit: price the lowered one (every expert has a slot)
        return predict(shape, cost, budget, n_ctx, k["n_ubatch"], prompt_tokens, gen_tokens)[:2] + (k["n_ubatch"],) * 2
    if not k["ok"] or not k["asked_decode_tps"]:
        return None, None, k.get("n_ubatch"), k.get("advised_n_ubatch")
    return k["asked_decode_tps"], k["asked_prefill_tps"], k["n_ubatch"], k["advised_n_ubatch"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("grids", nargs="+", metavar="cN=DIR", help="bench_planning --out DIR of context N")
    ap.add_argument("--prompt-tokens", type=int, default=130, help="the bench's prompt in tokens where results.json does not say (default: 130, the former fixed "
                         "prompt on the testbed, chat template included)")
    ap.add_argument("--gen-tokens", type=int, default=16, help="the bench's generated tokens where results.json does not say (default: 16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--before", default=None, metavar="JSON",
                    help='another cost model\'s predictions, {"C/MIB/ARM": [decode, prefill]}: a column and grey points')
    ap.add_argument("--configured-arm", default="configured",
                    help="the arm that ran the configurator (default: configured; `forced` is VIS_MOE_CONFIGURE=on, "
                         "what auto runs on all-F32 weights)")
    ap.add_argument("--pool-plans", action="store_true",
                    help="arms that ran the same plan (the same -ub and slots: today and configured where the "
                         "configurator kept -ub, configured and its sweep arm where it lowered it) count as one plan: "
                         "the oracle and the configured time are medians over every run of a plan (more runs per median)")
    ap.add_argument("--best", action="store_true",
                    help="each arm's fastest run instead of its median (the request time: its shortest)")
    a = ap.parse_args()
    shape = P.read_shape(a.model)
    from pyvis.runtime import native
    cost = native.cost_probe(shape.path, type_=shape.expert_type, n_embd=shape.n_embd, n_ff_exp=shape.n_ff_exp,
                             n_expert_used=shape.n_expert_used, n_threads=a.threads)
    req_p, req_g = cost["prompt_tokens"], cost["gen_tokens"]
    print(f"cost: read {cost['read_bps'] / 2**20:.0f} MiB/s, weights at one token {cost['mem_bps'] / 2**20:.0f} MiB/s, "
          f"prefill {cost['token_byte_s'] * 1e9 * 2**20:.0f} ns/token/MiB, pass {cost['pass_s'] * 1e6:.0f} us + "
          f"{cost['pass_token_s'] * 1e6:.2f} us/token (probed: {cost['probed']}); request {req_p} + {req_g} tokens\n")
    before = json.loads(Path(a.before).read_text()) if a.before else {}
    rows, cells = [], []
    stat_tps = (lambda v: max(v) if v else None) if a.best else (lambda v: statistics.median(v) if v else None)
    # --best: the fastest run of each arm (a shared machine's interference only slows a run), else the median
    med = (lambda v: (min(v) if v else None)) if a.best else (lambda v: statistics.median(v) if v else None)
    for g in a.grids:
        ctx, d = g.split("=", 1)
        n_ctx = int(ctx.lstrip("c"))
        res = json.loads((Path(d) / "results.json").read_text())
        for b in sorted({r["limit_mib"] for r in res}):
            # every arm's runs (bench_planning --repeat: rounds), its medians; a run's prompt and generated tokens
            # are its own (recorded by the bench; older results: --prompt-tokens, --gen-tokens)
            arms = {}
            for r in res:
                if r["limit_mib"] == b and r.get("finished"):
                    arms.setdefault(r["arm"], []).append(r)
            for arm, rs in arms.items():
                ub = rs[0]["ub_run"]
                n_p = rs[0].get("prompt_tokens") or a.prompt_tokens
                n_g = rs[0].get("n_predict") or a.gen_tokens
                pd, pp, _, _ = predict(shape, cost, b, n_ctx, ub, n_p, n_g)
                bd, bp = before.get(f"{n_ctx}/{b}/{arm}", (None, None))
                rows.append(dict(c=n_ctx, b=b, arm=arm, ub=ub, slots=rs[0].get("slots"), runs=len(rs),
                                 decode=stat_tps([r["decode_tps"] for r in rs]), prefill=stat_tps([r["prefill_tps"] for r in rs]),
                                 pred_decode=pd, pred_prefill=pp, before_decode=bd, before_prefill=bp))
            # the configurator's objective, measured: the median over the runs of each run's request seconds, of
            # each arm or (--pool-plans) of each plan (-ub, slots) over the runs of every arm that ran it
            key = {arm: (rs[0]["ub_run"], rs[0].get("slots")) if a.pool_plans else arm for arm, rs in arms.items()}
            t_key = {k: med([req_p / r["prefill_tps"] + req_g / r["decode_tps"]
                             for arm, rs in arms.items() if key[arm] == k for r in rs]) for k in set(key.values())}
            t_arm = {arm: t_key[key[arm]] for arm in arms}
            # the configurator's choice at -ub 512 for its request (as priced now), and the measured request time of
            # each arm; the oracle is the arm with the shortest median.  An -ub is measured by its sweep arm (ub=N),
            # else by an arm that ran it (today: 512)
            _, _, chosen, advised = predict(shape, cost, b, n_ctx, 512, req_p, req_g)
            t_ub = {}
            for arm, t in t_arm.items():
                ub = arms[arm][0]["ub_run"]
                if arm.startswith("ub=") or ub not in t_ub:
                    t_ub[ub] = t
            best = min(t_arm, key=t_arm.get) if t_arm else None
            tb = t_arm.get(best)
            conf = t_arm.get(a.configured_arm)
            cells.append(dict(c=n_ctx, b=b, best=best, best_ub=arms[best][0]["ub_run"] if best else None, t_best=tb,
                              configured_ub=arms[a.configured_arm][0]["ub_run"] if conf else None, t_configured=conf,
                              ratio_configured=tb / conf if conf else None,
                              t_today=t_arm.get("today"), chosen=chosen, t_chosen=t_ub.get(chosen),
                              ratio=(tb / t_ub[chosen]) if chosen in t_ub else None, advised=advised,
                              ratio_advised=(tb / t_ub[advised]) if advised in t_ub else None))
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    print("| -c | cgroup MiB | arm | -ub | slots | decode: measured / predicted (ratio) | prefill: measured / predicted (ratio) "
          "| before: predicted decode / prefill |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rd = r["decode"] / r["pred_decode"] if r["pred_decode"] else None
        rp = r["prefill"] / r["pred_prefill"] if r["pred_prefill"] else None
        r.update(ratio_decode=rd, ratio_prefill=rp)
        print(f"| {r['c']} | {r['b']} | {r['arm']} ({r['runs']}) | {r['ub']} | {r['slots'] or 'all'} | {f(r['decode'])} / "
              f"{f(r['pred_decode'])} ({f(rd, 2)}) | {f(r['prefill'])} / {f(r['pred_prefill'])} ({f(rp, 2)}) | "
              f"{f(r['before_decode'], 2)} / {f(r['before_prefill'])} |")
    rs = [x for r in rows for x in (r["ratio_decode"], r["ratio_prefill"]) if x]
    if rs:
        worst = max(max(x, 1 / x) for x in rs)
        within = sum(1 for x in rs if 1 / 1.5 <= x <= 1.5)
        print(f"\nmeasured / predicted: {min(rs):.2f}..{max(rs):.2f}; {within} of {len(rs)} within 1.5x; worst {worst:.2f}x")
    bs = [m / p for r in rows for m, p in ((r["decode"], r["before_decode"]), (r["prefill"], r["before_prefill"])) if p]
    if bs:
        print(f"before: measured / predicted {min(bs):.2f}..{max(bs):.2f}; "
              f"{sum(1 for x in bs if 1 / 1.5 <= x <= 1.5)} of {len(bs)} within 1.5x")
    print(f"\n| -c | cgroup MiB | configured arm: -ub, request s | best arm (-ub): request s | best / configured "
          f"| configured / today | priced choice now: auto's -ub, best / it | cheapest priced -ub (`on`), best / it |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['c']} | {c['b']} | {c['configured_ub'] or '-'}, {f(c['t_configured'], 2)} | {c['best']} "
              f"({c['best_ub']}): {f(c['t_best'], 2)} | {f(c['ratio_configured'], 3)} | "
              f"{f(c['t_today'] / c['t_configured'] if c['t_today'] and c['t_configured'] else None, 2)} | "
              f"{c['chosen']}, {f(c['ratio'], 3)} | {c['advised']}, {f(c['ratio_advised'], 3)} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(cost=cost, rows=rows, cells=cells), indent=1))
    if a.plot:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axs = plt.subplots(1, 2, figsize=(10, 4.5))
        for ax, key, label in ((axs[0], "decode", "decode"), (axs[1], "prefill", "prefill")):
            for n_ctx, mk in ((1024, "o"), (4096, "s")):
                ys = [r for r in rows if r["c"] == n_ctx and r["before_" + key]]
                if ys:
                    ax.scatter([r["before_" + key] for r in ys], [r[key] for r in ys], marker=mk, facecolors="none",
                               edgecolors="gray", label=f"-c {n_ctx}, the former cost model", alpha=0.6)
                xs = [r for r in rows if r["c"] == n_ctx and r["pred_" + key]]
                ax.scatter([r["pred_" + key] for r in xs], [r[key] for r in xs], marker=mk, label=f"-c {n_ctx}",
                           alpha=0.8)
            vals = [v for r in rows for v in (r[key], r["pred_" + key], r["before_" + key]) if v]
            lo, hi = min(vals) * 0.7, max(vals) * 1.4
            ax.plot([lo, hi], [lo, hi], "k:", lw=0.8, label="predicted = measured")
            ax.plot([lo, hi], [lo * 1.5, hi * 1.5], "k:", lw=0.4)
            ax.plot([lo, hi], [lo / 1.5, hi / 1.5], "k:", lw=0.4, label="1.5x")
            ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlim(lo, hi), ax.set_ylim(lo, hi)
            for axis in (ax.xaxis, ax.yaxis):   # the decades only: minor labels of a log axis overlap
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel(f"predicted {label} tok/s (measured cost model)")
            ax.set_ylabel(f"measured {label} tok/s (llama-cli in the cgroup)")
            ax.legend(fontsize=7)
        fig.suptitle("Testbed shared+16 (516 MiB), 450-800 MiB cgroups, every arm: predicted vs measured", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
