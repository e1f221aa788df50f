"""Eviction policies of the expert cache, as the simulator replays them (:func:`pyvis.runtime.cachesim.policy_misses`).

A policy sees what the runtime's policy interface (src/core/vis-moe-policy.h) sees, by expert instead of by slot:

* ``begin_pass()``: a pass starts (one ubatch of one layer runs in one or more passes);
* ``touch(e, w)``: expert ``e`` serves the running pass, a hit or a miss just loaded (``w``: its largest router
  weight in the ubatch, NaN when unknown);
* ``victim(candidates)``: the expert a miss evicts, among the resident ones the pass does not need;
* ``admit(e, victim)``: whether the miss takes the victim's slot at all (the runtime's policies always do);
* ``forget(e)``: ``e`` left the cache;
* ``end_step()``: the ubatch is over.

``lru``, ``lfu`` and ``lfu-adapt`` are the runtime's (``VIS_MOE_POLICY``; tests/test_policy.py checks runtime
misses == simulated misses); the others are simulator-only candidates, measured in docs/policies.md.  :data:`DEFAULT` is
the policy ``--moe-mem auto`` runs.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from .cachesim import LayerCache

DEFAULT = "lfu-adapt"      # what the runtime runs unless VIS_MOE_POLICY says otherwise (src/api/vis-moe-settings.h)
RUNTIME = ("lru", "lfu", "lfu-adapt")   # policies the runtime implements identically
LFU_DECAY = 0.95           # per step; the runtime's constant (src/core/vis-moe-policy.cpp)
_RESCALE_AT = 2.0 ** 200   # the runtime's: scores and the increment are scaled by 2^-200 (exact) past this


class Policy:
    name = "?"

    def begin_pass(self) -> None:
        pass

    def touch(self, e: int, w: float = math.nan) -> None:
        raise NotImplementedError

    def victim(self, candidates: list[int]) -> int:
        raise NotImplementedError

    def admit(self, e: int, victim: int) -> bool:
        """Does the miss ``e`` (before its touch) take ``victim``'s slot?  False: it is read into a scratch buffer,
        used and dropped (a cache with bypass; simulator only: the runtime admits every miss)."""
        return True

    def forget(self, e: int) -> None:
        pass

    def end_step(self) -> None:
        pass


class LRU(Policy):
    """Least recently used: one tick per touch, in touch order (the runtime's lru)."""
    name = "lru"

    def __init__(self):
        self.tick = 0
        self.last: dict[int, int] = {}

    def touch(self, e, w=math.nan):
        self.tick += 1
        self.last[e] = self.tick

    def victim(self, candidates):
        return min(candidates, key=self.last.__getitem__)

    def rank_key(self, e: int):
        """Keep-worthiness of any expert seen so far, resident or not (the victim is the lowest): the order the
        per-layer split (pyvis.runtime.cachesim_split) reads miss curves from."""
        return self.last.get(e, 0)


class LFU(LRU):
    """LFU with exponential decay (the runtime's lfu): an expert's score is the sum over its past touches of
    ``decay^(steps since)``, kept while it is evicted; the victim has the lowest score, ties to the least recent.
    The clock advances after each step in which the layer touched an expert (scores grow by ``decay^-step``
    instead of decaying; rescaled exactly by 2^-200 so they never overflow), as the runtime's does at the next
    ubatch's begin_step.  ``weighted``: a touch adds its router weight
    times the increment (the 'weight of the last uses' variant)."""

    def __init__(self, decay: float = LFU_DECAY, weighted: bool = False):
        super().__init__()
        self.decay, self.weighted = decay, weighted
        self.name = "lfu" if (decay, weighted) == (LFU_DECAY, False) else \
            f"lfu{'-weight' if weighted else ''}{'' if decay == LFU_DECAY else f'@{decay:g}'}"
        self.score: dict[int, float] = {}
        self.inc = 1.0
        self.touched = False

    def touch(self, e, w=math.nan):
        super().touch(e, w)
        add = self.inc * (w if self.weighted and w == w else 1.0)
        self.score[e] = self.score.get(e, 0.0) + add
        self.touched = True

    def victim(self, candidates):
        return min(candidates, key=lambda e: (self.score[e], self.last[e]))

    def rank_key(self, e: int):
        return (self.score.get(e, 0.0), self.last.get(e, 0))

    def end_step(self):
        if not self.touched:
            return
        self.touched = False
        self.inc = self.inc / self.decay
        if self.inc > _RESCALE_AT:
            self.inc = math.ldexp(self.inc, -200)
            for e in self.score:
                self.score[e] = math.ldexp(self.score[e], -200)


class LFUAdmit(LFU):
    """LFU with decay and an admission filter (the idea of TinyLFU, Einziger et al. 2017, with the score LFU keeps
    for evicted experts as the frequency sketch): a miss takes the victim's slot only if its score, counting this
    use, beats the victim's; else it is read, used and dropped."""
    name = "lfu-admit"

    def admit(self, e, victim):
        return self.score.get(e, 0.0) + self.inc > self.score[victim]


class LRU2(LRU):
    """LRU-2: evict the expert whose second most recent step of use is oldest (history kept while evicted)."""
    name = "lru2"

    def __init__(self):
        super().__init__()
        self.step = 0
        self.uses: dict[int, tuple[int, int]] = {}   # (previous step, last step)

    def touch(self, e, w=math.nan):
        super().touch(e, w)
        prev, last = self.uses.get(e, (-1, -1))
        if last != self.step:
            self.uses[e] = (last, self.step)

    def victim(self, candidates):
        return min(candidates, key=lambda e: (self.uses[e][0], self.last[e]))

    def end_step(self):
        self.step += 1


class ARC(Policy):
    """Adaptive replacement cache (Megiddo & Modha): T1 (seen once), T2 (seen again), ghosts B1 / B2 steer the
    target size of T1."""
    name = "arc"

    def __init__(self, capacity: int):
        self.c = capacity
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0

    def touch(self, e, w=math.nan):
        if e in self.t1:
            del self.t1[e]
            self.t2[e] = None
        elif e in self.t2:
            self.t2.move_to_end(e)
        elif e in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            del self.b1[e]
            self.t2[e] = None
        elif e in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            del self.b2[e]
            self.t2[e] = None
        else:
            self.t1[e] = None

    def victim(self, candidates):
        cs = set(candidates)
        t1 = next((e for e in self.t1 if e in cs), None)
        t2 = next((e for e in self.t2 if e in cs), None)
        return t1 if t1 is not None and (len(self.t1) > self.p or t2 is None) else t2

    def forget(self, e):
        ghost = self.b1 if e in self.t1 else self.b2
        (self.t1 if e in self.t1 else self.t2).pop(e, None)
        ghost[e] = None
        while len(ghost) > self.c:
            ghost.popitem(last=False)


class TwoQ(Policy):
    """2Q (Johnson & Shasha): new experts enter a FIFO (a quarter of the slots); one seen again while its ghost
    (half the slots) remembers it enters the main LRU."""
    name = "2q"

    def __init__(self, capacity: int):
        self.kin, self.kout = max(1, capacity // 4), max(1, capacity // 2)
        self.a1in: OrderedDict[int, None] = OrderedDict()
        self.a1out: OrderedDict[int, None] = OrderedDict()
        self.am: OrderedDict[int, None] = OrderedDict()

    def touch(self, e, w=math.nan):
        if e in self.am:
            self.am.move_to_end(e)
        elif e in self.a1in:
            pass
        elif e in self.a1out:
            del self.a1out[e]
            self.am[e] = None
        else:
            self.a1in[e] = None

    def victim(self, candidates):
        cs = set(candidates)
        a1 = next((e for e in self.a1in if e in cs), None)
        am = next((e for e in self.am if e in cs), None)
        return a1 if a1 is not None and (len(self.a1in) > self.kin or am is None) else (am if am is not None else a1)

    def forget(self, e):
        if e in self.a1in:
            del self.a1in[e]
            self.a1out[e] = None
            while len(self.a1out) > self.kout:
                self.a1out.popitem(last=False)
        else:
            self.am.pop(e, None)


class ReuseClasses(LRU):
    """Reuse-distance classes: per (use-count class, steps since last use) the layer learns online how often an
    expert is used again at the next step (the hazard, from every expert's history, resident or not), and evicts
    the expert least likely to be used within the next ``horizon`` steps."""
    name = "reuse"
    MAX_AGE = 64

    def __init__(self, horizon: int = 2):
        super().__init__()
        self.h = horizon
        self.step = 0
        self.last_step: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.used: set[int] = set()
        # prior 1 use in 2 observations per class and age
        self.n = [[2.0] * (self.MAX_AGE + 2) for _ in range(6)]
        self.u = [[1.0] * (self.MAX_AGE + 2) for _ in range(6)]

    @staticmethod
    def _cls(n: int) -> int:
        return min(5, max(0, (n - 1).bit_length()))

    def touch(self, e, w=math.nan):
        super().touch(e, w)
        self.used.add(e)

    def end_step(self):
        for e, ls in self.last_step.items():        # every expert seen before: was it used at this step?
            a = min(self.step - ls, self.MAX_AGE + 1)
            c = self._cls(self.count[e])
            self.n[c][a] += 1
            self.u[c][a] += e in self.used
        for e in self.used:
            self.last_step[e] = self.step
            self.count[e] = self.count.get(e, 0) + 1
        self.used = set()
        self.step += 1

    def _p(self, e: int) -> float:
        if e not in self.last_step:                # touched at this step only: its age is 0, class of 1 use
            a0, c = 0, 0
        else:
            a0, c = self.step - self.last_step[e], self._cls(self.count[e])
        miss = 1.0
        for a in range(a0 + 1, a0 + 1 + self.h):
            a = min(a, self.MAX_AGE + 1)
            miss *= 1 - self.u[c][a] / self.n[c][a]
        return 1 - miss

    def victim(self, candidates):
        return min(candidates, key=lambda e: (self._p(e), self.last[e]))


class LFUContext(LFU):
    """LFU with decay, plus the layer's own context: a table learned online of which experts follow which within
    ``window`` steps; the victim minimises log(score) + beta * log(predicted use after the last 3 steps' sets)."""
    name = "lfu-ctx"

    def __init__(self, beta: float = 1.0, window: int = 8, recent: int = 3):
        super().__init__()
        self.beta, self.window, self.recent = beta, window, recent
        self.follow: dict[int, dict[int, float]] = {}   # f -> e -> times e was used within window steps after f
        self.seen: dict[int, float] = {}
        self.hist: list[list[int]] = []
        self.cur: list[int] = []

    def touch(self, e, w=math.nan):
        super().touch(e, w)
        if e not in self.cur:
            self.cur.append(e)

    def end_step(self):
        super().end_step()
        if not self.cur:
            return
        for prev in self.hist[-self.window:]:
            for f in prev:
                row = self.follow.setdefault(f, {})
                for e in self.cur:
                    row[e] = row.get(e, 0.0) + 1
        for e in self.cur:
            self.seen[e] = self.seen.get(e, 0.0) + 1
        self.hist.append(self.cur)
        self.cur = []

    def victim(self, candidates):
        ctx = dict.fromkeys(candidates, 0.0)
        for prev in self.hist[-self.recent:]:
            den = max(sum(self.seen.get(f, 0.0) for f in prev), 1.0)
            for f in prev:
                row = self.follow.get(f, {})
                for e in candidates:
                    ctx[e] += row.get(e, 0.0) / den
        sc = max(self.score.values())
        return min(candidates, key=lambda e: (math.log(self.score[e] / sc + 1e-12) + self.beta * math.log(ctx[e] + 1e-3),
                                              self.last[e]))


class Hawkeye(LFU):
    """Learning from Belady's decisions on the layer's past (after Jain & Lin, Hawkeye, ISCA 2016): OPTgen replays
    the last ``history`` x capacity steps and says, at each reuse of an expert, whether the optimum would have kept
    it since its previous use; a saturating counter per expert (0..``cmax``) counts up on a kept reuse and down on a
    lost one.  The victim is an expert the counters call averse (counter <= cmax / 2) before a friendly one, then
    the lowest LFU score (decay 0.95), then the least recent.  The expert is the feature (a CPU cache's load PC)."""
    name = "hawkeye"

    def __init__(self, capacity: int, history: int = 8, cmax: int = 7):
        super().__init__()
        self.capacity, self.span, self.cmax = capacity, history * capacity, cmax
        self.occ: list[int] = []         # OPTgen's occupancy of each step still in the window
        self.base = 0                    # the step occ[0] stands for
        self.step = 0
        self.prev: dict[int, int] = {}   # the last step each expert was used in
        self.count: dict[int, int] = {}  # the predictor (unseen: cmax // 2 + 1, friendly)
        self.cur: set[int] = set()

    def touch(self, e, w=math.nan):
        super().touch(e, w)
        self.cur.add(e)

    def friendly(self, e: int) -> bool:
        return self.count.get(e, self.cmax // 2 + 1) > self.cmax // 2

    def victim(self, candidates):
        return min(candidates, key=lambda e: (self.friendly(e), self.score[e], self.last[e]))

    def end_step(self):
        if self.cur:
            s = self.step
            self.occ.append(len(self.cur))   # the step's own experts are resident together
            for e in sorted(self.cur):
                t0 = self.prev.get(e)
                if t0 is not None and s - t0 <= self.span and t0 >= self.base:
                    a, b = t0 + 1 - self.base, s - self.base   # the steps in between: kept through them?
                    kept = b <= a or max(self.occ[a:b]) < self.capacity
                    if kept:
                        for i in range(a, b):
                            self.occ[i] += 1
                    c = self.count.get(e, self.cmax // 2 + 1)
                    self.count[e] = min(self.cmax, c + 1) if kept else max(0, c - 1)
                self.prev[e] = s
            self.cur = set()
            self.step += 1
            if len(self.occ) > 2 * self.span:
                drop = len(self.occ) - self.span
                del self.occ[:drop]
                self.base += drop
        super().end_step()


class AdaptiveLFU(Policy):
    """Set dueling between decays: ghost caches of the same capacity run ``lfu`` at each decay of ``decays``
    (0.5: nearly LRU, the last use dominates; 0.95: frequency) on the layer's own requests; the real cache evicts
    by the decay whose ghost missed least, its misses fading by ``fade`` per step (ties to the later rule).
    ``rules``: other rules to duel instead (factories of fresh policies), e.g. ``ctx-adapt``."""
    name = "lfu-adapt"

    def __init__(self, capacity: int, decays: tuple[float, ...] = (0.5, LFU_DECAY), fade: float = 0.97,
                 rules: tuple | None = None):
        make = rules or tuple((lambda d=d: LFU(d)) for d in decays)
        self.rules = [m() for m in make]
        self.ghosts = [LayerCache(capacity, m()) for m in make]
        self.missed = [0.0] * len(make)
        self.fade = fade
        self.cur: list[int] = []

    def begin_pass(self):
        for p in self.rules:
            p.begin_pass()

    def touch(self, e, w=math.nan):
        for p in self.rules:
            p.touch(e, w)
        if e not in self.cur:
            self.cur.append(e)

    def _best(self) -> int:
        return min(range(len(self.rules)), key=lambda i: (self.missed[i], -i))

    def victim(self, candidates):
        return self.rules[self._best()].victim(candidates)

    @property
    def last(self) -> dict:
        """Every expert seen so far (each rule sees every touch)."""
        return self.rules[0].last

    def rank_key(self, e: int):
        """The order of the rule the victims follow now (pyvis.runtime.cachesim_split)."""
        return self.rules[self._best()].rank_key(e)

    def forget(self, e):
        for p in self.rules:
            p.forget(e)

    def end_step(self):
        for p in self.rules:
            p.end_step()
        if self.cur:
            for i, g in enumerate(self.ghosts):
                self.missed[i] = self.missed[i] * self.fade + g.serve(self.cur)
        self.cur = []


POLICIES = {
    "lru": lambda c: LRU(),
    "lfu": lambda c: LFU(),
    "lfu-weight": lambda c: LFU(weighted=True),
    "lfu-admit": lambda c: LFUAdmit(),
    "lru2": lambda c: LRU2(),
    "arc": ARC,
    "2q": TwoQ,
    "reuse": lambda c: ReuseClasses(),
    "lfu-ctx": lambda c: LFUContext(),
    "lfu-adapt": AdaptiveLFU,
    "hawkeye": Hawkeye,
    "ctx-adapt": lambda c: AdaptiveLFU(c, rules=(lambda: LFU(0.5), LFUContext)),
}


def make(name: str, capacity: int) -> Policy:
    """A fresh policy for one layer's cache of ``capacity`` experts (``default`` = :data:`DEFAULT`)."""
    name = DEFAULT if name == "default" else name
    if name not in POLICIES:
        raise ValueError(f"unknown policy '{name}' (one of: default, {', '.join(POLICIES)}, belady)")
    return POLICIES[name](capacity)
