"""Per-layer slot counts from one total by marginal utility, online or fixed from a profile (simulator only;
docs/policies.md, docs/policies-limits.md).

Every layer starts with the same slot count.  Each layer keeps a miss curve of its own routing, learned online:
before each use, the rank of the used expert among every expert the layer has seen, in the order of the layer's
policy (``Policy.rank_key``: LRU recency, LFU score) -- a use at rank r would have hit with more than r slots (for
LRU this is the stack distance, exact).  The counts decay by ``decay`` per step.  Every ``period`` steps, slots move
one at a time from the layer that loses least by giving one up to the layer that gains most by getting one, while
the gain beats the loss by the ``hysteresis`` margin; a layer keeps at least the trace's top-k.  Slots count alike
in every layer (the budget is in slots, not bytes).
"""
from __future__ import annotations

import math

import numpy as np

from . import policies
from .cachesim import LayerCache, belady_misses
from .cachesim_replay import LayerResult, layer_ubatches
from .trace import Trace


def replay_split(t: Trace, slots: int, policy: str, period: int = 4, hysteresis: float = 0.1, decay: float = 0.97,
                 max_moves: int = 4) -> tuple[list[LayerResult], dict[int, int]]:
    """`pyvis.runtime.cachesim_replay.replay` with the slots of ``slots * layers`` split between the layers online;
    returns the per-layer results and the final slot counts.  Belady's misses are those at ``slots`` per layer."""
    layers = t.layers().tolist()
    reqs = {il: layer_ubatches(t, il) for il in layers}
    ubs = {il: np.unique(t.for_layer(il).ubatch).tolist() for il in layers}
    at = {il: {ub: i for i, ub in enumerate(ubs[il])} for il in layers}
    caches = {il: LayerCache(slots, policies.make(policy, slots)) for il in layers}
    if not hasattr(caches[layers[0]].policy, "rank_key"):
        raise ValueError(f"the per-layer split needs a policy that ranks every expert (lru, lfu, lfu-adapt), "
                         f"not '{policy}'")
    util = {il: np.zeros(t.n_expert + 1) for il in layers}
    lo, hi = max(1, t.k), t.n_expert
    got = {il: [0] * len(ubs[il]) for il in layers}
    for step, ub in enumerate(sorted(set().union(*map(set, ubs.values())))):
        for il in layers:
            i = at[il].get(ub)
            if i is None:
                continue
            c, lr = caches[il], reqs[il]
            seen = list(c.policy.last)
            order = sorted(seen, key=c.policy.rank_key, reverse=True)
            rank = {e: r for r, e in enumerate(order)}
            util[il] *= decay
            for e in lr.sets[i]:
                util[il][rank.get(e, t.n_expert)] += 1
            got[il][i] = c.serve(lr.sets[i], lr.weights[i])
        if step % period == period - 1:
            for _ in range(max_moves):
                gain = {il: util[il][caches[il].capacity] if caches[il].capacity < hi else -1.0 for il in layers}
                loss = {il: util[il][caches[il].capacity - 1] if caches[il].capacity > lo else np.inf for il in layers}
                a = max(layers, key=gain.__getitem__)
                b = min((il for il in layers if il != a), key=loss.__getitem__)
                if not gain[a] > loss[b] * (1 + hysteresis) + 1e-12:
                    break
                caches[a].resize(caches[a].capacity + 1)
                caches[b].resize(caches[b].capacity - 1)
    out = []
    for il in layers:
        lr = reqs[il]
        opt: list[int] = []
        belady_misses(lr.sets, slots, opt)
        eb = int(t.expert_bytes[il]) if t.expert_bytes is not None else 0
        m = sum(x for x, d in zip(got[il], lr.decode) if d)
        out.append(LayerResult(il, sum(len(s) for s, d in zip(lr.sets, lr.decode) if d), m,
                               sum(x for x, d in zip(opt, lr.decode) if d), m * eb))
    return out, {il: caches[il].capacity for il in layers}


def miss_curves(t: Trace, policy: str, capacities: range) -> dict[int, dict[int, list[int]]]:
    """Per layer and capacity, the loads of each request (`layer_ubatches` order) under `policy`: the miss curves
    a profile gives (count them over any subset of the steps)."""
    from .cachesim import policy_misses
    out: dict[int, dict[int, list[int]]] = {}
    for il in t.layers().tolist():
        lr = layer_ubatches(t, il)
        out[il] = {}
        for c in capacities:
            got: list[int] = []
            policy_misses(lr.sets, c, policies.make(policy, c), got, weights=lr.weights)
            out[il][c] = got
    return out


def split_by_utility(curves: dict[int, dict[int, int]], slots: int) -> dict[int, int]:
    """Per-layer slot counts for ``slots`` x layers slots fixed from miss curves (layer -> capacity -> misses):
    every layer starts at the smallest capacity of its curve, then each slot goes to the layer whose misses it
    cuts most (greedy marginal utility, as a planner would split a budget at attach)."""
    caps = {il: min(c) for il, c in curves.items()}
    hi = {il: max(c) for il, c in curves.items()}
    for _ in range(slots * len(curves) - sum(caps.values())):
        il = max(curves, key=lambda l: curves[l][caps[l]] - curves[l][caps[l] + 1] if caps[l] < hi[l] else -1)
        caps[il] += 1
    return caps


