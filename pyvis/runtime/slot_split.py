"""Split files: per-layer miss curves from a routing profile, for per-layer slot counts at attach
(VIS_MOE_SLOT_SPLIT=FILE, docs/planning.md#per-layer-slot-counts).

`pyvis plan MODEL --profile TRACE --write-split FILE` writes one (:func:`write`); the runtime reads it
(src/core/vis-moe-split.cpp) and splits the slots its plan gives every managed layer by
``llama_vis_moe_split_slots``; the simulator (``pyvis cachesim --split-file FILE``) runs the same rule in Python
(:func:`pyvis.runtime.cachesim_split.split_slots`).  Format (text)::

    vis-moe slot-split 1
    # comments
    experts N top_k K
    layer ID m_0 m_1 ... m_N        one line per MoE layer, in order: misses per decode token with 0..N slots
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .trace import Trace

MAGIC = "vis-moe slot-split 1"


@dataclass
class SplitFile:
    n_expert: int
    top_k: int
    layers: list[int]             # the recorded layer ids, one per MoE layer in order
    curves: np.ndarray            # [layers][n_expert + 1]: misses per decode token with 0..n_expert slots

    def split(self, slots: int, positions: list[int] | None = None, row_bytes=None) -> list[int]:
        """The slot counts of the layers at ``positions`` (default: all) for ``slots`` each on average: the rule
        the runtime runs (cachesim_split.split_slots); at ``slots`` >= experts, every layer holds all."""
        from .cachesim_split import split_slots
        rows = self.curves if positions is None else self.curves[positions]
        if slots >= self.n_expert:
            return [self.n_expert] * len(rows)
        return split_slots(rows, self.top_k, slots, row_bytes)


def trace_curves(t: Trace, policy: str, counts) -> dict[int, np.ndarray]:
    """Per layer of ``t``: misses per decode token under ``policy`` with each slot count of ``counts`` (0: every
    use misses, n_expert and above: none), the prompt warming the cache (pyvis cachesim's replay)."""
    from .cachesim_replay import replay
    counts = list(counts)
    out = {il: np.zeros(len(counts)) for il in t.layers().tolist()}
    for gi, s in enumerate(counts):
        if s == 0 or s >= t.n_expert:
            for il in out:
                out[il][gi] = float(t.k) if s == 0 else 0.0
            continue
        for r in replay(t, s, policy):
            out[r.layer][gi] = r.misses / r.uses * t.k if r.uses else 0.0
    return out


def profile_curves(shape, managed: list[int], profile, policy: str | None = None):
    """Per managed layer, the expected misses per decode token with s = 0..n_expert slots: the routing trace
    ``profile`` (a --moe-trace file or the shared CSV, pyvis.runtime.trace_csv.load_any) replayed through the
    runtime's eviction policy by pyvis cachesim's machinery; a layer the trace lacks gets the configurator's prior
    k (1 - s / n).  A [len(managed)][n_expert + 1] array for llama_vis_moe_configure (`pyvis plan --profile`)."""
    import numpy as np
    from . import policies
    from .trace_csv import load_any
    t = load_any(profile)
    if t.n_expert != shape.n_expert:
        raise ValueError(f"--profile {profile}: the trace has {t.n_expert} experts per layer, the model "
                         f"{shape.n_expert}; record it with this model (--moe-trace)")
    n, k = shape.n_expert, shape.n_expert_used
    curve = np.array([[k * (1 - s / n) for s in range(n + 1)] for _ in managed], dtype=np.float64)
    have = set(t.layers().tolist())
    rows = {il: i for i, il in enumerate(managed) if il in have}
    sf = _profile(str(profile), policy or policies.DEFAULT)[0]
    for il, i in rows.items():
        curve[i] = sf.curves[sf.layers.index(il)] / t.k * k
    return curve


def split_file_curves(shape, managed: list[int], path):
    """VIS_MOE_SLOT_SPLIT's curves of the managed layers, rescaled from the file's top-k to the model's: what the
    runtime's configurator prices with when the variable is set (src/plan/vis-moe-configure-context.cpp)."""
    sf = read(path)
    check_model(sf, path, shape.moe_layers, shape.n_expert)
    rows = sf.curves[[shape.moe_layers.index(il) for il in managed]]
    return rows / sf.top_k * shape.n_expert_used


@functools.lru_cache(maxsize=4)
def _profile(path: str, policy: str) -> tuple[SplitFile, list[int]]:
    """A profile trace's curves at every slot count, once per run of `pyvis plan` (the configurator's advice and
    --write-split use the same curves, so they give the same split).  A trace without decode steps (llama-perplexity
    --moe-trace) counts every token as one (`pyvis cachesim --as-decode`)."""
    from .trace import as_decode
    from .trace_csv import load_any
    t = load_any(path)
    got = from_trace(t if (t.phase == 1).any() else as_decode(t), policy)
    # a layer without decode steps (the last layer of a llama-perplexity trace computes the output rows only) gets
    # the mean curve of the others: an average layer, neither a donor nor a receiver by design
    layers = sorted(t.layers().tolist())
    mean = got.curves.mean(axis=0)
    sf = SplitFile(t.n_expert, t.k, layers, np.stack([got.curves[got.layers.index(il)] if il in got.layers else mean
                                                      for il in layers]))
    return sf, [il for il in layers if il not in got.layers]


def from_trace(t: Trace, policy: str) -> SplitFile:
    """The split file of a profile trace: ``policy``'s curves at every slot count 0..n_expert."""
    per = trace_curves(t, policy, range(t.n_expert + 1))
    layers = sorted(per)
    return SplitFile(t.n_expert, t.k, layers, np.stack([per[il] for il in layers]))


def write(sf: SplitFile, path, source: str = "", policy: str = "") -> None:
    lines = [MAGIC, f"# per MoE layer: misses per decode token with 0..{sf.n_expert} slots per layer"
             + (f", policy {policy}" if policy else "") + (f", from {source}" if source else ""),
             "# written by pyvis plan --write-split; read by VIS_MOE_SLOT_SPLIT (docs/planning.md)",
             f"experts {sf.n_expert} top_k {sf.top_k}"]
    for il, row in zip(sf.layers, sf.curves):
        lines.append(f"layer {il} " + " ".join(repr(float(x)) for x in row))
    Path(path).write_text("\n".join(lines) + "\n")


def read(path) -> SplitFile:
    """Read a split file, strictly (the runtime's checks; ValueError naming the file and the line)."""
    raw = Path(path).read_bytes()
    if raw.split(b"\n", 1)[0] != MAGIC.encode():
        what = ("this is a routing trace, not a split file (its per-layer miss curves)"
                if raw.startswith((b"VISTRACE", b"# route_trace", b"turn,")) else
                f"not a split file (the first line is not '{MAGIC}')")
        raise ValueError(f"{path}: {what}; make one with pyvis plan MODEL --profile TRACE --write-split FILE")
    text = raw.decode("utf-8", "replace").splitlines()
    n = k = 0
    layers, rows = [], []
    for i, line in enumerate(text[1:], 2):
        w = line.split()
        if not w or w[0].startswith("#"):
            continue
        if w[0] == "experts" and len(w) == 4 and w[2] == "top_k":
            n, k = int(w[1]), int(w[3])
        elif w[0] == "layer" and n > 0 and len(w) == n + 3:
            layers.append(int(w[1]))
            rows.append([float(x) for x in w[2:]])
        else:
            raise ValueError(f"{path}: line {i}: expected 'experts N top_k K' or 'layer ID' and N + 1 misses")
    if not rows or not 1 <= k <= n:
        raise ValueError(f"{path}: no layer lines, or no 'experts N top_k K' line with 1 <= K <= N")
    return SplitFile(n, k, layers, np.array(rows, dtype=np.float64))


def check_model(sf: SplitFile, path, moe_layers: list[int], n_expert: int) -> None:
    """The runtime's check: one curve per MoE layer of the model and its expert count (ValueError naming both)."""
    if len(sf.layers) != len(moe_layers) or sf.n_expert != n_expert:
        raise ValueError(f"VIS_MOE_SLOT_SPLIT {path}: it was made for a model with {len(sf.layers)} MoE layers x "
                         f"{sf.n_expert} experts, this model has {len(moe_layers)} x {n_expert}; make one for this "
                         "model with: pyvis plan MODEL --profile TRACE --write-split FILE")


def for_plan(shape, plan: dict, path) -> dict[int, int]:
    """The per-layer slots the runtime runs for `pyvis plan`'s plan: managed layer -> slots (empty: n_slots each).
    VIS_MOE_SLOT_SPLIT=path (None: no file) splits n_slots by the file's curves; then the plan's extra_slots (the
    bytes left after whole slot rows) give one more slot to the layers llama_vis_moe_extra_slots picks: by the file's
    curves, else spread over depth (src/core/vis-moe-attach-plan.cpp)."""
    from .cachesim_split import extra_slots
    sf = None
    if path:
        sf = read(path)
        check_model(sf, path, shape.moe_layers, shape.n_expert)
    extra = plan.get("extra_slots", 0)
    if not plan.get("ok") or not plan["managed_layers"] or plan["n_slots"] >= shape.n_expert or (not sf and not extra):
        return {}
    managed = shape.moe_layers[plan["pinned_layers"]:]
    pos = [shape.moe_layers.index(il) for il in managed]
    got = (sf.split(plan["n_slots"], pos, [shape.expert_bytes[il] for il in managed]) if sf
           else [plan["n_slots"]] * len(managed))
    if extra:
        got = extra_slots(got, extra, shape.n_expert, None if sf is None else sf.curves[pos])
    return dict(zip(managed, got))


def write_for_model(shape, profile, out, policy: str) -> SplitFile:
    """`pyvis plan --profile TRACE --write-split FILE`: the trace's curves for this model's MoE layers, written to
    ``out`` (never over the trace or the model)."""
    from .trace_csv import load_any
    for other in (profile, shape.path):
        if Path(out).exists() and Path(out).resolve() == Path(other).resolve():
            raise ValueError(f"--write-split {out} is an input file ({other}); choose another output file")
    t = load_any(profile)
    if t.n_expert != shape.n_expert or len(t.layers()) != len(shape.moe_layers):
        raise ValueError(f"--profile {profile}: the trace has {len(t.layers())} MoE layers x {t.n_expert} experts, "
                         f"the model {len(shape.moe_layers)} x {shape.n_expert}; record it with this model (--moe-trace)")
    sf, missing = _profile(str(profile), policy)
    write(sf, out, source=str(profile) + (f" (layers {missing}: no decode steps, the mean of the others)"
                                          if missing else ""), policy=policy)
    return sf
