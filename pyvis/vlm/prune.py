"""Visual-token selection for MoE vision-language models: pure numpy, no model needed.

Everything here works on one image's ``N`` visual tokens and returns the kept
token indices in increasing order (raster order, which keeps M-RoPE's 2-D
causal mask meaningful; ``docs/pruning.md``).

Scores (all normalised to ``[0, 1]``, higher = more important):

* :func:`entropy_scores` -- MACS's entropy-weighted importance of a visual
  token: ``H_i = H(softmax(z_i))`` of its projected feature row, z-scored over
  the image, ``w_i = sigmoid(-delta * H~_i)`` (low entropy = peaked = salient),
  then min-max normalised.
* saliency from the vision encoder's attention (head-averaged "attention
  received" per merged patch) comes from the native side
  (``pyvis.vlm``); :func:`normalize` maps it to ``[0, 1]``.
* :func:`random_scores` for the random baseline.

Selection methods (``select``):

* ``none``      keep everything;
* ``random``    ``floor(beta N)`` tokens uniformly at random (seeded);
* ``saliency``  top ``floor(beta N)`` by saliency (VisionZip-style);
* ``entropy``   top ``floor(beta N)`` by the MACS entropy score;
* ``affinity``  VisMMOE's Algorithm 1 (:func:`affinity_select`), exactly.

Tie-breaking everywhere: equal scores go to the lower token index (stable
sort), so every selection is deterministic.

``min_keep`` (default 1) keeps at least that many tokens of a non-empty image
when ``floor(beta N)`` would keep fewer (a 1-token image at beta 0.5 would
otherwise vanish). With ``min_keep=0`` every method is the paper's ``floor``
exactly; the salient core is never enlarged by it.
"""
from __future__ import annotations

import math

import numpy as np

METHODS = ("none", "random", "saliency", "entropy", "affinity")

DEFAULT_LAMBDA = 2.0   # VisMMOE's single global trade-off weight
DEFAULT_BETA = 0.5     # keep ratio
DEFAULT_ALPHA = 0.1    # salient core ratio; chosen by measurement (docs/pruning.md#alpha)


class PruneError(ValueError):
    """Invalid pruning input (keep ratio, alpha, shapes)."""


# --------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------
def normalize(s) -> np.ndarray:
    """Min-max normalise to [0, 1] (float64). A constant (or empty) vector maps to zeros;
    NaN/inf are treated as the minimum."""
    s = np.asarray(s, np.float64).ravel()
    if s.size == 0:
        return s.copy()
    finite = np.isfinite(s)
    if not finite.any():
        return np.zeros_like(s)
    lo, hi = s[finite].min(), s[finite].max()
    out = np.where(finite, s, lo)
    if hi - lo <= 0:
        return np.zeros_like(s)
    return (out - lo) / (hi - lo)


def token_entropy(embd: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) of softmax(row) for each row of ``embd [N, D]``."""
    z = np.asarray(embd, np.float64)
    if z.ndim != 2:
        raise PruneError(f"embeddings must be [N, D], got shape {z.shape}")
    if z.shape[0] == 0:
        return np.zeros(0)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return h


def entropy_scores(embd: np.ndarray, delta: float = 1.0, eps: float = 1e-6) -> np.ndarray:
    """MACS entropy-weighted importance of each visual token, in [0, 1].

    ``w_i = sigmoid(-delta * (H_i - mean H) / (std H + eps))``, then min-max normalised
    over the image. Low-entropy (peaked) feature rows score high."""
    w = macs_weights(embd, delta, eps)
    return normalize(w) if w.size else w


def macs_weights(embd: np.ndarray, delta: float = 1.0, eps: float = 1e-6) -> np.ndarray:
    """MACS's load weight of each visual token: ``sigmoid(-delta * (H_i - mean H) / (std H + eps))`` with ``H`` the
    softmax entropy of its row.  The runtime's --moe-capacity computes the same per image ubatch (C:
    vis_macs_weights, through ``pyvis.runtime.native.macs_weights``)."""
    h = token_entropy(embd)
    if h.size == 0:
        return h
    zt = (h - h.mean()) / (h.std() + eps)
    return 1.0 / (1.0 + np.exp(delta * zt))


def random_scores(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


# --------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------
def check_ratios(keep_ratio: float, alpha: float | None = None) -> None:
    if not (isinstance(keep_ratio, (int, float)) and math.isfinite(keep_ratio) and 0.0 < keep_ratio <= 1.0):
        raise PruneError(f"keep ratio must be in (0, 1], got {keep_ratio!r}")
    if alpha is not None:
        if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
            raise PruneError(f"alpha (salient core ratio) must be in [0, 1], got {alpha!r}")
        if alpha > keep_ratio:
            raise PruneError(f"alpha ({alpha}) must not exceed the keep ratio beta ({keep_ratio}): "
                             "the salient core is part of the kept set (lower alpha)")


def keep_count(n: int, keep_ratio: float, min_keep: int = 1) -> int:
    """floor(beta N), raised to min(min_keep, N)."""
    check_ratios(keep_ratio)
    k = int(math.floor(keep_ratio * n + 1e-9))
    return min(n, max(k, min(min_keep, n)))


def top_k(scores, k: int, among: np.ndarray | None = None) -> np.ndarray:
    """Indices of the k largest scores (ties: lower index first), in selection order.
    ``among`` restricts the candidates to those indices."""
    s = np.asarray(scores, np.float64)
    cand = np.arange(s.size) if among is None else np.asarray(among, np.int64)
    if k <= 0 or cand.size == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort((cand, -s[cand]))       # primary: score desc; secondary: index asc
    return cand[order[:k]]


def expert_masks(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """Multi-hot active-expert sets ``[N, L * n_expert]`` (bool) from prefix routing ``ids [L, N, k]``
    (or ``[N, k]`` for one layer).

    VisMMOE: a token's active expert set is the union of the experts it activates across the
    pinned prefix layers. Expert e of layer l and expert e of layer l' are different weights, so
    the set is over (layer, expert) pairs: column ``l * n_expert + e``."""
    ids = np.asarray(ids)
    if ids.ndim == 2:
        ids = ids[None]
    if ids.ndim != 3:
        raise PruneError(f"routing ids must be [L, N, k] or [N, k], got shape {ids.shape}")
    L, N, _ = ids.shape
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise PruneError(f"expert ids must be in [0, {n_expert})")
    m = np.zeros((N, L * n_expert), bool)
    for l in range(L):
        np.put_along_axis(m[:, l * n_expert:(l + 1) * n_expert], ids[l].astype(np.int64), True, axis=1)
    return m


def marginal_expansion(masks: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Delta_i = |E_i minus E_target| / |E_i| (0 for a token with no experts)."""
    m = np.asarray(masks, bool)
    t = np.asarray(target, bool)
    n_i = m.sum(axis=1)
    new = (m & ~t[None, :]).sum(axis=1)
    return np.where(n_i > 0, new / np.maximum(n_i, 1), 0.0)


