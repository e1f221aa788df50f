"""Bounds, not policies: LFU told the coming requests of a layer (what a perfect predictor of the coming tokens'
experts could add to an eviction rule), for the simulator's tables (scripts/policy_table.py `--lookahead`,
`--window`; docs/policies-limits.md).  The online policies are in pyvis.runtime.policies.
"""
from __future__ import annotations

from .cachesim import NextUse
from .policies import LFU


class NextSteps(LFU):
    """Not an online policy: LFU (decay 0.95) told the layer's next ``window`` requests; a candidate used in them
    is kept over one that is not.  It bounds what prediction-aware eviction can gain from a predictor of the
    coming steps' experts (window 1: a perfect next-token predictor)."""

    def __init__(self, requests: list[list[int]], window: int):
        super().__init__()
        self.name = f"next-{window}"
        self.window, self.i = window, 0
        self.future = NextUse(requests)

    def _next(self, e) -> float:
        """The expert's next use after the running request."""
        return self.future.after(e, self.i)

    def _soon(self, e) -> bool:
        return self._next(e) <= self.i + self.window

    def victim(self, candidates):
        return min(candidates, key=lambda e: (self._soon(e), self.score[e], self.last[e]))

    def end_step(self):
        super().end_step()
        self.i += 1


class WindowBelady(NextSteps):
    """Not an online policy: Belady's optimum within the layer's next ``window`` requests, LFU beyond them.  A
    candidate not used in the window goes first (lowest LFU score); if every candidate is, the one used last in
    it.  What a perfect predictor of the next ``window`` tokens' experts gives at best with history beyond them."""

    def __init__(self, requests: list[list[int]], window: int):
        super().__init__(requests, window)
        self.name = f"window-{window}"

    def victim(self, candidates):
        far = [e for e in candidates if not self._soon(e)]
        if far:
            return min(far, key=lambda e: (self.score[e], self.last[e]))
        return max(candidates, key=lambda e: (self._next(e), e))
