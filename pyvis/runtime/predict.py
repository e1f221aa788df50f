"""Lookahead expert prediction from routing alone: the counting, the predictors and their accuracy (issue #16).

One place for what ``pyvis calibrate predictor`` fits and evaluates (:mod:`pyvis.calibrate.predictor`) and what
``pyvis report`` calls cross-layer recall (:mod:`pyvis.testbed.routing_report`).  Notation: ``S_l(t)`` = the experts
token t selected at MoE layer l (k of E), ``M_l`` = its [T, E] 0/1 mask, d = 1..W the lookahead distance (the
target is layer l+d; model layer numbers, so a layer whose l+d is not a traced MoE layer has no table).

* **counts**: ``C_d[l][i, j]`` = tokens with i in ``S_l`` and j in ``S_{l+d}`` (``M_l^T M_{l+d}``); ``A[l][e]`` =
  tokens that selected e at layer l (WiSP Appendix C; ``../shared/papers/wisp-working-set-paging.txt``).
* **tables** (what a profile stores): ``P_d[l][i, :] = C_d[l][i, :] / sum_j C_d[l][i, j]`` (rows sum to 1; a row of
  an expert never seen at l is 0) = P(j at l+d | i at l) / k; ``freq[l][e] = A[l][e] / rows of l`` (sums to k).
* **scores** for layer l+d of token t:
  - ``frequency``: ``freq[l+d]`` (the same for every token; the baseline);
  - ``coact`` (``weighting="conditional"``, WiSP): ``sum_{i in S_l(t)} P_d[l][i, :]``;
  - ``coact`` with ``weighting="count"`` (the raw counts, what the routing report always used):
    ``sum_{i in S_l(t)} C_d[l][i, :]``; from a profile, ``sum_i freq[l][i] P_d[l][i, :]`` ranks the same.
* **prediction** = the B highest scores; ties go to the expert more used at l+d (``freq``), then to the lower id
  (``tiebreak=None``: the lower id only).
* **accuracy** per token, averaged over tokens (a token's set at l+d has k experts):
  recall@B = |pred & S_{l+d}(t)| / k, precision@B = |pred & S_{l+d}(t)| / B, wasted = B - |pred & S_{l+d}(t)|
  experts read for nothing (times the layer's expert bytes: bytes wasted per token); recall of new experts =
  sum_t |pred'(t) & N(t)| / sum_t |N(t)| with ``N(t) = S_{l+d}(t) - S_{l+d}(t-1)`` and pred' the top-B outside
  ``S_{l+d}(t-1)`` (the experts a cache of the previous token's set would miss; t-1 = the previous trace row).
* **decayed target** (VisMMOE §3.3.2 eq. 9, ``../shared/papers/vismmoe-visual-expert-affinity.txt``):
  ``g_l(t)[e] = max_{1<=d<=W} gamma^(d-1) [e in S_{l+d}(t)]`` over the expert index e (the window's layers fold onto
  one pool of E ids, as in the paper); d stops at the last traced layer.  Its prediction = the B highest of
  ``max_d gamma^(d-1) s_d[e] / sum_e s_d[e]`` (each distance's scores normalised to sum 1).  Decayed recall@B =
  ``sum_{e in pred} g[e] / sum_e g[e]`` (the paper's hot recall with each expert weighted by its target).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_LOOKAHEAD = 3
DEFAULT_GAMMA = 0.8
PREDICTORS = ("frequency", "coact")
WEIGHTINGS = ("conditional", "count")


class PredictError(ValueError):
    """Routing that cannot be counted or evaluated (no layers, bad parameters)."""


def masks(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """``[T, E]`` bool: did token t select expert e (``ids [T, k]``)."""
    ids = np.asarray(ids, np.int64)
    M = np.zeros((ids.shape[0], int(n_expert)), bool)
    if ids.size:
        np.put_along_axis(M, ids, True, axis=1)
    return M


# --------------------------------------------------------------------------
# counting
# --------------------------------------------------------------------------
@dataclass
class Counts:
    """Co-activation counts of a model over some routing (:func:`count`); add more with :meth:`add`."""
    n_layer: int
    n_expert: int
    lookahead: int
    coact: np.ndarray      # [W, L, E, E] int64: coact[d-1, l, i, j] = C_d[l][i, j]
    use: np.ndarray        # [L, E] int64: A[l][e]
    rows: np.ndarray       # [L] int64: tokens counted at layer l

    @classmethod
    def empty(cls, n_layer: int, n_expert: int, lookahead: int = DEFAULT_LOOKAHEAD) -> "Counts":
        if lookahead < 1:
            raise PredictError(f"lookahead {lookahead}: must be at least 1")
        L, E, W = int(n_layer), int(n_expert), int(lookahead)
        return cls(L, E, W, np.zeros((W, L, E, E), np.int64), np.zeros((L, E), np.int64), np.zeros(L, np.int64))

    def add(self, ids: np.ndarray, layers) -> "Counts":
        """Count routing ``ids [Lr, T, k]`` of model layers ``layers [Lr]`` (every layer holds the same T tokens)."""
        layers = [int(x) for x in layers]
        if any(not 0 <= il < self.n_layer for il in layers):
            raise PredictError(f"layers {layers[0]}..{layers[-1]} are out of range for a model of {self.n_layer}")
        M = {il: masks(ids[a], self.n_expert) for a, il in enumerate(layers)}
        for il, m in M.items():
            self.use[il] += m.sum(0)
            self.rows[il] += len(m)
            for d in range(1, self.lookahead + 1):
                if il + d in M:
                    self.coact[d - 1, il] += m.T.astype(np.int64) @ M[il + d].astype(np.int64)
        return self

    def freq(self) -> np.ndarray:
        """``[L, E]`` float64 share of each layer's tokens that selected each expert (0 for untraced layers)."""
        return self.use / np.maximum(self.rows, 1)[:, None]

    def tables(self) -> np.ndarray:
        """``[W, L, E, E]`` float64: the row-normalised ``P_d[l]``."""
        s = self.coact.sum(-1, keepdims=True)
        return np.where(s > 0, self.coact / np.maximum(s, 1), 0.0)