def affinity_select(saliency, masks, keep_ratio: float = DEFAULT_BETA, alpha: float = DEFAULT_ALPHA,
                    lam: float = DEFAULT_LAMBDA, min_keep: int = 1, details: bool = False):
    """VisMMOE Algorithm 1 (Affinity-Aware Token Compression).

    saliency  [N]       head-averaged saliency s_i (normalised to [0, 1] here)
    masks     [N, M]    multi-hot active-expert sets E_i from the prefix layers (:func:`expert_masks`)

    K_core = floor(alpha N); K_keep = floor(beta N); I_core = TopK(s~, K_core);
    E_target = union of the core's sets; for i not in the core
    Delta_i = |E_i minus E_target| / |E_i| and p_i = s~_i - lambda Delta_i;
    I_keep = I_core + TopK(p, K_keep - K_core).
    Returns the kept indices, sorted (and a dict of intermediates with ``details=True``)."""
    s = normalize(saliency)
    m = np.asarray(masks, bool)
    N = s.size
    if m.ndim != 2 or m.shape[0] != N:
        raise PruneError(f"expert masks must be [N={N}, n_experts], got shape {m.shape}")
    check_ratios(keep_ratio, alpha)
    k_core = int(math.floor(alpha * N + 1e-9))
    k_keep = keep_count(N, keep_ratio, min_keep)
    k_core = min(k_core, k_keep)
    core = top_k(s, k_core)
    target = m[core].any(axis=0) if k_core else np.zeros(m.shape[1], bool)
    rest = np.setdiff1d(np.arange(N), core)
    delta = marginal_expansion(m, target)
    p = s - lam * delta
    extra = top_k(p, k_keep - k_core, among=rest)
    keep = np.sort(np.concatenate([core, extra])).astype(np.int64)
    if details:
        return keep, {"saliency": s, "core": np.sort(core), "target": target, "delta": delta, "p": p,
                      "k_core": k_core, "k_keep": k_keep}
    return keep


def select(method: str, n: int, keep_ratio: float = 1.0, *, saliency=None, entropy=None, masks=None,
           alpha: float = DEFAULT_ALPHA, lam: float = DEFAULT_LAMBDA, seed: int = 0,
           min_keep: int = 1) -> np.ndarray:
    """Kept token indices (sorted) of one image of ``n`` tokens under ``method`` (see module doc)."""
    if method not in METHODS:
        raise PruneError(f"unknown pruning method {method!r} (choose from {', '.join(METHODS)})")
    check_ratios(keep_ratio, alpha if method == "affinity" else None)
    if method == "none" or keep_ratio >= 1.0:     # every method keeps all N at beta = 1
        return np.arange(n, dtype=np.int64)
    k = keep_count(n, keep_ratio, min_keep)
    if method == "random":
        return np.sort(np.random.default_rng(seed).permutation(n)[:k]).astype(np.int64)
    if method == "saliency":
        if saliency is None:
            raise PruneError("method 'saliency' needs saliency scores")
        return np.sort(top_k(normalize(_check_len(saliency, n)), k))
    if method == "entropy":
        if entropy is None:
            raise PruneError("method 'entropy' needs entropy scores")
        return np.sort(top_k(normalize(_check_len(entropy, n)), k))
    if saliency is None or masks is None:
        raise PruneError("method 'affinity' needs saliency scores and prefix-layer expert sets")
    return affinity_select(_check_len(saliency, n), masks, keep_ratio, alpha, lam, min_keep)


def _check_len(s, n: int) -> np.ndarray:
    a = np.asarray(s, np.float64).ravel()
    if a.size != n:
        raise PruneError(f"got {a.size} scores for {n} tokens")
    return a