def split_by_exchange(curves: dict[int, dict[int, float]], slots: int, hysteresis: float = 0.1,
                      row_bytes: dict[int, int] | None = None) -> dict[int, int]:
    """Per-layer slot counts for ``slots`` x layers slots fixed from miss curves (layer -> capacity -> misses),
    starting from the even split: a slot moves from the layer that loses least by giving one up to the layer that
    gains most by getting one while the gain beats the loss by the ``hysteresis`` margin (the online split's rule,
    run once on a profile), within the capacities the curves cover; with ``row_bytes`` (bytes of one slot per
    layer) only a layer whose slot is at least as large gives one up, so the bytes never exceed the even split's.
    Unlike :func:`split_by_utility` it never strays far from the even split on noisy, non-convex curves
    (docs/policies-limits.md).  src/core/vis-moe-split.cpp (llama_vis_moe_split_slots) is the same rule in C."""
    caps = {il: slots for il in curves}
    lo = {il: min(c) for il, c in curves.items()}
    hi = {il: max(c) for il, c in curves.items()}
    if any(not lo[il] <= slots <= hi[il] for il in curves):
        raise ValueError(f"the miss curves must cover {slots} slots in every layer")
    # differences within 1e-5 of the largest curve value are ties (float-rounded or scaled curves split alike)
    tol = 1e-5 * max(abs(x) for c in curves.values() for x in c.values()) + 1e-12
    while True:
        gain = {il: curves[il][caps[il]] - curves[il][caps[il] + 1] if caps[il] < hi[il] else -1 for il in curves}
        a = None
        for il in curves:                                      # the first that gains most
            if a is None or gain[il] > gain[a] + tol:
                a = il
        loss = {il: curves[il][caps[il] - 1] - curves[il][caps[il]]
                if caps[il] > lo[il] and il != a and (row_bytes is None or row_bytes[il] >= row_bytes[a]) else math.inf
                for il in curves}
        b = None
        for il in curves:                                      # the first that loses least
            if b is None or loss[il] < loss[b] - tol:
                b = il
        if not gain[a] > max(loss[b], loss[b] * (1 + hysteresis)) + tol:   # the total falls: no cycles
            return caps
        caps[a] += 1
        caps[b] -= 1


def split_slots(curves, n_expert_used: int, slots: int, row_bytes=None) -> list[int]:
    """The per-layer split VIS_MOE_SLOT_SPLIT runs at attach (llama_vis_moe_split_slots, src/core/vis-moe-split.cpp), in
    Python: ``curves`` [layers][n_expert + 1] (misses with 0..n_expert slots), ``slots`` per layer on average,
    every layer within min(top-k, slots) .. min(n_expert, 2 slots), :func:`split_by_exchange` with 10 % hysteresis.
    A list of slot counts in the curves' layer order."""
    n = len(curves[0]) - 1
    if not 1 <= n_expert_used <= n or not 1 <= slots <= n:
        raise ValueError(f"need 1 <= top-k ({n_expert_used}) <= experts ({n}) and 1 <= slots ({slots}) <= experts")
    lo, hi = min(n_expert_used, slots), min(n, 2 * slots)
    cv = {i: {c: float(row[c]) for c in range(lo, hi + 1)} for i, row in enumerate(curves)}
    rb = None if row_bytes is None else {i: int(b) for i, b in enumerate(row_bytes)}
    caps = split_by_exchange(cv, slots, 0.1, rb)
    return [caps[i] for i in range(len(curves))]


def extra_slots(slots: list[int], extra: int, n_expert: int, curves=None) -> list[int]:
    """One more slot in `extra` layers: the bytes a plan leaves after whole slot rows (llama_vis_moe_extra_slots,
    src/core/vis-moe-split.cpp, in Python; tested equal).  At most one each, none to a layer at ``n_expert``.  With
    ``curves`` [layers][n_expert + 1] the layers whose next slot saves the most misses (the first on ties); without,
    the open layers spread evenly over depth."""
    out = list(slots)
    open_ = [i for i, s in enumerate(slots) if s < n_expert]
    x = min(extra, len(open_))
    if x <= 0:
        return out
    if curves is None:
        chosen = [open_[(2 * i + 1) * len(open_) // (2 * x)] for i in range(x)]
    else:
        gain = {i: float(curves[i][slots[i]]) - float(curves[i][slots[i] + 1]) for i in open_}
        chosen = sorted(open_, key=lambda i: -gain[i])[:x]      # sorted() is stable: the first on ties
    for i in chosen:
        out[i] += 1
    return out


def profile_split(t: Trace, slots: int, policy: str = policies.DEFAULT, hysteresis: float = 0.1) -> dict[int, int]:
    """Per-layer slot counts for ``slots`` x layers slots from a profile trace: `policy`'s decode misses per layer
    at every capacity from the top-k to twice ``slots`` (:func:`miss_curves`), split by :func:`split_by_exchange`.
    The rule docs/policies-limits.md measured on held-out steps (#24's planner: a split fixed at attach)."""
    lo, hi = max(1, t.k), min(t.n_expert, 2 * slots)
    if not lo <= slots <= hi:
        raise ValueError(f"{slots} slots per layer is outside {lo}..{hi} (the top-k to the experts)")
    curves = {}
    for il, per in miss_curves(t, policy, range(lo, hi + 1)).items():
        dec = layer_ubatches(t, il).decode
        curves[il] = {c: sum(x for x, d in zip(g, dec) if d) for c, g in per.items()}
    return split_by_exchange(curves, slots, hysteresis)
