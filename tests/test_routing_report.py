"""Routing report: every metric against a hand-computed reference on a small synthetic trace."""
from __future__ import annotations

import itertools
import json
import zlib

import numpy as np
import pytest

from pyvis.runtime.cachesim import belady_misses, lru_misses, token_requests
from pyvis.runtime.trace import Trace, TraceError, load
from pyvis.testbed import routing_report as rr

# E = 4 experts, top-2, 2 layers, 6 tokens.  Hand computations are in the comments.
L0 = [[0, 1], [0, 2], [0, 1], [2, 3], [0, 1], [1, 3]]
L1 = [[1, 2], [1, 3], [1, 2], [0, 3], [1, 2], [2, 0]]


@pytest.fixture()
def tr() -> Trace:
    return Trace.from_routes(np.array([L0, L1]), n_expert=4, layers=np.array([1, 2]))


def test_usage_and_skew(tr):
    # layer 0 uses: e0 4, e1 4, e2 2, e3 2 (mean 3); layer 1: 2, 4, 4, 2
    assert rr.usage_counts(tr).tolist() == [[4, 4, 2, 2], [2, 4, 4, 2]]
    sk = rr.usage_skew(tr)
    assert sk["max_over_mean"] == pytest.approx([4 / 3, 4 / 3])
    assert sk["min_over_mean"] == pytest.approx([2 / 3, 2 / 3])
    assert sk["cv"] == pytest.approx([1 / 3, 1 / 3])          # std 1 / mean 3
    p = np.array([4, 4, 2, 2]) / 12
    assert sk["entropy_norm"] == pytest.approx([-(p * np.log(p)).sum() / np.log(4)] * 2)
    assert sk["top_quarter_share"] == pytest.approx([4 / 12, 4 / 12])


def test_coactivation_concentration(tr):
    C = rr.coactivation(tr, 0)
    # pairs: (0,1) x3, (0,2), (2,3), (1,3)
    assert C[0].tolist() == [4, 3, 1, 0] and C[1].tolist() == [3, 4, 0, 1]
    co = rr.coactivation_n80(tr)
    # e0: peers 3, 1 -> 80 % of 4 needs 2 peers; every expert needs 2 in both layers
    assert co["n80_per_expert"] == [[2, 2, 2, 2], [2, 2, 2, 2]]
    assert co["n80_mean"] == [2.0, 2.0]
    assert co["uniform_n80"] == 3                               # ceil(0.8 * 3)


def test_coactivation_concentrated_peer():
    # expert 0 co-occurs with 1 four times and with 2 once: 4 >= 0.8 * 5, one peer suffices
    t = Trace.from_routes(np.array([[[0, 1]] * 4 + [[0, 2]]]), n_expert=3)
    assert rr.coactivation_n80(t)["n80_per_expert"][0] == [1, 1, 1]


def test_reuse(tr):
    # layer 0 overlaps of consecutive tokens: 1, 1, 0, 0, 1 -> 3 / (5 pairs * k=2)
    assert rr.reuse(tr) == pytest.approx([0.3, 0.3])


def test_cross_layer_recall_in_sample(tr):
    c = rr.cross_layer_recall(tr, budgets=[2, 4], distance=1, train_frac=None)
    # co-occurrence rows (layer 0 expert -> layer 1 expert): [0,4,3,1] [1,3,4,0] [1,1,0,2] [2,0,1,1]
    # predictions: t0 {1,2} ok, t1 {1,2} vs {1,3} half, t2 ok, t3 {0,3} ok, t4 ok, t5 {2,0} ok
    assert c["recall"]["2"] == pytest.approx([5.5 / 6])
    assert c["recall"]["4"] == pytest.approx([1.0])
    # frequency baseline: layer 1's two most used experts {1,2}: 1, .5, 1, 0, 1, .5
    assert c["baseline_frequency"]["2"] == pytest.approx([4 / 6])


