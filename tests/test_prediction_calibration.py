"""Lookahead prediction, the Python half (issue #16 item 2): co-activation counts, the frequency and co-activation
predictors, recall / precision / bytes wasted and VisMMOE's decayed targets against hand computations on tiny traces;
the predictor profile (round trip, every ProfileError); `pyvis calibrate predictor` end to end on the qwen3moe fixture.
No native build needed."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import gguf
from pyvis.runtime import predict as pr
from pyvis.runtime import profile as prof
from pyvis.runtime import predict_profile as pp
from pyvis.runtime.trace import Trace
from test_substitution_profile import corpus_text, router, tiny_model

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "models" / "fixtures" / "qwen3moe.gguf"      # 3 layers x 32 experts, top-8

# E = 4, top-2, MoE layers 0, 1, 2.  Calibration: two kinds of token, each twice.
FIT = np.array([[[0, 1], [0, 1], [2, 3], [2, 3]],       # layer 0
                [[1, 2], [1, 2], [0, 3], [0, 3]],       # layer 1
                [[2, 3], [2, 3], [0, 1], [0, 1]]])      # layer 2
# held out: two tokens
EVAL = np.array([[[0, 1], [2, 3]],
                 [[1, 3], [0, 3]],
                 [[2, 3], [1, 2]]])
LAYERS = np.array([0, 1, 2])


def fitted(W: int = 2) -> pr.Model:
    return pr.Model.from_counts(pr.count([(FIT, LAYERS)], 3, 4, W))


def test_counts_and_tables_by_hand():
    c = pr.count([(FIT, LAYERS)], 3, 4, 2)
    # d = 1, layer 0 -> 1: tokens 0, 1 pair {0,1} with {1,2}; tokens 2, 3 pair {2,3} with {0,3}
    assert c.coact[0, 0].tolist() == [[0, 2, 2, 0], [0, 2, 2, 0], [2, 0, 0, 2], [2, 0, 0, 2]]
    # d = 2, layer 0 -> 2: {0,1} with {2,3}, {2,3} with {0,1}; layer 1 has no layer 3
    assert c.coact[1, 0].tolist() == [[0, 0, 2, 2], [0, 0, 2, 2], [2, 2, 0, 0], [2, 2, 0, 0]]
    assert not c.coact[1, 1].any() and not c.coact[:, 2].any()
    assert c.use.tolist() == [[2, 2, 2, 2]] * 3 and c.rows.tolist() == [4, 4, 4]
    P = c.tables()
    assert P[0, 0, 0].tolist() == [0, 0.5, 0.5, 0] and P[1, 0, 2].tolist() == [0.5, 0.5, 0, 0]
    assert np.allclose(c.freq(), 0.5)
    # counting in two halves adds up
    c2 = pr.count([(FIT[:, :1], LAYERS), (FIT[:, 1:], LAYERS)], 3, 4, 2)
    assert np.array_equal(c2.coact, c.coact) and np.array_equal(c2.use, c.use)


def test_rank_ties():
    assert pr.rank(np.array([[1, 1, 0]])).tolist() == [[0, 1, 2]]                     # lower id
    assert pr.rank(np.array([[1, 1, 0]]), tiebreak=[0, 5, 1]).tolist() == [[1, 0, 2]]  # more used first
    assert pr.rank(np.array([[0, 0, 0]]), tiebreak=[0, 5, 1]).tolist() == [[1, 2, 0]]


def test_recall_precision_wasted_by_hand():
    r = pr.evaluate(fitted(), [(EVAL, LAYERS)], [2, 3], expert_bytes=np.array([10.0, 20.0, 30.0]))
    assert r["layers"] == [0, 1] and r["tokens"] == 2 and r["k"] == 2
    co, fq = r["coact"], r["frequency"]
    # l = 0, d = 1: t0 {0,1} scores P[0]+P[1] = [0,1,1,0] -> top-2 {1,2} vs {1,3}: 1 hit;
    #               t1 {2,3} -> [1,0,0,1] -> {0,3} vs {0,3}: 2 hits            -> recall@2 = precision@2 = 0.75
    # top-3 adds the tie at 0 by the lower id: t0 {1,2,0}: 1 hit, t1 {0,3,1}: 2  -> recall 0.75, precision 0.5
    assert co["d1"]["recall"]["2"][0] == pytest.approx(0.75)
    assert co["d1"]["precision"]["2"][0] == pytest.approx(0.75)
    assert co["d1"]["recall"]["3"][0] == pytest.approx(0.75)
    assert co["d1"]["precision"]["3"][0] == pytest.approx(0.5)
    assert co["d1"]["wasted_bytes"]["3"][0] == pytest.approx(1.5 * 20)          # (2 + 1) / 2 unused x layer 1's
    # l = 0, d = 2: t0 -> [0,0,1,1] -> {2,3} vs {2,3}: 2; t1 -> [1,1,0,0] -> {0,1} vs {1,2}: 1
    assert co["d2"]["recall"]["2"][0] == pytest.approx(0.75)
    assert co["d2"]["wasted_bytes"]["2"][0] == pytest.approx(0.5 * 30)
    # l = 1, d = 1: t0 {1,3} -> [.5,.5,.5,.5], all tied -> {0,1} vs {2,3}: 0; t1 {0,3} -> [1,1,0,0] -> {0,1} vs {1,2}: 1
    assert co["d1"]["recall"]["2"][1] == pytest.approx(0.25)
    assert np.isnan(co["d2"]["recall"]["2"][1])                                   # no layer 3
    # frequency: every expert used alike -> {0,1}; layer 1 t0 {1,3}: 1, t1 {0,3}: 1
    assert fq["d1"]["recall"]["2"][0] == pytest.approx(0.5)
    assert fq["d1"]["precision"]["3"][0] == pytest.approx(1 / 3)                 # {0,1,2}: t0 1 hit, t1 1
    # count weighting ranks the same here (every source expert equally frequent)
    rc = pr.evaluate(pr.Model(fitted().freq, fitted().tables, "count"), [(EVAL, LAYERS)], [2])
    assert rc["coact"]["d1"]["recall"]["2"] == co["d1"]["recall"]["2"]


def test_recall_of_new_experts_by_hand():
    r = pr.evaluate(fitted(), [(EVAL, LAYERS)], [1, 2])
    rn = r["coact"]["d1"]["recall_new"]
    # only t1 counts (t0 has no previous token).  l = 0 -> 1: t1 needs {0,3}, t0 used {1,3}: new {0}; scores
    # [1,0,0,1] without {1,3} -> 0 first: found at B = 1 and 2 (counting t0 too would give 2/3 at B = 2)
    assert rn["1"][0] == 1.0 and rn["2"][0] == 1.0
    # l = 1 -> 2: t1 needs {1,2}, t0 used {2,3}: new {1}; scores [1,1,0,0] without {2,3}: 0 then 1
    assert rn["1"][1] == 0.0 and rn["2"][1] == 1.0
    # l = 0 -> 2: same target as above, scores P2[2] + P2[3] = [1,1,0,0]
    assert r["coact"]["d2"]["recall_new"]["1"][0] == 0.0 and r["coact"]["d2"]["recall_new"]["2"][0] == 1.0
    with pytest.raises(pr.PredictError, match="budgets"):
        pr.evaluate(fitted(), [(EVAL, LAYERS)], [5])


def test_frequency_prefers_the_most_used():
    m = pr.Model(np.array([[0, 0, 0, 0], [0.1, 0.9, 0.2, 0.8]]), np.zeros((1, 2, 4, 4)))
    r = pr.evaluate(m, [(np.array([[[0], [1]], [[1], [0]]]), np.array([0, 1]))], [1, 2])
    assert r["frequency"]["d1"]["recall"]["1"] == [0.5]       # always predicts expert 1
    assert r["frequency"]["d1"]["recall"]["2"] == [0.5]       # {1, 3}


def test_decayed_target_by_hand():
    g = pr.decayed_target([np.array([[0, 1, 0, 1]], bool), np.array([[0, 0, 1, 1]], bool),
                           np.array([[1, 0, 0, 0]], bool)], gamma=0.8)
    assert g[0].tolist() == pytest.approx([0.64, 1.0, 0.8, 1.0])                # max_d 0.8^(d-1) [e in E_{l+d}]
    assert pr.decayed_recall(np.array([[0, 0, 1, 1]], bool), g) == pytest.approx([1.8 / 3.44])
    u = pr.decayed_scores([np.array([[0., 1, 1, 0]]), np.array([[0., 0, 2, 2]])], gamma=0.8)
    assert u[0].tolist() == pytest.approx([0, 0.5, 0.5, 0.4])                   # max(s1/2, 0.8 * s2/4)
    with pytest.raises(pr.PredictError, match="gamma"):
        pr.decayed_target([np.zeros((1, 2), bool)], gamma=0)


def test_decayed_recall_of_the_predictors_by_hand():
    r = pr.evaluate(fitted(), [(EVAL, LAYERS)], [2, 3], gamma=0.8)
    dec = r["coact"]["decayed"]["recall"]
    # l = 0: t0 g = [0, 1, .8, 1] (layer 1 {1,3}, layer 2 {2,3} x .8), u = max([0,.5,.5,0], .8 [0,0,.5,.5])
    #        = [0, .5, .5, .4] -> top-2 {1,2}: 1.8 / 2.8; top-3 {1,2,3}: 1
    #        t1 g = [1, .8, .8, 1], u = max([.5,0,0,.5], .8 [.5,.5,0,0]) = [.5,.4,0,.5] -> {0,3}: 2 / 3.6;
    #        top-3 {0,3,1}: 2.8 / 3.6
    assert dec["2"][0] == pytest.approx((1.8 / 2.8 + 2 / 3.6) / 2)
    assert dec["3"][0] == pytest.approx((1 + 2.8 / 3.6) / 2)
    # l = 1: only d = 1 exists; the d = 1 recall over the k targets: t0 0, t1 1/2
    assert dec["2"][1] == pytest.approx(0.25)


def test_evaluate_errors():
    with pytest.raises(pr.PredictError, match="no pair of adjacent"):
        pr.evaluate(fitted(), [(EVAL[:1], LAYERS[:1])], [2])
    with pytest.raises(pr.PredictError, match="lookahead 3"):
        pr.evaluate(fitted(), [(EVAL, LAYERS)], [2], lookahead=3)
    with pytest.raises(pr.PredictError, match="unknown predictor"):
        pr.evaluate(fitted(), [(EVAL, LAYERS)], [2], predictors=("mlp",))


# --------------------------------------------------------------------------
# the profile
# --------------------------------------------------------------------------
@pytest.fixture()
def model(tmp_path):
    return tiny_model(tmp_path / "m.gguf", {0: router(seed=1), 1: router(seed=2)}, n_layer=3)


def _write(path, model, W=2, **kw):
    c = pr.count([(FIT, LAYERS)], 3, 4, W)
    return pp.write_predictor_profile(path, prof.model_fingerprint(model), c.freq(), c.tables(), 2, 4, "test",
                                      model_path=model, **kw)


def test_round_trip_and_the_documented_layout(tmp_path, model):
    p = _write(tmp_path / "p.gguf", model)
    q = pp.read_predictor_profile(p, model)
    c = pr.count([(FIT, LAYERS)], 3, 4, 2)
    assert (q.n_layer, q.n_expert, q.k, q.n_tokens, q.lookahead, q.weighting) == (3, 4, 2, 4, 2, "conditional")
    assert q.router_hash == prof.router_hash(model) and q.arch == "qwen3moe" and q.source == "test"
    assert np.array_equal(q.coact, c.tables().astype(np.float32)) and np.array_equal(q.freq, c.freq())
    r = gguf.GGUFReader(str(p))                       # the names and types docs/prediction-calibration.md gives
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "vis-profile" and f["vis.profile.kind"] == "predictor"
    assert f["vis.profile.version"] == 1 and f["vis.predict.lookahead"] == 2
    assert f["vis.predict.weighting"] == "conditional" and re.fullmatch("[0-9a-f]{16}", f["vis.model.router_hash"])
    t = {x.name: x for x in r.tensors}
    assert t["predict.coact"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t["predict.coact"].shape) == [4, 4, 3, 2]                         # GGUF ne: [E, E, L, W]
    assert list(t["expert.freq"].shape) == [4, 3]
    # its predictions are those of the counts
    r1 = pr.evaluate(q.model(), [(EVAL, LAYERS)], [2])
    assert r1["coact"]["d1"]["recall"] == pr.evaluate(fitted(), [(EVAL, LAYERS)], [2])["coact"]["d1"]["recall"]


def test_wrong_model_truncated_foreign(tmp_path, model):
    p = _write(tmp_path / "p.gguf", model)
    other = tiny_model(tmp_path / "o.gguf", {0: router(seed=1), 1: router(seed=3)}, n_layer=3)
    with pytest.raises(prof.ProfileError, match=r"another model.*router_hash.*pyvis calibrate predictor"):
        pp.read_predictor_profile(p, other)
    wide = tiny_model(tmp_path / "w.gguf", {0: router(8, seed=1)}, n_layer=3, n_expert=8)
    with pytest.raises(prof.ProfileError, match=r"n_expert: profile 4, model 8"):
        pp.read_predictor_profile(p, wide)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(prof.ProfileError, match="truncated"):
        pp.read_predictor_profile(cut)
    cut.write_bytes(p.read_bytes()[:100])
    with pytest.raises(prof.ProfileError, match="not a GGUF file, or truncated"):
        pp.read_predictor_profile(cut)
    with pytest.raises(prof.ProfileError, match="not a vis profile"):
        pp.read_predictor_profile(model)                                         # a model
    txt = tmp_path / "t.txt"
    txt.write_text("hello")
    with pytest.raises(prof.ProfileError, match="not a GGUF"):
        pp.read_predictor_profile(txt)
    bud = prof.write_buddy_profile(tmp_path / "b.gguf", prof.model_fingerprint(model), np.full((3, 4, 1), -1),
                                   np.zeros((3, 4, 1)), np.zeros((3, 101)), 0.9, 1, 2, 4, "t")
    with pytest.raises(prof.ProfileError, match="a 'buddies' profile, not a 'predictor' one"):
        pp.read_predictor_profile(bud)
    with pytest.raises(prof.ProfileError, match="a 'predictor' profile, not a 'buddies' one"):
        prof.read_buddy_profile(p)
    with pytest.raises(prof.ProfileError, match="over the model itself"):
        _write(model, model)


def test_rows_must_be_distributions(tmp_path, model):
    fp = prof.model_fingerprint(model)
    bad = np.zeros((1, 3, 4, 4))
    bad[0, 1, 2] = [0.5, 0.6, 0, 0]
    with pytest.raises(prof.ProfileError, match=r"predict.coact\[0, 1, 2\] is not a distribution"):
        pp.write_predictor_profile(tmp_path / "p.gguf", fp, np.zeros((3, 4)), bad, 2, 4, "t")
    with pytest.raises(prof.ProfileError, match="shape"):
        pp.write_predictor_profile(tmp_path / "p.gguf", fp, np.zeros((3, 4)), np.zeros((3, 4, 4)), 2, 4, "t")


# --------------------------------------------------------------------------
# pyvis calibrate predictor
# --------------------------------------------------------------------------
def planted(path: Path, n_tokens: int, seed: int) -> Path:
    """A trace of the qwen3moe fixture (32 experts = 8 groups of 4, top-8): each token routes 2 whole groups g at
    layer 0, groups g + 1 at layer 1 and g + 3 at layer 2 (mod 8)."""
    rng = np.random.default_rng(seed)
    g = np.array([rng.choice(8, 2, replace=False) for _ in range(n_tokens)])
    ids = lambda s: (4 * ((g[:, :, None] + s) % 8) + np.arange(4)).reshape(n_tokens, 8)  # noqa: E731
    Trace.from_routes(np.stack([ids(0), ids(1), ids(3)]), 32).save(path)
    return path


def test_calibrate_predictor_cli(tmp_path, capsys):
    from pyvis.cli import main
    cal, ev = planted(tmp_path / "cal.npz", 300, 0), planted(tmp_path / "ev.npz", 100, 1)
    out, js = tmp_path / "p.gguf", tmp_path / "e.json"
    rc = main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--eval-trace", str(ev),
               "--out", str(out), "--lookahead", "2", "--budgets", "8", "12", "--json", str(js)])
    o = capsys.readouterr()
    assert rc == 0, o.err
    assert re.search(r"^coact\s+d1\s+8\s+1\.000\s+1\.000\s+0\.0\s+1\.000$", o.out, re.M), o.out     # planted: exact
    assert re.search(r"^coact\s+d2\s+8\s+1\.000", o.out, re.M)
    m = re.search(r"^frequency\s+d1\s+8\s+([\d.]+)", o.out, re.M)
    assert float(m.group(1)) < 0.5
    assert "recall@8 per source layer" in o.out and f"wrote {out}" in o.out and "[####" in o.err
    p = pp.read_predictor_profile(out, FIXTURE)
    assert (p.lookahead, p.k, p.n_tokens) == (2, 8, 300) and p.source.startswith(f"traces {cal} sha256:")
    assert np.allclose(p.coact[0, 0, 5, 8:12], 1 / 8)          # expert 5 (group 1) at layer 0 -> group 2 at l1
    r = json.loads(js.read_text())
    assert r["coact"]["d2"]["recall"]["8"][0] == 1.0 and r["coact"]["d2"]["recall"]["8"][1] is None
    # a held-out split of the calibration trace instead
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--out", str(out),
                 "--holdout", "0.25"]) == 0
    assert "held-out accuracy: 75 tokens" in capsys.readouterr().out
    p = pp.read_predictor_profile(out)
    assert p.n_tokens == 225 and "evaluated on the last 0.25 of the calibration tokens" in p.source


def test_calibrate_predictor_cli_errors(tmp_path, capsys, model):
    from pyvis.cli import main
    cal = planted(tmp_path / "cal.npz", 40, 0)
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--out", str(FIXTURE)]) == 1
    assert "over the model itself" in capsys.readouterr().err
    assert main(["calibrate", "predictor", "-m", str(model), "--trace", str(cal), "--out", str(tmp_path / "p")]) == 1
    assert "32 experts per layer, the model has 4" in capsys.readouterr().err
    other = tmp_path / "o.npz"
    Trace.from_routes(np.zeros((3, 5, 1), np.int32), 32).save(other)
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--eval-trace", str(other),
                 "--out", str(tmp_path / "p")]) == 1
    assert "the evaluation routes top-1, the calibration top-8" in capsys.readouterr().err
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--eval-trace", str(cal),
                 "--out", str(tmp_path / "p")]) == 1
    assert "is the calibration trace" in capsys.readouterr().err
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--out", str(tmp_path / "p"),
                 "--holdout", "1.5"]) == 1
    assert "--holdout 1.5" in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_calibrate_predictor_from_corpora(tmp_path, capsys):
    """--corpus / --eval-corpus at -k 4: our llama-perplexity writes both traces (needs the native build)."""
    from pyvis.cli import main
    from pyvis.runtime.trace import read
    cal, ev = corpus_text(tmp_path / "cal.txt"), corpus_text(tmp_path / "ev.txt", 1200, 5)
    out = tmp_path / "p.gguf"
    rc = main(["calibrate", "predictor", "-m", str(FIXTURE), "--corpus", str(cal), "--eval-corpus", str(ev),
               "-k", "4", "-c", "128", "--chunks", "2", "-t", "2", "--out", str(out), "--trace-out",
               str(tmp_path / "c.trace"), "--eval-trace-out", str(tmp_path / "e.trace")])
    o = capsys.readouterr()
    assert rc == 0, o.err[-3000:]
    p = pp.read_predictor_profile(out, FIXTURE)
    t, e = read(tmp_path / "c.trace"), read(tmp_path / "e.trace")
    assert p.k == 4 == t.k == e.k and p.n_tokens == 256 == len(t.for_layer(0))
    assert "-c 128 --chunks 2 top-4" in p.source and f"corpus {ev}" in p.source
    c = pr.count([t.routes()], 3, 32, 3)
    assert np.allclose(p.coact, c.tables()) and "held-out accuracy: 256 tokens, top-4" in o.out
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--corpus", str(cal), "--eval-corpus", str(cal),
                 "--out", str(tmp_path / "q.gguf")]) == 1
    assert "--eval-corpus is the calibration text" in capsys.readouterr().err
