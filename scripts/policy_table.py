#!/usr/bin/env python3
"""Every eviction policy of the simulator on one routing trace: decode misses / Belady's at several slot counts,
over all decode steps and over each half of them (a held-out check: no policy is fitted to the second half).

    .venv/bin/python scripts/policy_table.py TRACE [--slots 12,16,24,32] [--as-decode] [--requests expert]
                                                   [--policies P,P] [--global P,P] [--lookahead W,W] [--window W,W] [--bypass-bound]
                                                   [--json OUT]

Prints a markdown table (docs/policies.md).  TRACE: anything pyvis cachesim reads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyvis.runtime import policies, policy_bounds  # noqa: E402
from pyvis.runtime.cachesim import belady_bypass_misses, belady_misses, policy_misses  # noqa: E402
from pyvis.runtime.cachesim_global import GlobalNextSteps, global_belady, global_misses  # noqa: E402
from pyvis.runtime.cachesim_replay import layer_ubatches  # noqa: E402
from pyvis.runtime.trace_csv import load_any as load  # noqa: E402
from pyvis.runtime.trace_cli import as_decode  # noqa: E402


def _decode_sum(t, got: dict[int, list[int]]) -> list[int]:
    """Per decode step (in step order), the loads of every layer together; `got`: layer -> loads per request."""
    out = None
    for il, g in got.items():
        dec = [x for x, d in zip(g, layer_ubatches(t, il).decode) if d]
        out = dec if out is None else [a + b for a, b in zip(out, dec)]
    return out


def optimum_per_step(t, slots: int, optimum=belady_misses) -> list[int]:
    """An offline optimum of cachesim (Belady's, or with bypass) per layer, summed per decode step."""
    got = {}
    for il in t.layers().tolist():
        got[il] = []
        optimum(layer_ubatches(t, il).sets, slots, got[il])
    return _decode_sum(t, got)


def per_step(t, slots: int, name: str, per_expert: bool) -> list[int]:
    """Decode misses of a row of the table, summed over the layers, per decode step (in step order).  `name`: a
    policy (per-layer caches), ``global <policy>`` / ``global belady`` (one pool, pyvis.runtime.cachesim_global)
    or ``next-W`` / ``global next-W`` (LFU told the next W requests: a bound, policy_bounds.NextSteps,
    cachesim_global.GlobalNextSteps), ``window-W`` (Belady within the next W requests, LFU beyond:
    policy_bounds.WindowBelady) or ``belady-bypass`` (the optimum of a cache that may decline a miss: the
    bound of any admission rule, cachesim.belady_bypass_misses)."""
    if name.startswith("global "):
        pol = name.split(" ", 1)[1]
        if pol == "belady":
            return _decode_sum(t, global_belady(t, slots))
        if pol.startswith("next-"):
            return _decode_sum(t, global_misses(t, slots, GlobalNextSteps(t, int(pol[5:]))))
        return _decode_sum(t, global_misses(t, slots, pol))
    if name == "belady-bypass":
        return optimum_per_step(t, slots, belady_bypass_misses)
    got = {}
    for il in t.layers().tolist():
        lr = layer_ubatches(t, il)
        run = lr.per_expert() if per_expert else lr
        g: list[int] = []
        if name.startswith("next-"):
            p = policy_bounds.NextSteps(run.sets, int(name[5:]))
        elif name.startswith("window-"):
            p = policy_bounds.WindowBelady(run.sets, int(name[7:]))
        else:
            p = policies.make(name, slots)
        policy_misses(run.sets, slots, p, g, weights=run.weights)
        if per_expert:   # back to one count per ubatch
            it = iter(g)
            g = [sum(next(it) for _ in s) for s in lr.sets]
        got[il] = g
    return _decode_sum(t, got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--slots", default="12,16,24,32")
    ap.add_argument("--policies", default=",".join(policies.POLICIES))
    ap.add_argument("--as-decode", action="store_true", help="every token a decode step (prefill-only traces)")
    ap.add_argument("--requests", choices=["token", "expert"], default="token")
    ap.add_argument("--global", dest="pool", metavar="P,P,...", default="",
                    help="also these policies over one pool of slots x layers, and that pool's optimum "
                    "(pyvis/runtime/cachesim_global.py; token requests; with --lookahead also the pool's bound)")
    ap.add_argument("--lookahead", metavar="W,W,...", default="",
                    help="also LFU told the next W requests of each layer (a bound, not a policy; with --global "
                    "also the pool told the rest of the step and the next W steps)")
    ap.add_argument("--window", metavar="W,W,...", default="",
                    help="also Belady's order within each layer's next W requests and LFU beyond them (a bound)")
    ap.add_argument("--bypass-bound", action="store_true",
                    help="also the optimum of a cache that may decline to keep a miss (the bound of any admission "
                    "rule; token requests)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    t = load(args.trace)
    if args.as_decode:
        t = as_decode(t)
    slots = [int(x) for x in args.slots.split(",")]
    names = args.policies.split(",") if args.policies else []
    names += [f"global {p}" for p in args.pool.split(",") if p] + (["global belady"] if args.pool else [])
    names += [f"next-{int(w)}" for w in args.lookahead.split(",") if w]
    names += [f"global next-{int(w)}" for w in args.lookahead.split(",") if w and args.pool]
    names += [f"window-{int(w)}" for w in args.window.split(",") if w]
    names += ["belady-bypass"] if args.bypass_bound else []
    if (args.pool or args.bypass_bound) and args.requests == "expert":
        raise SystemExit("error: --global and --bypass-bound replay token requests")
    res: dict = {}
    belady = {c: optimum_per_step(t, c) for c in slots}
    print(f"{Path(args.trace).name}: decode misses / Belady's (first half / second half of the decode steps); "
          f"{args.requests} requests")
    print("| policy | " + " | ".join(f"{c} slots" for c in slots) + " |")
    print("|---|" + "---|" * len(slots))
    for name in names:
        cells = []
        for c in slots:
            pol, opt = per_step(t, c, name, args.requests == "expert"), belady[c]
            h = len(pol) // 2
            r = (sum(pol) / sum(opt), sum(pol[:h]) / max(sum(opt[:h]), 1), sum(pol[h:]) / max(sum(opt[h:]), 1))
            res.setdefault(name, {})[c] = {"misses": sum(pol), "belady": sum(opt), "ratio": r[0],
                                           "first_half": r[1], "second_half": r[2]}
            cells.append(f"{r[0]:.2f} ({r[1]:.2f} / {r[2]:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