def count(routes: list[tuple[np.ndarray, np.ndarray]], n_layer: int, n_expert: int,
          lookahead: int = DEFAULT_LOOKAHEAD) -> Counts:
    """Counts over several ``(ids [Lr, T, k], layers [Lr])`` (e.g. :meth:`pyvis.runtime.trace.Trace.routes`)."""
    c = Counts.empty(n_layer, n_expert, lookahead)
    for ids, layers in routes:
        c.add(ids, layers)
    return c


# --------------------------------------------------------------------------
# predicting
# --------------------------------------------------------------------------
def rank(scores: np.ndarray, tiebreak: np.ndarray | None = None) -> np.ndarray:
    """``[T, E]`` expert ids by score, descending; ties by ``tiebreak`` descending, then the lower id."""
    s = np.atleast_2d(scores)
    if tiebreak is None:
        return np.argsort(-s, axis=1, kind="stable")
    perm = np.argsort(-np.asarray(tiebreak, np.float64), kind="stable")     # the tie order
    return perm[np.argsort(-s[:, perm], axis=1, kind="stable")]


def top(order: np.ndarray, B: int) -> np.ndarray:
    """``[T, E]`` bool mask of the first B of each row of ``order``."""
    pred = np.zeros(order.shape, bool)
    np.put_along_axis(pred, order[:, :min(int(B), order.shape[1])], True, axis=1)
    return pred


