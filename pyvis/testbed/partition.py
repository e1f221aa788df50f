"""Per-layer maths of the MoE builder (pyvis.testbed.moefy): neuron activations, the shared block, balanced
k-means into equal experts, the router fit and the layer's plan."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dense import MoefyError
from .spec import MoefySpec


# --------------------------------------------------------------------------
# per-layer maths
# --------------------------------------------------------------------------
def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def activations(X: np.ndarray, Wg: np.ndarray, Wu: np.ndarray, block: int = 4096) -> np.ndarray:
    H = np.empty((X.shape[0], Wg.shape[0]), np.float32)
    for s in range(0, X.shape[0], block):
        x = X[s:s + block]
        H[s:s + block] = silu(x @ Wg.T) * (x @ Wu.T)
    return H


def pick_shared(H: np.ndarray, dnorm: np.ndarray, n_shared: int, top_frac: float) -> np.ndarray:
    """Indices (sorted) of the n_shared neurons most often among a token's top contributions."""
    if n_shared == 0:
        return np.zeros(0, np.int64)
    n_ff = H.shape[1]
    top = max(1, int(round(top_frac * n_ff)))
    counts = np.zeros(n_ff, np.int64)
    for s in range(0, H.shape[0], 4096):
        c = np.abs(H[s:s + 4096]) * dnorm[None, :]
        idx = np.argpartition(-c, top - 1, axis=1)[:, :top]
        counts += np.bincount(idx.ravel(), minlength=n_ff)
    # most frequent first; ties by the larger total contribution, then by index (deterministic)
    total = np.zeros(n_ff, np.float64)
    for s in range(0, H.shape[0], 4096):
        total += (np.abs(H[s:s + 4096]) * dnorm[None, :]).sum(0)
    order = np.lexsort((np.arange(n_ff), -total, -counts))
    return np.sort(order[:n_shared])


def balanced_kmeans(P: np.ndarray, k: int, rng: np.random.Generator, iters: int = 30) -> np.ndarray:
    """Cluster rows of P (L2-normalised) into k groups of exactly len(P)/k; returns labels.

    Cosine k-means, k-means++ init, and a greedy capacity-constrained assignment: all
    (point, cluster) pairs by decreasing similarity, each point to the best cluster that still
    has room."""
    n = P.shape[0]
    cap = n // k
    assert cap * k == n
    # k-means++ (on cosine distance 1 - s)
    centers = [int(rng.integers(n))]
    d = 1.0 - P @ P[centers[0]]
    for _ in range(1, k):
        w = np.maximum(d, 0) ** 2
        w = w / w.sum() if w.sum() > 0 else np.full(n, 1.0 / n)
        c = int(rng.choice(n, p=w))
        centers.append(c)
        d = np.minimum(d, 1.0 - P @ P[c])
    C = P[centers].copy()
    labels = np.full(n, -1)
    for _ in range(iters):
        S = P @ C.T                                     # [n, k]
        order = np.argsort(-S, axis=None, kind="stable")
        new = np.full(n, -1)
        room = np.full(k, cap)
        left = n
        for flat in order:
            i, j = divmod(int(flat), k)
            if new[i] >= 0 or room[j] == 0:
                continue
            new[i] = j
            room[j] -= 1
            left -= 1
            if left == 0:
                break
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            m = P[labels == j].mean(0)
            nm = np.linalg.norm(m)
            C[j] = m / nm if nm > 0 else m
    return labels


def partition_neurons(H: np.ndarray, routed: np.ndarray, n_expert: int, method: str, rng: np.random.Generator,
                      profile_tokens: int, iters: int) -> list[np.ndarray]:
    """Split the routed neuron indices into n_expert sorted groups of equal size."""
    m = len(routed) // n_expert
    if method == "random":
        perm = rng.permutation(routed)
        return [np.sort(perm[e * m:(e + 1) * m]) for e in range(n_expert)]
    T = H.shape[0]
    rows = np.linspace(0, T - 1, min(T, profile_tokens)).astype(np.int64)
    P = np.abs(H[rows][:, routed]).T.astype(np.float32)           # [n_routed, tokens]
    P /= np.maximum(np.linalg.norm(P, axis=1, keepdims=True), 1e-12)
    labels = balanced_kmeans(P, n_expert, rng, iters)
    groups = [np.sort(routed[labels == e]) for e in range(n_expert)]
    # canonical order: by smallest neuron index (labels are arbitrary)
    groups.sort(key=lambda g: int(g[0]))
    return groups


def expert_norms(H: np.ndarray, Wd: np.ndarray, groups: list[np.ndarray], block: int = 4096) -> np.ndarray:
    """||D_e h_e|| for every token and expert: [T, E]."""
    Y = np.empty((H.shape[0], len(groups)), np.float32)
    for e, g in enumerate(groups):
        D = Wd[:, g].T.copy()                                      # [m, d]
        for s in range(0, H.shape[0], block):
            Y[s:s + block, e] = np.linalg.norm(H[s:s + block][:, g] @ D, axis=1)
    return Y


