"""``pyvis testbed gates``: how skewed a model's top-k gate weights are, and how its decode routing turns over.

For each routing trace (a ``--moe-trace`` file, the shared CSV trace, or an ``.npz``), decode steps only
(``--as-decode``: every token, for prefill-only traces):

* **gate medians**: each routed row's k weights, normalised to sum 1 and sorted, largest first; the median of
  each rank over all rows and layers.  An uninformative gate (MoEfication) gives ``1/k`` at every rank; the
  recorded Qwen3-30B-A3B trace gives 0.25 at rank 1 and 0.11 at rank 6 of 6;
* **next-step overlap**: ``|S_l(t) & S_l(t-1)| / k`` averaged over steps and layers
  (:func:`pyvis.testbed.routing_report.reuse`);
* **reuse distance**: for each use of an expert at a layer, the number of steps since that expert's previous
  use at that layer (first uses are not counted); the median and the share within 8 steps.

The cache side (LRU against Belady) is ``pyvis cachesim`` on the same traces (docs/policies.md).
"""
from __future__ import annotations

import json
import sys

import numpy as np

from ..runtime.trace import Trace, TraceError
from .routing_report import reuse


def decode_only(t: Trace) -> Trace:
    if t.phase is None or not (t.phase == 1).any():
        raise TraceError(f"{t.meta.get('source', 'trace')}: no decode steps (record a llama-cli generation, or "
                         "pass --as-decode for a llama-perplexity trace)")
    return t.for_mask(t.phase == 1)


def rank_medians(t: Trace) -> list[float]:
    """Median of each rank of the normalised, sorted top-k weights over every row of ``t``."""
    w = np.asarray(t.weights, np.float64)
    if not np.isfinite(w).all():
        raise TraceError(f"{t.meta.get('source', 'trace')}: the trace has no gate weights")
    p = -np.sort(-(w / w.sum(1, keepdims=True)), axis=1)
    return [float(x) for x in np.median(p, axis=0)]


def reuse_distances(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """``ids [L, T, k]`` -> the distances (in steps) between consecutive uses of an expert at a layer."""
    out = []
    for l in range(ids.shape[0]):
        last = np.full(n_expert, -1, np.int64)
        for step, row in enumerate(ids[l]):
            prev = last[row]
            out.append(step - prev[prev >= 0])
            last[row] = step
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def gate_stats(t: Trace, as_decode: bool = False) -> dict:
    """``as_decode``: every row counts, each token a step (prefill-only traces such as llama-perplexity's)."""
    d = t if as_decode else decode_only(t)
    ids, _ = d.routes()
    dist = reuse_distances(ids, d.n_expert)
    return {"trace": t.meta.get("source", ""), "n_expert": d.n_expert, "k": int(ids.shape[2]),
            "layers": int(ids.shape[0]), "decode_steps": int(ids.shape[1]), "rank_medians": rank_medians(d),
            "next_step_overlap": float(np.mean(reuse(d))), "overlap_random": ids.shape[2] / d.n_expert,
            "reuse_distance_median": float(np.median(dist)) if len(dist) else float("nan"),
            "reuse_within_8": float((dist <= 8).mean()) if len(dist) else float("nan")}


def format_stats(rows: list[dict]) -> str:
    out = ["trace | E | k | layers | steps | gate median per rank | overlap (random) | median reuse dist | "
           "reuse <= 8"]
    for r in rows:
        med = " ".join(f"{x:.3f}" for x in r["rank_medians"])
        out.append(f"{r['trace']} | {r['n_expert']} | {r['k']} | {r['layers']} | {r['decode_steps']} | {med} | "
                   f"{r['next_step_overlap']:.2f} ({r['overlap_random']:.2f}) | {r['reuse_distance_median']:.0f} | "
                   f"{100 * r['reuse_within_8']:.0f} %")
    return "\n".join(out)


def _cmd_gates(args) -> int:
    from ..runtime.trace_csv import load_any
    try:
        rows = []
        for p in args.trace:
            t = load_any(p)
            t.meta.setdefault("source", p)
            rows.append(gate_stats(t, args.as_decode))
    except (TraceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=1) if args.json else format_stats(rows))
    return 0


def register(tsub) -> None:
    """Under ``pyvis testbed`` (registered by :mod:`.train_moe`)."""
    s = tsub.add_parser("gates", help="gate-weight medians per rank and decode turnover of routing traces")
    s.add_argument("trace", nargs="+", help="--moe-trace file, CSV route trace or .npz")
    s.add_argument("--as-decode", action="store_true", help="count every row, each token a step (for "
                   "prefill-only traces, e.g. llama-perplexity --moe-trace)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(fn=_cmd_gates)