def coact_scores(src: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``[T, E]`` scores of a target layer: ``src [T, E]`` source-layer mask times ``table [E, E]``."""
    return src.astype(table.dtype) @ table


@dataclass
class Model:
    """What a predictor needs: per-layer frequency, the tables, and how to weight the co-activation rows."""
    freq: np.ndarray        # [L, E]
    tables: np.ndarray      # [W, L, E, E] row-normalised P_d[l]
    weighting: str = "conditional"

    @classmethod
    def from_counts(cls, c: Counts, weighting: str = "conditional") -> "Model":
        return cls(c.freq(), c.tables(), weighting)

    @property
    def lookahead(self) -> int:
        return int(self.tables.shape[0])

    def scores(self, predictor: str, src: np.ndarray, il: int, d: int) -> np.ndarray:
        """``[T, E]`` scores for layer ``il + d`` of the tokens whose layer-``il`` masks are ``src [T, E]``."""
        if predictor == "frequency":
            return np.broadcast_to(self.freq[il + d], src.shape)
        if predictor != "coact":
            raise PredictError(f"unknown predictor {predictor!r} (one of {', '.join(PREDICTORS)})")
        if self.weighting not in WEIGHTINGS:
            raise PredictError(f"unknown weighting {self.weighting!r} (one of {', '.join(WEIGHTINGS)})")
        P = self.tables[d - 1, il]
        if self.weighting == "count":
            P = P * self.freq[il][:, None]
        return coact_scores(src, P)


# --------------------------------------------------------------------------
# accuracy
# --------------------------------------------------------------------------
def hits(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """``[T]`` predicted experts the token used."""
    return (pred & truth).sum(1)


def decayed_target(truths: list[np.ndarray], gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """``[T, E]``: ``max_d gamma^(d-1) truths[d-1]`` (``truths``: the masks of layers l+1, l+2, ...)."""
    if not 0 < gamma <= 1:
        raise PredictError(f"gamma {gamma}: must be in (0, 1]")
    g = np.zeros(truths[0].shape, np.float64)
    for d, m in enumerate(truths, start=1):
        g = np.maximum(g, gamma ** (d - 1) * m)
    return g


def decayed_scores(scores: list[np.ndarray], gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """``[T, E]``: ``max_d gamma^(d-1) s_d / sum_e s_d`` (each distance normalised per token)."""
    u = np.zeros(np.shape(scores[0]), np.float64)
    for d, s in enumerate(scores, start=1):
        s = np.asarray(s, np.float64)
        tot = s.sum(1, keepdims=True)
        u = np.maximum(u, gamma ** (d - 1) * np.where(tot > 0, s / np.where(tot > 0, tot, 1), 0.0))
    return u


def decayed_recall(pred: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``[T]``: ``sum_{e in pred} g[e] / sum_e g[e]`` (NaN where the target is empty)."""
    tot = g.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, (pred * g).sum(1) / tot, np.nan)


def _gather(routes: list, E: int) -> tuple[dict, np.ndarray]:
    """``({layer: [T, E] masks}, first [T])`` of the layers that routed the most tokens; ``first`` marks each route's
    first token (it has no previous token)."""
    by_layer: dict[int, list[np.ndarray]] = {}
    first = []
    for ids, layers in routes:
        for a, il in enumerate(layers):
            by_layer.setdefault(int(il), []).append(masks(ids[a], E))
        first.append(np.arange(ids.shape[1]) == 0)
    n = {il: sum(len(m) for m in ms) for il, ms in by_layer.items()}
    M = {il: np.concatenate(ms) for il, ms in by_layer.items() if n[il] == max(n.values())}
    return M, np.concatenate(first) if first else np.zeros(0, bool)


