"""A whole routing trace through one cache per layer (`pyvis cachesim`, docs/policies.md): each layer's ubatches
with their router weights and decode flags (:func:`layer_ubatches`), replayed under a policy of
pyvis.runtime.policies or Belady's optimum, the prompt warming the caches and decode steps counted
(:func:`replay`).  The cache itself: pyvis.runtime.cachesim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import policies
from .cachesim import belady_misses, policy_misses
from .trace import Trace


@dataclass
class LayerRequests:
    """One layer's requests in ubatch order: the experts (first-seen order), their largest router weight, and
    whether the ubatch is a decode step (Trace.phase)."""
    sets: list[list[int]]
    weights: list[dict[int, float]]
    decode: list[bool]

    def per_expert(self) -> "LayerRequests":
        """One request per (ubatch, expert) in routed order: a cache that loads one expert at a time (as the
        engine that recorded the shared CSV trace does, and its README counts)."""
        sets, weights, decode = [], [], []
        for s, w, d in zip(self.sets, self.weights, self.decode):
            for e in s:
                sets.append([e])
                weights.append({e: w.get(e, math.nan)})
                decode.append(d)
        return LayerRequests(sets, weights, decode)


def layer_ubatches(t: Trace, layer: int) -> LayerRequests:
    """`layer_requests(t, layer)` with the router weights and the decode flag of each request."""
    lt = t.for_layer(layer)
    sets, weights, decode = [], [], []
    for ub in np.unique(lt.ubatch):
        m = lt.ubatch == ub
        w: dict[int, float] = {}
        for e, x in zip(lt.ids[m].reshape(-1).tolist(), lt.weights[m].reshape(-1).tolist()):
            w[int(e)] = x if int(e) not in w else max(w[int(e)], x)
        sets.append(list(w))
        weights.append(w)
        decode.append(bool(lt.phase[m].all()))
    return LayerRequests(sets, weights, decode)


@dataclass
class LayerResult:
    layer: int
    uses: int          # experts routed in decode steps (one per distinct expert per step)
    misses: int        # their loads under the policy
    belady: int        # under Belady's optimum with the same capacity
    bytes: int         # misses * the layer's expert bytes (0 when unknown)


def replay(t: Trace, capacity: int | dict[int, int], policy: str, per_expert: bool = False) -> list[LayerResult]:
    """Every layer of `t` through its own cache of `capacity` slots (or {layer: slots}) under `policy`
    (a name of pyvis.runtime.policies, or 'belady'): the prompt warms the cache, decode steps are counted.
    `per_expert`: the policy loads one expert at a time (`LayerRequests.per_expert`); Belady's optimum is always
    the runtime's, a ubatch's experts resident together (the bound the shared trace's README quotes too)."""
    out = []
    for il in t.layers().tolist():
        c = capacity[il] if isinstance(capacity, dict) else capacity
        lr = layer_ubatches(t, il)
        opt: list[int] = []
        belady_misses(lr.sets, c, opt)
        b = sum(x for x, d in zip(opt, lr.decode) if d)
        m = b
        if policy != "belady":
            run = lr.per_expert() if per_expert else lr
            got: list[int] = []
            policy_misses(run.sets, c, policies.make(policy, c), got, weights=run.weights)
            m = sum(x for x, d in zip(got, run.decode) if d)
        uses = sum(len(s) for s, d in zip(lr.sets, lr.decode) if d)
        eb = int(t.expert_bytes[il]) if t.expert_bytes is not None and il < len(t.expert_bytes) else 0
        out.append(LayerResult(il, uses, m, b, m * eb))
    return out
