"""Offline simulation of the expert cache on routing traces: Belady's optimal policy and LRU.

The expert cache loads, per MoE layer and ubatch, the set of distinct experts
the ubatch routes to (all of them must be resident before the layer's experts
run).  `layer_requests()` turns a routing trace into that sequence of sets
(`token_requests()`: one set per token, as decoding one token at a time);
`belady_misses()` counts the loads an optimal offline cache of the same
capacity would need (evict the resident expert whose next use is farthest,
never one the current set needs), and `lru_misses()` the loads of the LRU
policy the runtime uses (tests/test_paging.py: equal to the runtime's misses),
so measured misses can be quoted as a ratio of the optimum.  `policy_misses()`
replays any policy of pyvis.runtime.policies the same way (`lru` gives
`lru_misses()`'s count; `lfu` equals the runtime's VIS_MOE_POLICY=lfu), and
pyvis.runtime.cachesim_replay runs a whole trace, counting decode misses after
the prompt warmed each cache (`pyvis cachesim`).  The one
simulator of the project: `pyvis report` (pyvis.testbed.routing_report) and
scripts/bench_paging.py use it too.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict

import numpy as np

from .trace import Trace


def layer_requests(t: Trace, layer: int) -> list[list[int]]:
    """Per ubatch, the distinct experts layer `layer` routed (first-seen order)."""
    lt = t.for_layer(layer)
    out: list[list[int]] = []
    for ub in np.unique(lt.ubatch):
        rows = lt.ids[lt.ubatch == ub].reshape(-1)
        seen: dict[int, None] = {}
        for e in rows.tolist():
            seen.setdefault(int(e), None)
        out.append(list(seen))
    return out


def token_requests(ids: np.ndarray) -> list[list[int]]:
    """One request per token: the rows of ``ids [T, k]`` (one layer's routing), duplicates dropped."""
    return [list(dict.fromkeys(int(e) for e in row)) for row in np.asarray(ids).tolist()]


def _chunks(s: list[int], resident, capacity: int) -> list[list[int]]:
    """The runtime's passes for one request: resident experts first, then the rest, `capacity` at a time."""
    order = [e for e in s if e in resident] + [e for e in s if e not in resident]
    return [order[j:j + capacity] for j in range(0, len(order), capacity)]


def _bypass(i: int, streamed: list[bool] | None, per_request: list[int] | None, cache=None) -> bool:
    """Request i is streamed (see `stream_rule`): no loads; the cache unchanged, or emptied when the slabs were
    lent to the page cache (`cache` given: --moe-stream-lend, src/features/vis-moe-lend.h)."""
    if streamed is None or not streamed[i]:
        return False
    if cache is not None:
        cache.clear()
    if per_request is not None:
        per_request.append(0)
    return True


class NextUse:
    """The requests that use each expert (`uses`: expert -> ascending request indices; `skip[i]` leaves request i
    out): ``after(e, i)`` is the first use of `e` strictly after request i, ``math.inf`` when there is none.  The
    future that Belady's optimum and the lookahead bounds (pyvis.runtime.policy_bounds) read."""

    def __init__(self, requests: list[list], skip: list[bool] | None = None):
        self.uses: dict = {}
        for i, s in enumerate(requests):
            if skip is None or not skip[i]:
                for e in s:
                    self.uses.setdefault(e, []).append(i)

    def after(self, e, i: int) -> float:
        u = self.uses.get(e, ())
        j = bisect_right(u, i)
        return u[j] if j < len(u) else math.inf


def belady_misses(requests: list[list[int]], capacity: int, per_request: list[int] | None = None,
                  streamed: list[bool] | None = None, lent: bool = False) -> int:
    """Loads of an optimal offline cache of `capacity` experts serving `requests` (sets that must be resident
    together; a set larger than the capacity is served in passes, as the runtime does).  On a miss it evicts
    the resident expert whose next use is farthest, never one the current pass needs.
    `per_request`, if given, receives the loads of each request.  `streamed[i]` marks a request the runtime serves
    by prefill streaming (see `stream_rule`): it bypasses the cache, which it neither loads nor changes (`lent`:
    which it empties, as the runtime does when it lends the slabs to the page cache)."""
    if capacity <= 0:
        raise ValueError("capacity must be > 0")
    next_use = NextUse(requests, streamed).after   # the streamed requests use nothing

    resident: set[int] = set()
    misses = 0
    for i, s in enumerate(requests):
        before = misses
        if _bypass(i, streamed, per_request, resident if lent else None):
            continue
        chunks = _chunks(s, resident, capacity)
        for ci, chunk in enumerate(chunks):
            need = set(chunk)
            later = {e for c in chunks[ci + 1:] for e in c}   # needed again by this request's later passes
            for e in chunk:
                if e in resident:
                    continue
                misses += 1
                if len(resident) >= capacity:
                    victim = max((r for r in resident if r not in need),
                                 key=lambda r: i if r in later else next_use(r, i))
                    resident.remove(victim)
                resident.add(e)
        if per_request is not None:
            per_request.append(misses - before)
    return misses


def belady_bypass_misses(requests: list[list[int]], capacity: int, per_request: list[int] | None = None) -> int:
    """Loads of the optimal offline cache that may also decline to keep a miss: the expert is read into a scratch
    buffer, used and dropped (a cache with bypass).  A bound below `belady_misses` for any admission rule (a policy
    that declines some misses, e.g. TinyLFU): per request, the missed experts in order of next use, each taking the
    place of the resident expert the request does not need whose next use is farthest, if its own next use is
    sooner; the rest are read and dropped.  No streaming, passes or lending: every request is served whole."""
    if capacity <= 0:
        raise ValueError("capacity must be > 0")
    next_use = NextUse(requests).after

    resident: set[int] = set()
    misses = 0
    for i, s in enumerate(requests):
        need = set(s)
        missed = sorted((e for e in need if e not in resident), key=lambda e: (next_use(e, i), e))
        misses += len(missed)
        for e in missed:
            if len(resident) < capacity:
                resident.add(e)
                continue
            free = [r for r in resident if r not in need]
            if not free:
                continue
            victim = max(free, key=lambda r: (next_use(r, i), r))
            if next_use(e, i) < next_use(victim, i):
                resident.remove(victim)
                resident.add(e)
        if per_request is not None:
            per_request.append(len(missed))
    return misses


def stream_rule(n_tokens: int, k: int, n_expert: int, capacity: int, stream_passes: int = 8) -> bool:
    """Does the runtime stream a ubatch of n_tokens through a layer instead of serving it from the slabs?  When
    the most passes it could need, ceil(min(n_expert, k * n_tokens) / capacity), exceed stream_passes
    (VIS_MOE_STREAM_PASSES, default 8; 0 = never).  CPU-only runs."""
    return stream_passes > 0 and -(-min(n_expert, k * n_tokens) // capacity) > stream_passes


def ubatch_tokens(t: Trace, layer: int) -> np.ndarray:
    """Rows each ubatch routed through `layer`, in the order of `layer_requests` (1 = a decode step)."""
    return np.unique(t.for_layer(layer).ubatch, return_counts=True)[1]


def stream_flags(t: Trace, layer: int, capacity: int, stream_passes: int = 8) -> list[bool]:
    """Per request of `layer_requests(t, layer)`: did the runtime stream it (`stream_rule`)?"""
    return [stream_rule(int(n), t.n_expert_used, t.n_expert, capacity, stream_passes) for n in ubatch_tokens(t, layer)]


def lru_misses(requests: list[list[int]], capacity: int, per_request: list[int] | None = None,
               streamed: list[bool] | None = None, lent: bool = False,
               resident_before: list[set[int]] | None = None) -> int:
    """Loads of the runtime's LRU cache of `capacity` experts (a pass touches its hits before loading).
    `per_request`, if given, receives the loads of each request; `streamed` and `lent` as in `belady_misses`;
    `resident_before`, if given, the experts resident when each request began."""
    lru: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for i, s in enumerate(requests):
        before = misses
        if resident_before is not None:
            resident_before.append(set(lru))
        if _bypass(i, streamed, per_request, lru if lent else None):
            continue
        for chunk in _chunks(s, lru, capacity):
            need = set(chunk)
            for e in chunk:
                if e in lru:
                    lru.move_to_end(e)
            for e in chunk:
                if e in lru:
                    continue
                misses += 1
                if len(lru) >= capacity:
                    victim = next(r for r in lru if r not in need)
                    del lru[victim]
                lru[e] = None
        if per_request is not None:
            per_request.append(misses - before)
    return misses


class LayerCache:
    """One layer's cache of `capacity` experts under `policy` (a fresh :class:`pyvis.runtime.policies.Policy`),
    served as the runtime serves it: each pass of a request touches its hits, then loads its misses, each
    evicting ``policy.victim`` of the resident experts the pass does not need; every request ends a step."""

    def __init__(self, capacity: int, policy: "Policy"):
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity, self.policy = capacity, policy
        self.resident: set[int] = set()

    def serve(self, s: list[int], w: dict[int, float] | None = None, end_step: bool = True) -> int:
        """Loads of one request (`w`: expert -> router weight); `end_step=False` leaves the policy's step open
        (a pool shared by the layers ends its step once per token: pyvis.runtime.cachesim_global)."""
        w = w or {}
        p, resident, loads = self.policy, self.resident, 0
        for chunk in _chunks(s, resident, self.capacity):
            p.begin_pass()
            need = set(chunk)
            for e in chunk:
                if e in resident:
                    p.touch(e, w.get(e, math.nan))
            for e in chunk:
                if e in resident:
                    continue
                loads += 1
                if len(resident) < self.capacity:
                    resident.add(e)
                else:
                    victim = p.victim([r for r in resident if r not in need])
                    if p.admit(e, victim):    # else read into a scratch buffer, used and dropped
                        resident.remove(victim)
                        p.forget(victim)
                        resident.add(e)
                p.touch(e, w.get(e, math.nan))
        if end_step:
            p.end_step()
        return loads

    def bypass(self, lent: bool) -> None:
        """A streamed request: no loads; the cache emptied when the slabs were lent (see `belady_misses`)."""
        if lent:
            for e in self.resident:
                self.policy.forget(e)
            self.resident.clear()
        self.policy.end_step()

    def resize(self, capacity: int) -> None:
        """Change the capacity between requests, evicting by the policy down to it."""
        self.capacity = capacity
        while len(self.resident) > capacity:
            self._evict(list(self.resident))

    def _evict(self, candidates: list[int]) -> None:
        victim = self.policy.victim(candidates)
        self.resident.remove(victim)
        self.policy.forget(victim)


def policy_misses(requests: list[list[int]], capacity: int, policy: "Policy",
                  per_request: list[int] | None = None, streamed: list[bool] | None = None, lent: bool = False,
                  weights: list[dict[int, float]] | None = None) -> int:
    """Loads of `policy` serving `requests` with `capacity` slots (:class:`LayerCache`).  `per_request`,
    `streamed`, `lent` as in `belady_misses`; `weights[i]`: expert -> router weight in request i."""
    cache = LayerCache(capacity, policy)
    misses = 0
    for i, s in enumerate(requests):
        if _bypass(i, streamed, per_request):
            cache.bypass(lent)
            continue
        n = cache.serve(s, weights[i] if weights is not None else None)
        misses += n
        if per_request is not None:
            per_request.append(n)
    return misses