def test_cross_layer_recall_held_out_split():
    # first half: layer-0 expert 0 always leads to layer-1 expert 3; second half repeats it
    ids0 = [[0]] * 4 + [[1]] * 4
    ids1 = [[3]] * 4 + [[2]] * 4
    t = Trace.from_routes(np.array([ids0 * 2, ids1 * 2]), n_expert=4)
    c = rr.cross_layer_recall(t, budgets=[1], distance=1, train_frac=0.5)
    assert c["recall"]["1"] == [1.0]
    assert c["baseline_frequency"]["1"] == [0.5]


def test_working_set(tr):
    ws = rr.working_set(tr, [1, 2, 3])
    assert ws["1"] == [2.0, 2.0]
    # layer 0, W=2: 3,3,4,4,3 -> 3.4; W=3: 3,4,4,4 -> 3.75
    assert ws["2"][0] == pytest.approx(3.4)
    assert ws["3"][0] == pytest.approx(3.75)


def test_miss_curves_hand_computed(tr):
    req = token_requests(np.array(L0))
    # C=2: cache = previous token's set: 2+1+1+2+2+1 = 9 misses; C=4: 4 cold misses
    # C=3 LRU (a token touches its hits, then loads its misses, in top-k order): t0 2, t1 1; t2 touches 0 then 1;
    # t3 touches 2, misses 3 and evicts 0 (older than 1); t4 touches 1, misses 0 and evicts 2; t5 hits -> 5
    # C=3 Belady: t3 evicts 0 or 1 (both next used at t4), t4 evicts 2 (never used again) -> 5
    assert [lru_misses(req, C) for C in (2, 3, 4)] == [9, 5, 4]
    assert [belady_misses(req, C) for C in (2, 3, 4)] == [9, 5, 4]
    # the order inside a token decides: [0, 1] then [2] evicts 0, so [1] hits; [1, 0] then [2] evicts 1
    assert lru_misses([[0, 1], [2], [1]], 2) == 3 and lru_misses([[1, 0], [2], [1]], 2) == 4
    mc = rr.miss_curves(tr)
    assert mc["sizes"] == [2, 3, 4]
    assert mc["lru"][0] == pytest.approx([9 / 12, 5 / 12, 4 / 12])
    assert mc["belady"][0] == pytest.approx([9 / 12, 5 / 12, 4 / 12])


def _lru_sim(seq, E, C):
    """Reference of the runtime's LRU, written with ticks: every touch gets the next tick; a token touches its
    hits first, then loads its misses in top-k order, each evicting the oldest-ticked expert the token does not
    need."""
    tick, last, misses = 0, {}, 0
    for req in seq:
        req = [int(e) for e in req]
        for e in req:
            if e in last:
                tick += 1
                last[e] = tick
        for e in req:
            if e not in last:
                misses += 1
                if len(last) >= C:
                    del last[min((x for x in last if x not in req), key=last.get)]
                tick += 1
                last[e] = tick
    return misses


def _optimal(seq, E, C):
    """Brute force over every eviction choice: the true minimum number of misses."""
    best = [10 ** 9]

    def go(t, cache, m):
        if m >= best[0]:
            return
        if t == len(seq):
            best[0] = m
            return
        req = set(int(e) for e in seq[t])
        need = req - cache
        over = len(cache) + len(need) - C
        if over <= 0:
            go(t + 1, cache | need, m + len(need))
            return
        for victims in itertools.combinations(sorted(cache - req), over):
            go(t + 1, (cache - set(victims)) | need, m + len(need))

    go(0, frozenset(), 0)
    return best[0]


@pytest.mark.parametrize("seed", range(6))
def test_lru_and_belady_against_references(seed):
    rng = np.random.default_rng(seed)
    E, k, T = 5, 2, 9
    seq = np.array([rng.choice(E, k, replace=False) for _ in range(T)])
    req = token_requests(seq)
    for C in range(k, E + 1):
        lru = lru_misses(req, C)
        assert lru == _lru_sim(seq, E, C)
        b = belady_misses(req, C)
        assert b == _optimal(seq, E, C)
        assert b <= lru


