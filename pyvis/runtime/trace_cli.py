"""Routing traces on the command line: ``pyvis trace import`` and ``pyvis cachesim``.

    pyvis trace import CSV -o OUT.npz
    pyvis cachesim TRACE --policy P (--slots N | --budget MIB) [--requests token|expert] [--json] [--plot PNG]

TRACE is anything :func:`pyvis.runtime.trace.load` reads: a ``--moe-trace`` file, a CSV route trace
(``../shared/traces/``) or an imported ``.npz``.  ``cachesim`` replays it through one cache per layer
(:func:`pyvis.runtime.cachesim_replay.replay`): the prompt warms the caches, decode steps are counted.  docs/policies.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from . import policies
from .cachesim_replay import replay
from .plot import pyplot
from .trace import Trace, TraceError, as_decode  # noqa: F401  (as_decode: scripts import it from here)
from .trace_csv import load_any


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got '{v}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got '{v}'")
    return n


def _mib(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MiB > 0, got '{v}'") from None
    if not np.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"expected a size in MiB > 0, got '{v}'")
    return x


def _policy(v: str) -> str:
    if v not in ("default", "belady", *policies.POLICIES):
        raise argparse.ArgumentTypeError(f"unknown policy '{v}' (one of: default, {', '.join(policies.POLICIES)}, belady)")
    return v


def _slot_list(v: str) -> list[int]:
    try:
        xs = [int(x) for x in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected slot counts like 8,16,32, got '{v}'") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected slot counts >= 1, got '{v}'")
    return sorted(set(xs))


def _same_file(a: Path, b: Path) -> bool:
    return b.exists() and os.path.samefile(a, b)


def _load(path: str) -> Trace:
    try:
        return load_any(path)
    except TraceError as e:
        raise SystemExit(f"error: {e}") from None


def _cmd_import(args: argparse.Namespace) -> int:
    src, out = Path(args.trace), Path(args.out)
    if _same_file(src, out):
        raise SystemExit(f"error: -o {out} is the input trace; choose another output file")
    t = _load(args.trace)
    t.save(out)
    n_dec = len(np.unique(t.ubatch[t.phase == 1]))
    print(f"{out}: {t.n_layer} layers x {t.n_expert} experts, top-{t.k}; {len(np.unique(t.ubatch)) - n_dec} prompt "
          f"+ {n_dec} decode steps, {len(t)} rows" + ("" if t.expert_bytes is None else ", expert sizes per layer"))
    return 0


def _slots(args: argparse.Namespace, t: Trace) -> int:
    """Slots per layer: --slots, or --budget over one expert of every traced layer."""
    layers = t.layers()
    if args.expert_bytes is not None:
        t.expert_bytes = np.full(t.n_layer, args.expert_bytes, np.int64)
    sizes = t.expert_bytes
    total = int(sizes[layers].sum()) if sizes is not None and sizes[layers].all() else None
    if args.slots is not None:
        return args.slots
    if total is None:
        raise SystemExit(f"error: {args.trace} does not say how large an expert is; --budget needs "
                         "--expert-bytes N (or use --slots)")
    n = int(args.budget * (1 << 20)) // total
    if n < 1:
        raise SystemExit(f"error: --budget {args.budget:g} MiB holds no expert per layer "
                         f"(one slot in each of {len(layers)} layers takes {total / (1 << 20):.1f} MiB)")
    return n


def summary(t: Trace, slots: int, policy: str, per_expert: bool = False, split: bool = False,
            layer_slots: dict[int, int] | None = None) -> dict:
    """The numbers ``pyvis cachesim`` prints: totals and per layer (`split`: cachesim_split.replay_split;
    `layer_slots`: fixed per-layer slot counts, as VIS_MOE_SLOT_SPLIT gives them)."""
    caps = layer_slots or None
    if layer_slots:
        res = replay(t, layer_slots, policies.DEFAULT if policy == "default" else policy, per_expert)
    elif split:
        from .cachesim_split import replay_split
        res, caps = replay_split(t, slots, policies.DEFAULT if policy == "default" else policy)
    else:
        res = replay(t, slots, policy, per_expert)
    uses = sum(r.uses for r in res)
    misses = sum(r.misses for r in res)
    opt = sum(r.belady for r in res)
    n_dec = len(np.unique(t.ubatch[t.phase == 1]))
    eb = t.expert_bytes
    opt_bytes = sum(r.belady * int(eb[r.layer]) for r in res) if eb is not None else 0
    ratio = (lambda m, b: m / b if b else (1.0 if m == 0 else float("inf")))
    return {
        "trace": t.meta.get("source", ""), "policy": policies.DEFAULT if policy == "default" else policy,
        "slots": slots, "requests": "expert" if per_expert else "token", "decode_steps": n_dec,
        "split": "fixed" if layer_slots else caps is not None,
        "uses": uses, "misses": misses, "belady_misses": opt,
        "hit_rate": 1 - misses / uses if uses else float("nan"),
        "belady_hit_rate": 1 - opt / uses if uses else float("nan"),
        "ratio_to_belady": ratio(misses, opt),
        "bytes_per_token": sum(r.bytes for r in res) / n_dec if n_dec and eb is not None else None,
        "belady_bytes_per_token": opt_bytes / n_dec if n_dec and eb is not None else None,
        "layers": [{"layer": r.layer, "uses": r.uses, "misses": r.misses, "belady_misses": r.belady,
                    "hit_rate": 1 - r.misses / r.uses if r.uses else float("nan"),
                    "ratio_to_belady": ratio(r.misses, r.belady), "bytes": r.bytes,
                    "slots": caps[r.layer] if caps else slots} for r in res],
    }


def _print(s: dict) -> None:
    mib = 1 << 20
    split = (" (split between the layers online; Belady at the even split)" if s["split"] is True else
             " on average, per layer as listed (--split-file, or what --budget leaves after whole rows; Belady at the "
             "same counts)" if s["split"] else "")
    print(f"trace {s['trace']}: policy {s['policy']}, {s['slots']} slots per layer{split}, {s['requests']} requests, "
          f"{s['decode_steps']} decode steps counted (the prompt warms the caches)")
    print(f"{'layer':>5} {'slots':>5} {'uses':>6} {'misses':>7} {'hit %':>6} {'belady':>7} {'x opt':>6} {'MiB':>8}")
    for r in s["layers"]:
        print(f"{r['layer']:>5} {r['slots']:>5} {r['uses']:>6} {r['misses']:>7} {100 * r['hit_rate']:>6.1f} "
              f"{r['belady_misses']:>7} {r['ratio_to_belady']:>6.2f} {r['bytes'] / mib:>8.1f}")
    print(f"{'all':>5} {'':>5} {s['uses']:>6} {s['misses']:>7} {100 * s['hit_rate']:>6.1f} {s['belady_misses']:>7} "
          f"{s['ratio_to_belady']:>6.2f}")
    print(f"hit rate {100 * s['hit_rate']:.1f} % (Belady {100 * s['belady_hit_rate']:.1f} %), misses "
          f"{s['ratio_to_belady']:.2f}x Belady's")
    if s["bytes_per_token"] is not None:
        print(f"bytes read per decode token: {s['bytes_per_token'] / mib:.1f} MiB "
              f"(Belady: {s['belady_bytes_per_token'] / mib:.1f} MiB)")


def _plot(args: argparse.Namespace, t: Trace, slots: int) -> None:
    out = Path(args.plot)
    plt = pyplot("--plot")
    grid = args.plot_slots or sorted({max(1, t.k * f // 2) for f in (1, 2, 3, 4, 6, 8, 12)} | {slots})
    grid = [c for c in grid if c <= t.n_expert]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in (*policies.POLICIES, "belady"):
        ys = [sum(r.misses for r in replay(t, c, name, args.requests == "expert")) for c in grid]
        ax.plot(grid, ys, marker="o", ms=3, lw=2.2 if name in ("belady", args.policy) else 1.2, label=name,
                color="black" if name == "belady" else None, ls="--" if name == "belady" else "-")
    ax.set_xlabel("slots per layer")
    ax.set_ylabel("decode misses (all layers)")
    ax.set_title(f"miss curves: {Path(args.trace).name}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"miss curves: {out}", file=sys.stderr)


def _split_file(args: argparse.Namespace, t: Trace, slots: int) -> dict[int, int] | None:
    """--split-file FILE: the per-layer slots VIS_MOE_SLOT_SPLIT=FILE gives the trace's layers at `slots` each; and
    with --budget, what is left after whole slot rows as one more slot in that many layers, as the runtime's plan
    gives it (llama_vis_moe_extra_slots: by the file's curves, else spread over depth).  None: `slots` each."""
    from . import slot_split
    from .cachesim_split import extra_slots
    if args.split and args.split_file:
        raise SystemExit("error: --split (online) and --split-file (fixed) are two splits: give one")
    layers = t.layers().tolist()
    eb = t.expert_bytes
    sf, caps = None, [slots] * len(layers)
    if args.split_file:
        try:
            sf = slot_split.read(args.split_file)
            slot_split.check_model(sf, args.split_file, layers, t.n_expert)
            rb = [int(eb[il]) for il in layers] if eb is not None and len(eb) > max(layers) else None
            caps = sf.split(slots, None, rb)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
    extra = 0
    if args.budget is not None and not args.split and slots < t.n_expert:
        left = int(args.budget * (1 << 20)) - slots * int(eb[layers].sum())
        extra = min(left // int(eb[layers].max()), len(layers) - 1)
    if extra > 0:
        caps = extra_slots(caps, extra, t.n_expert, None if sf is None else sf.curves)
    return dict(zip(layers, caps)) if sf is not None or extra > 0 else None


def _cmd_cachesim(args: argparse.Namespace) -> int:
    if args.plot and _same_file(Path(args.trace), Path(args.plot)):
        raise SystemExit(f"error: --plot {args.plot} is the input trace; choose another output file")
    t = _load(args.trace)
    if args.as_decode:
        t = as_decode(t)
    if not (t.phase == 1).any():
        raise SystemExit(f"error: {args.trace} has no decode steps to count (every ubatch routed more than one "
                         "token: a prompt only); --as-decode replays each token as a step")
    if args.split and (args.policy not in ("default", "lru", "lfu", "lfu-adapt") or args.requests == "expert"):
        raise SystemExit("error: --split runs the lru, lfu or lfu-adapt policy with token requests")
    slots = _slots(args, t)
    caps = _split_file(args, t, slots)
    s = summary(t, slots, args.policy, args.requests == "expert", args.split, caps)
    if args.json:
        print(json.dumps(s))
    else:
        _print(s)
    if args.plot:
        _plot(args, t, slots)
    return 0


def register(sub) -> None:
    s = sub.add_parser("trace", help="routing traces: import a CSV route trace (pyvis trace import)",
                       description="Routing traces (docs/policies.md).")
    tsub = s.add_subparsers(dest="trace_cmd", metavar="COMMAND", required=True)
    i = tsub.add_parser("import", help="read a CSV route trace (or a --moe-trace file) into our trace format (.npz)",
                        description="Read a CSV route trace ('# route_trace v1', e.g. ../shared/traces/) or a "
                        "--moe-trace file and write it as an .npz that every pyvis tool loads.")
    i.add_argument("trace", help="CSV route trace or --moe-trace file")
    i.add_argument("-o", "--out", required=True, help="output .npz (never the input file)")
    i.set_defaults(fn=_cmd_import)

    c = sub.add_parser("cachesim", help="replay a routing trace through per-layer expert caches under a policy",
                       description="Replay a routing trace (--moe-trace file, CSV route trace or imported .npz) "
                       "through one cache per layer: the prompt warms the caches, decode steps are counted. Prints "
                       "hit rate, bytes per token and the ratio to Belady's optimum per layer and overall.")
    c.add_argument("trace", help="routing trace")
    c.add_argument("--policy", type=_policy, default="default",
                   help=f"eviction policy: default (= what --moe-mem auto runs: {policies.DEFAULT}), "
                   f"{', '.join(policies.POLICIES)}, or belady (default: default)")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--slots", type=_positive, help="expert slots per layer")
    g.add_argument("--budget", type=_mib, metavar="MIB",
                   help="total cache in MiB over the traced layers: slots per layer = budget / one expert of each, "
                   "and what is left as one more slot in some layers, as --moe-mem plans it")
    c.add_argument("--expert-bytes", type=_positive, metavar="N",
                   help="bytes of one expert, every layer (for --budget when the trace does not say)")
    c.add_argument("--requests", choices=["token", "expert"], default="token",
                   help="token: a step's experts are resident together, as in the runtime (default); expert: the "
                   "policy loads one expert at a time, as the engine that recorded the shared CSV trace")
    c.add_argument("--split", action="store_true",
                   help="split the same total of slots between the layers online by marginal utility (lru, lfu, lfu-adapt; "
                   "simulator only, pyvis/runtime/cachesim_split.py)")
    c.add_argument("--split-file", metavar="FILE",
                   help="fixed per-layer slots: the split VIS_MOE_SLOT_SPLIT=FILE runs at attach (a file of pyvis "
                   "plan --write-split), the same total as --slots per layer")
    c.add_argument("--as-decode", action="store_true",
                   help="replay every token as a decode step of its own (traces of prefill-only runs, e.g. "
                   "llama-perplexity --moe-trace)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--plot", metavar="PNG", help="also write miss curves (misses vs slots, every policy and Belady)")
    c.add_argument("--plot-slots", type=_slot_list, metavar="N,N,...", help="slot counts of the --plot curves")
    c.set_defaults(fn=_cmd_cachesim)
