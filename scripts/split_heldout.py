#!/usr/bin/env python3
"""Per-layer slot counts fixed from a profile, judged on held-out steps (docs/policies-limits.md): the miss curves
of one half of the decode steps split ``slots`` x layers between the layers
(pyvis.runtime.cachesim_split: ``split_by_utility`` from the floor, ``split_by_exchange`` from the even split); the
other half's misses with each split and with the same slots in every layer, as ratios to Belady's at the even
split.  Both ways round.

    .venv/bin/python scripts/split_heldout.py TRACE [--slots 16,24,32] [--policy lfu-adapt] [--as-decode]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyvis.runtime.cachesim import belady_misses  # noqa: E402
from pyvis.runtime.cachesim_replay import layer_ubatches  # noqa: E402
from pyvis.runtime.cachesim_split import miss_curves, split_by_exchange, split_by_utility  # noqa: E402
from pyvis.runtime.trace_cli import as_decode  # noqa: E402
from pyvis.runtime.trace_csv import load_any  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--slots", default="16,24,32")
    ap.add_argument("--policy", default="lfu-adapt")
    ap.add_argument("--as-decode", action="store_true", help="every token a decode step (prefill-only traces)")
    ap.add_argument("--span", type=int, help="miss curves only from SPAN slots below the smallest slot count to SPAN "
                    "above the largest (faster; the greedy split then starts from the lowest)")
    args = ap.parse_args()
    t = load_any(args.trace)
    if args.as_decode:
        t = as_decode(t)
    slots = [int(x) for x in args.slots.split(",")]
    lo, hi = t.k, min(t.n_expert, 2 * max(slots))
    caps = range(lo, hi + 1)
    if args.span is not None:
        caps = range(max(lo, min(slots) - args.span), min(hi, max(slots) + args.span) + 1)
    curves = miss_curves(t, args.policy, caps)
    halves = {}
    for il in t.layers().tolist():
        d = [i for i, f in enumerate(layer_ubatches(t, il).decode) if f]
        halves[il] = (d[:len(d) // 2], d[len(d) // 2:])
    def count(il, per, h):
        return sum(per[i] for i in halves[il][h])
    print(f"{Path(args.trace).name}: {args.policy}, decode misses / Belady's on the held-out half; the split "
          "fitted on the other half by marginal utility from the floor (greedy) or by exchange from the even split")
    print("| slots | fitted on | even | greedy | exchange | exchange: slots per layer |")
    print("|---|---|---|---|---|---|")
    for n in slots:
        opt = {}
        for il in t.layers().tolist():
            opt[il] = []
            belady_misses(layer_ubatches(t, il).sets, n, opt[il])
        for fit in (0, 1):
            ev = 1 - fit
            fitted = {il: {c: count(il, g, fit) for c, g in cs.items()} for il, cs in curves.items()}
            b = sum(count(il, opt[il], ev) for il in curves)
            cells = []
            for caps in ({il: n for il in curves}, split_by_utility(fitted, n), split_by_exchange(fitted, n)):
                cells.append(f"{sum(count(il, curves[il][caps[il]], ev) for il in curves) / b:.2f}")
            print(f"| {n} | {'first' if fit == 0 else 'second'} half | {' | '.join(cells)} | "
                  f"{min(caps.values())}..{max(caps.values())} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