def test_default_budgets_and_cache_sizes():
    assert rr.default_budgets(8, 16) == [8, 10, 12]
    assert rr.default_budgets(2, 4) == [2, 3]
    assert rr.default_cache_sizes(8, 16) == list(range(8, 17))
    assert rr.default_cache_sizes(8, 64) == [8, 15, 22, 29, 36, 43, 50, 57, 64]


def test_analyse_and_report_text(tr, tmp_path):
    r = rr.analyse(tr, budgets=[2], distances=(1,), windows=(2,), train_frac=None)
    assert r["reuse"] == pytest.approx([0.3, 0.3])
    assert r["cross_layer"]["1"]["recall"]["2"] == pytest.approx([5.5 / 6])
    text = rr.format_report(r)
    assert "LRU" in text and "Belady" in text and "recall@2" in text
    json.dumps(r)  # serialisable
    paths = rr.write_heatmaps(tr, r, tmp_path, "syn")
    for p in paths:
        b = p.read_bytes()
        assert b[:8] == b"\x89PNG\r\n\x1a\n"
        # IHDR: width = 4 experts * 12 px, height = 2 layers * 12 px for the usage map
    b = paths[0].read_bytes()
    w, h = int.from_bytes(b[16:20], "big"), int.from_bytes(b[20:24], "big")
    assert (w, h) == (48, 24)
    # decode the pixel data: first row of layer 0 is 4 cells; the most used expert is the brightest
    idat = b[b.index(b"IDAT") + 4:b.index(b"IEND") - 8]
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)[:, 1:].reshape(h, w, 3)
    assert raw[0, 0].tolist() == [253, 231, 37] and raw[0, 0].sum() > raw[0, 12 * 2].sum()


def test_trace_roundtrip_and_validation(tr, tmp_path):
    p = tr.save(tmp_path / "t.npz")
    t2 = load(p)
    assert (t2.ids == tr.ids).all() and t2.n_expert == 4 and t2.layers().tolist() == [1, 2]
    assert all((getattr(t2, c) == getattr(tr, c)).all() for c in ("ubatch", "layer", "seq", "pos", "modality"))
    assert np.array_equal(t2.routes()[0], np.array([L0, L1]))
    # a trace saved before the one trace model (the [layers, tokens, k] matrix) still loads
    old = tmp_path / "old.npz"
    np.savez_compressed(old, ids=np.array([L0, L1], np.int16), layers=np.array([1, 2]), n_expert=np.int64(4),
                        meta=np.array("{}"))
    assert np.array_equal(load(old).routes()[0], np.array([L0, L1])) and load(old).layers().tolist() == [1, 2]
    with pytest.raises(TraceError, match="expert ids"):
        Trace.from_routes(np.array([[[0, 4]]]), n_expert=4)
    with pytest.raises(TraceError, match="twice"):
        Trace.from_routes(np.array([[[1, 1]]]), n_expert=4)
    with pytest.raises(TraceError, match="layers, tokens, k"):
        Trace.from_routes(np.zeros((2, 3)), n_expert=4)
    with pytest.raises(TraceError, match="not found"):
        load(tmp_path / "missing.npz")


def test_report_cli_on_a_saved_trace(tr, tmp_path, capsys):
    from pyvis.cli import main
    p = tr.save(tmp_path / "t.npz")
    rc = main(["report", "--trace", str(p), "-o", str(tmp_path / "out"), "--distance", "1", "--window", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "miss rate" in out and (tmp_path / "out" / "t.json").is_file()
    assert (tmp_path / "out" / "t-usage.png").is_file()
    rc = main(["report", "--trace", str(tmp_path / "nope.npz")])
    assert rc == 1