def fit_router(X: np.ndarray, Y: np.ndarray, ridge: float) -> np.ndarray:
    """Ridge least squares W [d, E] with X W ~ Y (no intercept: the deepseek router has no bias)."""
    X64 = X.astype(np.float64)
    G = X64.T @ X64
    lam = ridge * np.trace(G) / G.shape[0]
    return np.linalg.solve(G + lam * np.eye(G.shape[0]), X64.T @ Y.astype(np.float64))


def router_target(Y: np.ndarray, kind: str) -> np.ndarray:
    """The regression target from expert output norms Y [T, E]."""
    if kind == "norm":
        return Y
    if kind == "lognorm":
        return np.log(Y + 1e-3 * float(Y.mean()) + 1e-30)
    raise MoefyError(f"router_target must be lognorm or norm (got {kind!r})")


def scale_router(X: np.ndarray, W: np.ndarray, router_scale: float, pct: float = 99.0) -> np.ndarray:
    """Scale W so that the 99th percentile of the per-token logit spread (max - min) is router_scale.

    Softmax probabilities near 1/E are float32 numbers, so logit differences below ~1e-7 are lost:
    the scale is set on a percentile, not on the maximum, so that a few outlier tokens (BOS with its
    massive activations) do not squeeze everyone else's logits together."""
    L = X.astype(np.float64) @ W
    spread = float(np.percentile(L.max(1) - L.min(1), pct)) if L.shape[1] > 1 else 1.0
    return (W * (router_scale / max(spread, 1e-30))).astype(np.float32)


def ffn_error(X: np.ndarray, H: np.ndarray, Wd: np.ndarray, shared: np.ndarray, groups: list[np.ndarray],
              W: np.ndarray | None, k: int, oracle: bool = False) -> float:
    """Relative FFN error ||dense - moe||_F / ||dense||_F at top-k (router W, or oracle top-k)."""
    dense = H @ Wd.T
    out = H[:, shared] @ Wd[:, shared].T if len(shared) else np.zeros_like(dense)
    outs = [H[:, g] @ Wd[:, g].T for g in groups]
    if oracle:
        score = np.stack([np.linalg.norm(o, axis=1) for o in outs], axis=1)
    else:
        score = X @ W
    sel = np.argsort(-score, axis=1, kind="stable")[:, :k]
    mask = np.zeros(score.shape, bool)
    np.put_along_axis(mask, sel, True, axis=1)
    for e, o in enumerate(outs):
        out += o * mask[:, e:e + 1]
    return float(np.linalg.norm(dense - out) / max(np.linalg.norm(dense), 1e-30))


@dataclass
class LayerPlan:
    il: int
    shared: np.ndarray
    groups: list[np.ndarray]
    router: np.ndarray            # [d, E], already scaled
    stats: dict


def plan_layer(il: int, X: np.ndarray, Wg: np.ndarray, Wu: np.ndarray, Wd: np.ndarray, spec: MoefySpec,
               n_val: int, rng: np.random.Generator, measure_random: bool = True) -> LayerPlan:
    Xt, Xv = (X[:-n_val], X[-n_val:]) if n_val else (X, X[:0])
    H = activations(Xt, Wg, Wu)
    dnorm = np.linalg.norm(Wd, axis=0)
    shared = pick_shared(H, dnorm, spec.n_shared, spec.top_frac)
    routed = np.setdiff1d(np.arange(Wg.shape[0]), shared)
    groups = partition_neurons(H, routed, spec.n_expert, spec.partition, rng, spec.profile_tokens,
                               spec.kmeans_iters)
    Y = expert_norms(H, Wd, groups)
    Wr = fit_router(Xt, router_target(Y, spec.router_target), spec.ridge)
    stats: dict = {"layer": il}
    if len(Xv):
        Hv = activations(Xv, Wg, Wu)
        k = spec.n_expert_used
        stats["ffn_err_topk"] = ffn_error(Xv, Hv, Wd, shared, groups, Wr, k)
        stats["ffn_err_topk_oracle"] = ffn_error(Xv, Hv, Wd, shared, groups, None, k, oracle=True)
        Yv = router_target(expert_norms(Hv, Wd, groups), spec.router_target)
        pv = Xv @ Wr
        ss = ((Yv - Yv.mean(0)) ** 2).sum()
        stats["router_r2"] = float(1 - ((Yv - pv) ** 2).sum() / max(ss, 1e-30))
        if measure_random and spec.partition == "kmeans" and spec.n_expert > 1:
            rg = partition_neurons(H, routed, spec.n_expert, "random", np.random.default_rng([spec.seed, il, 7]),
                                   0, 0)
            Wrr = fit_router(Xt, router_target(expert_norms(H, Wd, rg), spec.router_target), spec.ridge)
            stats["ffn_err_topk_random_partition"] = ffn_error(Xv, Hv, Wd, shared, rg, Wrr, k)
    Wr = scale_router(Xt, Wr, spec.router_scale)
    return LayerPlan(il, shared, groups, Wr, stats)

