"""Offline cache simulation on routing traces: Belady's optimal policy and LRU.

The expert cache loads, per MoE layer and ubatch, the set of distinct experts
the ubatch routes to (all of them must be resident before the layer's experts
run).  `layer_requests()` turns a routing trace into that sequence of sets;
`belady_misses()` counts the loads an optimal offline cache of the same
capacity would need (evict the resident expert whose next use is farthest,
never one the current set needs), and `lru_misses()` the loads of the LRU
policy the runtime uses, so measured misses can be quoted as a ratio of the
optimum.
"""
from __future__ import annotations

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


def belady_misses(requests: list[list[int]], capacity: int) -> int:
    """Loads of an optimal offline cache of `capacity` experts serving `requests` (sets that must be resident
    together).  A set larger than the capacity is served in chunks of `capacity`, like the runtime's passes."""
    if capacity <= 0:
        raise ValueError("capacity must be > 0")
    # flatten to a sequence of steps, each a set of at most `capacity` experts
    steps: list[list[int]] = []
    for s in requests:
        for i in range(0, len(s), capacity):
            steps.append(s[i:i + capacity])
    # next use of each expert after each step
    INF = len(steps) + 1
    next_use: list[dict[int, int]] = [dict() for _ in steps]
    upcoming: dict[int, int] = {}
    for i in range(len(steps) - 1, -1, -1):
        next_use[i] = dict(upcoming)   # next use strictly after step i
        for e in steps[i]:
            upcoming[e] = i
    resident: set[int] = set()
    misses = 0
    for i, s in enumerate(steps):
        need = set(s)
        for e in s:
            if e in resident:
                continue
            misses += 1
            if len(resident) >= capacity:
                nu = next_use[i]
                victim = max((r for r in resident if r not in need), key=lambda r: nu.get(r, INF))
                resident.remove(victim)
            resident.add(e)
    return misses


def lru_misses(requests: list[list[int]], capacity: int) -> int:
    """Loads of an LRU cache of `capacity` experts (hits of a set are touched before its misses load)."""
    lru: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for s in requests:
        for i in range(0, len(s), capacity):
            chunk = s[i:i + capacity]
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
    return misses
