"""One slot pool for every layer (simulator only; docs/policies-limits.md).

The runtime gives each MoE layer its own slots.  Here the same total, ``slots`` x layers, is one pool of
(layer, expert) slots under one policy of pyvis.runtime.policies: a layer whose routing repeats keeps more of
them, a layer whose routing wanders fewer, and the shares move as the routing does, with no split rule.
Requests run in the model's order, every layer of a step (ubatch) before the next step; the policy's step (its
clock: LFU's decay, the ghosts of lfu-adapt) ends once per step, not once per layer.  lfu-adapt's ghosts replay a
step's (layer, expert) pairs as one request.  :func:`global_belady` is the optimum of the same pool: a bound no
per-layer cache can reach, quoted beside the per-layer one.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

from . import policies, policy_bounds
from .cachesim import LayerCache, belady_misses
from .cachesim_replay import layer_ubatches
from .trace import Trace


def _steps(t: Trace):
    """Per step, in order: (layer, index of the layer's request) for every layer that routed it, layer order."""
    layers = t.layers().tolist()
    at = {il: {int(u): i for i, u in enumerate(np.unique(t.for_layer(il).ubatch).tolist())} for il in layers}
    for ub in sorted(set().union(*(set(m) for m in at.values()))):
        yield [(il, at[il][ub]) for il in layers if ub in at[il]]


def global_misses(t: Trace, slots: int, policy: "str | policies.Policy") -> dict[int, list[int]]:
    """Loads per request of each layer (in `layer_ubatches` order) with one pool of ``slots`` x layers slots under
    `policy` (a name of pyvis.runtime.policies, made for the pool's capacity, or a fresh policy)."""
    reqs = {il: layer_ubatches(t, il) for il in t.layers().tolist()}
    cap = slots * len(reqs)
    pool = LayerCache(cap, policies.make(policy, cap) if isinstance(policy, str) else policy)
    out: dict[int, list[int]] = {il: [0] * len(r.sets) for il, r in reqs.items()}
    for step in _steps(t):
        for il, i in step:
            r = reqs[il]
            if isinstance(pool.policy, GlobalNextSteps):
                pool.policy.layer = il
            out[il][i] = pool.serve([(il, e) for e in r.sets[i]],
                                    {(il, e): x for e, x in r.weights[i].items()}, end_step=False)
        pool.policy.end_step()
    return out


def global_belady(t: Trace, slots: int) -> dict[int, list[int]]:
    """Loads per request of each layer under the optimum of one pool of ``slots`` x layers slots."""
    reqs = {il: layer_ubatches(t, il) for il in t.layers().tolist()}
    seq, where = [], []
    for step in _steps(t):
        for il, i in step:
            seq.append([(il, e) for e in reqs[il].sets[i]])
            where.append((il, i))
    got: list[int] = []
    belady_misses(seq, slots * len(reqs), got)
    out: dict[int, list[int]] = {il: [0] * len(r.sets) for il, r in reqs.items()}
    for (il, i), n in zip(where, got):
        out[il][i] = n
    return out


class GlobalNextSteps(policy_bounds.NextSteps):
    """Not an online policy: the pool's LFU (decay 0.95 per step) told, for every (layer, expert), whether the
    rest of the running step (the layers after the one being served) or the next ``window`` steps use it; a
    candidate so used is kept over one that is not.  ``window`` 0: only the running step (what a perfect
    predictor of the next layers' experts from this token's earlier layers would give).  :func:`global_misses`
    sets ``layer``, the layer being served."""

    def __init__(self, t: Trace, window: int):
        reqs = {il: layer_ubatches(t, il) for il in t.layers().tolist()}
        super().__init__([[(il, e) for il, i in step for e in reqs[il].sets[i]] for step in _steps(t)], window)
        self.name = f"global next-{window}"
        self.layer = -1

    def _soon(self, key) -> bool:
        u = self.future.uses.get(key, ())
        j = bisect_right(u, self.i - 1)
        return (j < len(u) and u[j] == self.i and key[0] > self.layer) or super()._soon(key)