def _distance(r: dict, s: np.ndarray, truth: np.ndarray, tiebreak: np.ndarray, first: np.ndarray, k: int,
              budgets: list[int], eb: float) -> None:
    """Append one layer's metrics at one distance to ``r`` (scores ``s``, target masks ``truth``)."""
    order = rank(s, tiebreak)
    prev = np.vstack([np.zeros((1, truth.shape[1]), bool), truth[:-1]])     # the previous row's set
    prev[first] = False
    new = truth & ~prev                                              # needed now, not used by the previous token
    order_new = rank(np.where(prev, -np.inf, s), tiebreak)           # the previous set is resident: not predicted
    keep = ~first
    for B in budgets:
        h = hits(top(order, B), truth)
        r["recall"][str(B)].append(float(h.mean() / k))
        r["precision"][str(B)].append(float(h.mean() / B))
        r["wasted_bytes"][str(B)].append(float((B - h).mean() * eb))
        hn = hits(top(order_new, B), new)[keep]
        n_new = new[keep].sum()
        r["recall_new"][str(B)].append(float(hn.sum() / n_new) if n_new else float("nan"))


def evaluate(model: Model, routes: list[tuple[np.ndarray, np.ndarray]], budgets: list[int],
             predictors: tuple[str, ...] = PREDICTORS, gamma: float = DEFAULT_GAMMA,
             expert_bytes: np.ndarray | None = None, lookahead: int | None = None) -> dict:
    """Accuracy of each predictor on held-out routing.

    Returns ``{"budgets", "gamma", "lookahead", "layers", "tokens", "k", predictor: {"d1".."dW": {"recall",
    "precision", "wasted_bytes", "recall_new"}, "decayed": {"recall"}}}``, where each leaf maps ``str(B)`` to a
    per-layer list (NaN where the layer has no target at that distance) and ``layers`` are the source layers.
    ``wasted_bytes`` is per token: ``(B - hits) * expert_bytes[l+d]`` (0 without ``expert_bytes``).  ``recall_new``:
    of the experts a token needs at l+d that the previous token (the previous row of the route) did not use there,
    the share predicted when the previous token's set is left out of the prediction (what a cache holding the last
    token's experts would still miss), summed over tokens."""
    W = int(lookahead or model.lookahead)
    if W > model.lookahead:
        raise PredictError(f"lookahead {W}: the tables hold only {model.lookahead}")
    L, E = model.freq.shape
    if not budgets or min(budgets) < 1 or max(budgets) > E:
        raise PredictError(f"budgets {budgets}: each B must be in 1..{E}")
    eb = np.zeros(L) if expert_bytes is None else np.asarray(expert_bytes, np.float64)
    M, first = _gather(routes, E)
    src_layers = sorted(il for il in M if il + 1 in M)
    if not src_layers:
        raise PredictError("the routing holds no pair of adjacent MoE layers to predict")
    k = int(next(iter(M.values())).sum(1).max())
    out: dict = {"budgets": [int(B) for B in budgets], "gamma": gamma, "lookahead": W, "layers": src_layers,
                 "tokens": int(len(M[src_layers[0]])), "k": k}
    metrics = ("recall", "precision", "wasted_bytes", "recall_new")
    for p in predictors:
        res = {f"d{d}": {m: {str(B): [] for B in budgets} for m in metrics} for d in range(1, W + 1)}
        res["decayed"] = {"recall": {str(B): [] for B in budgets}}
        for il in src_layers:
            per_d, truths = [], []
            for d in range(1, W + 1):
                r = res[f"d{d}"]
                if il + d not in M:
                    for m in metrics:
                        for B in budgets:
                            r[m][str(B)].append(float("nan"))
                    continue
                per_d.append(model.scores(p, M[il], il, d))
                truths.append(M[il + d])
                _distance(r, per_d[-1], truths[-1], model.freq[il + d], first, k, budgets, eb[il + d])
            g = decayed_target(truths, gamma)
            u_order = rank(decayed_scores(per_d, gamma), model.freq[il + 1])
            for B in budgets:
                res["decayed"]["recall"][str(B)].append(float(np.nanmean(decayed_recall(top(u_order, B), g))))
        out[p] = res
    return out


def default_budgets(k: int, E: int) -> list[int]:
    """k, and a quarter and a half of the way from k to E (recall@E is trivially 1)."""
    return sorted({k, min(E, k + max(1, (E - k) // 4)), min(E, k + max(1, (E - k) // 2))})
