"""Token selection (pyvis.prune): Algorithm 1 against a plain-Python reference, baselines, scores, errors.

Pure numpy: no model, no native library, runs in well under a second.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pyvis.vlm import prune


# --------------------------------------------------------------------------
# reference implementation of VisMMOE Algorithm 1, written from the paper with
# Python sets and sorted(), independent of pyvis.prune's numpy code
# --------------------------------------------------------------------------
def ref_normalize(s):
    if not s:
        return []
    lo, hi = min(s), max(s)
    return [0.0 if hi == lo else (x - lo) / (hi - lo) for x in s]


def ref_topk(score: dict, k: int) -> list:
    return [i for i, _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def ref_algorithm1(saliency, expert_sets, alpha, beta, lam):
    N = len(saliency)
    s = ref_normalize(list(saliency))
    k_core, k_keep = math.floor(alpha * N + 1e-9), math.floor(beta * N + 1e-9)
    core = ref_topk({i: s[i] for i in range(N)}, k_core)
    target = set()
    for j in core:
        target |= expert_sets[j]
    p = {}
    for i in range(N):
        if i in core:
            continue
        E = expert_sets[i]
        delta = len(E - target) / len(E)
        p[i] = s[i] - lam * delta
    return sorted(core + ref_topk(p, k_keep - k_core))


def sets_from_ids(ids, n_expert):
    """ids [L, N, k] -> per token the set of (layer, expert) pairs."""
    L, N, _ = ids.shape
    return [{(l, int(e)) for l in range(L) for e in ids[l, i]} for i in range(N)]


def random_routing(rng, L, N, E, k):
    return np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(N)]) for _ in range(L)])


@pytest.mark.parametrize("seed", range(40))
def test_algorithm1_matches_reference(seed):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(1, 60))
    L, E = int(rng.integers(1, 4)), int(rng.integers(4, 17))
    k = int(rng.integers(1, 5))
    ids = random_routing(rng, L, N, E, k)
    # quantised saliency: many exact ties, which the tie rule (lower index first) must settle
    sal = rng.integers(0, 4, N).astype(float) if seed % 2 else rng.random(N)
    beta = float(rng.choice([0.1, 0.3, 0.5, 0.7, 1.0]))
    alpha = min(float(rng.choice([0.0, 0.05, 0.1, 0.25, beta])), beta)
    lam = float(rng.choice([0.0, 0.5, 2.0, 10.0]))
    got = prune.affinity_select(sal, prune.expert_masks(ids, E), beta, alpha, lam, min_keep=0)
    want = ref_algorithm1(sal, sets_from_ids(ids, E), alpha, beta, lam)
    assert got.tolist() == want, (N, alpha, beta, lam)


def test_algorithm1_hand_worked_example():
    # 6 tokens, one prefix layer, 8 experts, top-2.  alpha = 1/6 -> core = {argmax s} = {0};
    # E_target = {0, 1}.  beta = 0.5 -> 3 kept, 2 more by p = s - 2 * Delta.
    sal = np.array([1.0, 0.9, 0.8, 0.2, 0.1, 0.0])
    ids = np.array([[[0, 1], [6, 7], [2, 3], [0, 1], [1, 5], [0, 1]]])
    keep, d = prune.affinity_select(sal, prune.expert_masks(ids, 8), 0.5, 1 / 6, 2.0, details=True)
    assert d["core"].tolist() == [0]
    assert np.flatnonzero(d["target"]).tolist() == [0, 1]
    assert d["delta"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.5, 0.0]
    # p: token 3 = 0.2, token 5 = 0.0, token 4 = 0.1 - 1 = -0.9, tokens 1, 2 = s - 2 < -1
    assert keep.tolist() == [0, 3, 5]
    # saliency-only would have kept the three most salient instead
    assert prune.select("saliency", 6, 0.5, saliency=sal).tolist() == [0, 1, 2]
    # lambda = 0 degenerates to saliency-only
    assert prune.affinity_select(sal, prune.expert_masks(ids, 8), 0.5, 1 / 6, 0.0).tolist() == [0, 1, 2]


def test_all_tied_scores_pick_lowest_indices():
    N, E = 10, 8
    ids = np.tile(np.array([[0, 1]]), (1, N, 1))   # every token routes to the same experts
    keep = prune.affinity_select(np.full(N, 0.3), prune.expert_masks(ids, E), 0.5, 0.2)
    assert keep.tolist() == [0, 1, 2, 3, 4]
    assert prune.select("saliency", N, 0.5, saliency=np.zeros(N)).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("N", [0, 1, 2, 3])
def test_tiny_images(N):
    ids = np.zeros((1, N, 1), np.int64)
    masks = prune.expert_masks(ids, 4)
    sal = np.arange(N, dtype=float)
    exact = prune.affinity_select(sal, masks, 0.5, 0.0, min_keep=0)
    assert exact.tolist() == ref_algorithm1(sal, sets_from_ids(ids, 4), 0.0, 0.5, 2.0)
    assert len(exact) == math.floor(0.5 * N)
    kept = prune.affinity_select(sal, masks, 0.5, 0.0)        # default min_keep=1
    assert len(kept) == (0 if N == 0 else max(1, N // 2))
    for m in ("random", "saliency", "entropy"):
        got = prune.select(m, N, 0.5, saliency=sal, entropy=sal, seed=1)
        assert len(got) == (0 if N == 0 else max(1, N // 2))


def test_kept_indices_sorted_unique_and_counted():
    rng = np.random.default_rng(7)
    N, E = 37, 16
    ids = random_routing(rng, 2, N, E, 4)
    sal, ent = rng.random(N), rng.random(N)
    for m in prune.METHODS:
        for beta in (0.3, 0.5, 0.7, 1.0):
            keep = prune.select(m, N, beta, saliency=sal, entropy=ent, masks=prune.expert_masks(ids, E),
                                alpha=min(0.1, beta), seed=3)
            assert np.all(np.diff(keep) > 0) and keep.min() >= 0 and keep.max() < N
            assert len(keep) == (N if m == "none" else math.floor(beta * N))


def test_baselines():
    sal = np.array([0.1, 0.9, 0.5, 0.7, 0.3, 0.2])
    assert prune.select("none", 6, 0.5).tolist() == list(range(6))
    assert prune.select("saliency", 6, 0.5, saliency=sal).tolist() == [1, 2, 3]
    assert prune.select("entropy", 6, 0.5, entropy=1 - sal).tolist() == [0, 4, 5]
    r1 = prune.select("random", 100, 0.5, seed=1)
    assert r1.tolist() == prune.select("random", 100, 0.5, seed=1).tolist()
    assert r1.tolist() != prune.select("random", 100, 0.5, seed=2).tolist()
    assert len(r1) == 50


def test_affinity_keeps_fewer_experts_than_saliency():
    # Two clusters: salient tokens route to experts {0..3}; the rest split between a cluster sharing
    # them and one using {8..15}.  Affinity must fill the budget from the sharing cluster.
    rng = np.random.default_rng(0)
    N, E = 40, 16
    sal = np.concatenate([np.full(4, 1.0), rng.uniform(0.3, 0.6, 36)])
    ids = np.zeros((1, N, 2), np.int64)
    for i in range(N):
        pool = [0, 1, 2, 3] if i < 4 or i % 2 == 0 else list(range(8, 16))
        ids[0, i] = rng.choice(pool, 2, replace=False)
    masks = prune.expert_masks(ids, E)
    aff = prune.affinity_select(sal, masks, 0.5, 0.1)
    sal_only = prune.select("saliency", N, 0.5, saliency=sal)
    n_exp = lambda keep: int(masks[keep].any(0).sum())  # noqa: E731
    assert n_exp(aff) == 4 < n_exp(sal_only)
    assert set(range(4)) <= set(aff.tolist())          # the salient core stays


def test_expert_masks_union_over_layers():
    ids = np.array([[[0, 1], [2, 3]], [[0, 1], [0, 3]]])   # L=2, N=2, k=2, E=4
    m = prune.expert_masks(ids, 4)
    assert m.shape == (2, 8)
    assert np.flatnonzero(m[0]).tolist() == [0, 1, 4, 5]
    assert np.flatnonzero(m[1]).tolist() == [2, 3, 4, 7]
    with pytest.raises(prune.PruneError):
        prune.expert_masks(np.array([[[4]]]), 4)


def test_normalize():
    assert prune.normalize([2, 4, 3]).tolist() == [0.0, 1.0, 0.5]
    assert prune.normalize([5, 5]).tolist() == [0.0, 0.0]
    assert prune.normalize([]).size == 0
    assert prune.normalize([1.0, np.nan, 3.0]).tolist() == [0.0, 0.0, 1.0]


def test_entropy_scores_prefer_peaked_rows():
    D = 32
    flat = np.zeros(D)
    peaked = np.zeros(D)
    peaked[3] = 12.0
    mid = np.zeros(D)
    mid[:4] = 3.0
    e = prune.entropy_scores(np.stack([flat, peaked, mid]))
    assert e.min() >= 0 and e.max() <= 1
    assert np.argmax(e) == 1 and np.argmin(e) == 0 and e[0] < e[2] < e[1]
    h = prune.token_entropy(np.stack([flat, peaked]))
    assert h[0] == pytest.approx(math.log(D)) and h[1] < 0.01


@pytest.mark.parametrize("beta", [0.0, -0.1, 1.5, float("nan")])
def test_bad_keep_ratio(beta):
    with pytest.raises(prune.PruneError, match="keep ratio"):
        prune.select("random", 10, beta)


def test_alpha_above_beta_is_an_error():
    with pytest.raises(prune.PruneError, match="alpha"):
        prune.affinity_select(np.zeros(4), np.zeros((4, 2), bool), keep_ratio=0.3, alpha=0.5)
    with pytest.raises(prune.PruneError, match="alpha"):
        prune.select("affinity", 4, 0.3, saliency=np.zeros(4), masks=np.zeros((4, 2), bool), alpha=0.5)


def test_missing_inputs_and_unknown_method():
    with pytest.raises(prune.PruneError, match="unknown"):
        prune.select("bogus", 4, 0.5)
    with pytest.raises(prune.PruneError, match="saliency"):
        prune.select("saliency", 4, 0.5)
    with pytest.raises(prune.PruneError, match="4 tokens"):
        prune.select("saliency", 4, 0.5, saliency=[1, 2, 3])
    with pytest.raises(prune.PruneError, match="affinity"):
        prune.select("affinity", 4, 0.5, saliency=np.zeros(4))


# --------------------------------------------------------------------------
# concentration numbers of pyvis prune-report (pure numpy)
# --------------------------------------------------------------------------
def test_concentration_numbers():
    from pyvis.vlm import report as pr
    E = 8
    # layer 0: every token uses experts {0, 1}; layer 1: tokens spread over all 8 experts, 2 each
    l0 = np.tile([0, 1], (8, 1))
    l1 = np.array([[2 * (i % 4), 2 * (i % 4) + 1] for i in range(8)])
    c = pr.concentration(np.stack([l0, l1]), E)
    assert c["n_tokens"] == 8
    assert c["distinct"] == [2, 8] and c["n90"] == [2, 8]
    assert c["entropy"][0] == pytest.approx(math.log(2) / math.log(8)) and c["entropy"][1] == pytest.approx(1.0)
    assert c["topk_cov"] == [1.0, pytest.approx(4 / 16)]
    # layer 1's experts given layer 0's: the table cannot tell the tokens apart -> recall = 2/8 per token... x k
    assert c["xl_recall"] == [pytest.approx(0.25)]
    assert c["mean"]["distinct"] == 5.0
    # a perfectly predictable pair of layers
    c2 = pr.concentration(np.stack([l1, (l1 + 1) % E]), E)
    assert c2["xl_recall"] == [pytest.approx(1.0)]
    assert pr.usage(np.stack([l0]), E).tolist() == [[8, 8, 0, 0, 0, 0, 0, 0]]
    empty = pr.concentration(np.zeros((2, 0, 2), np.int64), E)
    assert empty["n_tokens"] == 0 and math.isnan(empty["mean"]["distinct"])


def test_heatmap_png(tmp_path):
    from pyvis.vlm import report as pr
    p = pr.write_heatmaps({"a": np.array([[1, 0, 3], [2, 2, 0]]), "b": np.array([[0, 0, 4], [1, 1, 1]])},
                          tmp_path / "h.png", title="t", layers=[3, 4])
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 100


def test_affinity_concentrates_synthetic_clustered_routing():
    # with routing that follows visual clusters in every layer, Algorithm 1 (small alpha) needs fewer experts
    # for 90 % of the kept tokens' selections than saliency-only, in the prefix layer and in the later layers;
    # without that structure it gains (almost) nothing
    from pyvis.vlm import report as pr
    for seed in range(2):
        ids, sal = pr.synthetic_routing(600, 4, 64, 8, 8, 0.95, seed=seed, sal_cluster=0.0)
        r = {(x["method"], x["alpha"]): x for x in pr.simulate(ids, sal, 64, 0.5, (0.02,), seed=seed)}
        sal_only, aff = r[("saliency", None)], r[("affinity", 0.02)]
        assert aff["n_kept"] == sal_only["n_kept"] == 300
        assert aff["prefix_n90"] < sal_only["prefix_n90"] and aff["later_n90"] < sal_only["later_n90"]
        assert 0.8 < aff["saliency_mass"] < 1.0
        ids, sal = pr.synthetic_routing(600, 4, 64, 8, 8, 0.0, seed=seed, sal_cluster=0.0)
        r = {(x["method"], x["alpha"]): x for x in pr.simulate(ids, sal, 64, 0.5, (0.02,), seed=seed)}
        assert abs(r[("affinity", 0.02)]["later_n90"] - r[("saliency", None)]["later_n90"]) <= 1.0
