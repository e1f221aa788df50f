"""The VisMMOE lookahead MLP (issue #16 item 1, docs/prediction-calibration.md "The lookahead MLP"): the routing-history
histogram, the decayed targets and the forward pass against hand computations (the forward on the same tiny weights
as tests/test-vis-predict-mlp.cpp, so NumPy and C agree); a planted rule it must learn; its recall through the
shared metrics; the profile round trip and its errors; `pyvis calibrate predictor --mlp` end to end on a fixture
and the runtime's errors for a missing, MLP-less or foreign profile."""
from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from pyvis.calibrate import mlp as M
from pyvis.runtime import predict as pr
from pyvis.runtime import predict_profile as pp
from pyvis.runtime import profile as prof
from pyvis.runtime.predict_mlp import MlpWeights, history
from test_prediction_calibration import FIXTURE
from test_substitution_profile import corpus_text, router, tiny_model

sig = lambda x: 1 / (1 + np.exp(-np.asarray(x, np.float64)))  # noqa: E731


def tiny_weights() -> MlpWeights:
    """tests/test-vis-predict-mlp.cpp's profile: 3 layers, E = 4, n_embd 3, H = 2, 2 heads, history 2 (0.5)."""
    L, E, n, H, O = 3, 4, 3, 2, 8
    w1, b1 = np.zeros((L, H, E + n), np.float32), np.zeros((L, H), np.float32)
    w2, b2 = np.zeros((L, O, H), np.float32), np.zeros((L, O), np.float32)
    w1[0] = [[1, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1, -1]]
    b1[0, 1] = 0.5
    w2[0, :, 0] = [1.0 if o % 4 == 3 else 0.1 * o for o in range(O)]
    w1[1] = [[1, 2, 3, 4, 0, 0, 0], [-1, 0, 0, 0, 0, 0, 0]]
    w2[1, :, 0] = [0.1 * (o + 1) for o in range(O)]
    b2[1] = -1
    return MlpWeights(2, H, n, 2, 0.5, 0.8, np.array([1, 1, 0], np.int32), w1, b1, w2, b2)


def test_history_by_hand():
    m = {0: np.array([[0, 1, 1, 0]], bool), 1: np.array([[1, 1, 0, 0]], bool), 3: np.array([[0, 0, 0, 1]], bool)}
    assert history(m, 1, 2, 0.5)[0].tolist() == [1, 1.5, 0.5, 0]
    assert history(m, 1, 1, 0.5)[0].tolist() == [1, 1, 0, 0]                 # layer l only
    assert history(m, 3, 3, 0.5)[0].tolist() == [0.25, 0.25, 0, 1]            # layer 2 is not a MoE layer: no term
    assert history(m, 0, 2, 0.5)[0].tolist() == [0, 1, 1, 0]


def test_forward_by_hand_as_in_c():
    w = tiny_weights()
    assert w.n_expert == 4
    y = w.logits(0, [[0, 1, 1, 0]], [[2, 1, 3]])
    assert y[0].tolist() == pytest.approx([0, 0.2, 0.4, 2, 0.8, 1.0, 1.2, 2])     # a = (2, relu(1 - 3 + .5) = 0)
    s = w.scores(1, 1, [[1, 1.5, 0.5, 0]], [[2, 1, 3]])                          # a0 = 1 + 3 + 1.5 = 5.5
    assert s[0] == pytest.approx(sig([0.55 * (e + 1) - 1 for e in range(4)]))
    assert w.scores(0, 2, [[0, 1, 1, 0]], [[2, 1, 3]])[0] == pytest.approx(sig([0.8, 1.0, 1.2, 2.0]))


def test_decayed_targets_by_hand():
    m = {0: np.array([[1, 0, 0, 0]], bool), 1: np.array([[0, 1, 1, 0]], bool), 2: np.array([[0, 0, 1, 1]], bool)}
    Y, cw = M.targets(m, 0, 4, 3, 0.8)
    assert Y[0].tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]     # heads d = 1, 2; layer 3 is not there
    assert cw.tolist() == pytest.approx([1] * 4 + [0.8] * 4 + [0] * 4)
    Y, cw = M.targets(m, 1, 4, 2, 0.5)
    assert Y[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0] and cw.tolist() == [1] * 4 + [0] * 4


def planted(n: int, seed: int, n_embd: int = 8) -> M.Capture:
    """3 MoE layers of 8 experts (4 groups of 2), top-2: a token of class c (0..3, written in its hidden states)
    routes group c % 2 at layer 0, (c + 1) % 4 at layer 1 and (c + 2) % 4 at layer 2: layer 0's routing alone
    cannot tell layer 1's (classes c and c + 2 route alike there), the hidden state can."""
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 4, n)
    grp = lambda g: np.stack([2 * g, 2 * g + 1], 1)  # noqa: E731
    ids = np.stack([grp(c % 2), grp((c + 1) % 4), grp((c + 2) % 4)]).astype(np.int32)
    h = rng.standard_normal((3, n, n_embd)).astype(np.float32) * 0.1
    h[:, np.arange(n), c] += 3.0
    return M.Capture(ids, np.array([0, 1, 2]), h.astype(np.float16), "planted")


def test_mlp_learns_a_planted_rule_and_is_scored_like_the_others():
    fit, ev = planted(600, 0), planted(200, 1)
    w = M.fit_mlp(fit, 3, 8, lookahead=2, hidden=16, epochs=30, lr=1e-2)
    assert w.layers.tolist() == [1, 1, 0] and w.w1.shape == (3, 16, 16) and w.w2.shape == (3, 16, 16)
    base = pr.Model.from_counts(pr.count(fit.routes(), 3, 8, 2))
    r = pr.evaluate(M.CaptureScorer(base, ev, w, None), ev.routes(), [2, 4], predictors=("frequency", "mlp"))
    assert r["mlp"]["d1"]["recall"]["2"] == pytest.approx([1.0, 1.0])
    assert r["mlp"]["d2"]["recall"]["2"][0] == pytest.approx(1.0)
    assert r["mlp"]["decayed"]["recall"]["4"][0] == pytest.approx(1.0)
    assert max(r["frequency"]["d1"]["recall"]["2"]) < 0.5
    # the folded standardisation: the stored weights on raw hidden states give the trained predictions
    s = w.scores(0, 1, history({0: pr.masks(ev.ids[0], 8)}, 0, 2, 0.5), ev.hidden[0].astype(np.float32))
    assert (np.sort(np.argsort(-s, 1)[:, :2], 1) == ev.ids[1]).all()


@pytest.fixture()
def model(tmp_path):
    return tiny_model(tmp_path / "m.gguf", {0: router(8, seed=1), 1: router(8, seed=2)}, n_layer=3, n_expert=8)


def _write(path, model, mlp):
    cap = planted(100, 0)
    c = pr.count(cap.routes(), 3, 8, 2)
    return pp.write_predictor_profile(path, prof.model_fingerprint(model), c.freq(), c.tables(), 2, 100, "t",
                                      model_path=model, mlp=mlp)


def test_profile_round_trip_and_errors(tmp_path, model):
    w = M.fit_mlp(planted(100, 0), 3, 8, lookahead=2, hidden=4, epochs=1)
    q = pp.read_predictor_profile(_write(tmp_path / "p.gguf", model, w), model)
    assert q.mlp is not None and (q.mlp.lookahead, q.mlp.hidden, q.mlp.n_embd, q.mlp.history) == (2, 4, 8, 2)
    for name in ("layers", "w1", "b1", "w2", "b2"):
        assert np.array_equal(getattr(q.mlp, name), getattr(w, name)), name
    assert pp.read_predictor_profile(_write(tmp_path / "n.gguf", model, None)).mlp is None    # coact / freq only
    bad = MlpWeights(**{**w.__dict__, "b2": w.b2[:, :3]})
    with pytest.raises(prof.ProfileError, match=r"predict.mlp.b2 is \(3, 3\), expected \(3, 16\).*--mlp"):
        _write(tmp_path / "b.gguf", model, bad)
    nan = MlpWeights(**{**w.__dict__, "w1": np.full_like(w.w1, np.nan)})
    with pytest.raises(prof.ProfileError, match="non-finite"):
        _write(tmp_path / "b.gguf", model, nan)
    p = tmp_path / "p.gguf"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:-64])
    with pytest.raises(prof.ProfileError, match="truncated"):
        pp.read_predictor_profile(cut)


def test_cli_mlp_needs_hidden_states(tmp_path, capsys):
    from pyvis.cli import main
    from test_prediction_calibration import planted as planted_trace
    cal = planted_trace(tmp_path / "cal.npz", 40, 0)
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--trace", str(cal), "--mlp",
                 "--out", str(tmp_path / "p.gguf")]) == 1
    assert "hidden states, which routing traces (--trace / --eval-trace) do not carry" in capsys.readouterr().err
    assert main(["calibrate", "predictor", "-m", str(FIXTURE), "--corpus", "x.txt", "--mlp", "--mlp-hidden", "0",
                 "--out", str(tmp_path / "p.gguf")]) == 1
    assert "--mlp-hidden 0" in capsys.readouterr().err and not (tmp_path / "p.gguf").exists()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """`pyvis calibrate predictor --mlp` on the qwen3moe fixture: its output and profile (needs the native build)."""
    from pyvis.cli import main
    d = tmp_path_factory.mktemp("mlp")
    cal, ev = corpus_text(d / "cal.txt"), corpus_text(d / "ev.txt", 1200, 5)
    out = d / "p.gguf"
    import contextlib
    import io
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main(["calibrate", "predictor", "-m", str(FIXTURE), "--corpus", str(cal), "--eval-corpus", str(ev),
                   "-k", "4", "-c", "128", "--chunks", "2", "-t", "2", "-W", "2", "--mlp", "--mlp-epochs", "3",
                   "--out", str(out)])
    assert rc == 0, e.getvalue()[-3000:]
    return out, o.getvalue(), e.getvalue()


def test_calibrate_predictor_mlp_end_to_end(calibrated):
    out, o, e = calibrated
    p = pp.read_predictor_profile(out, FIXTURE)
    assert p.mlp is not None and p.mlp.lookahead == 2 and p.mlp.layers.tolist() == [1, 1, 0]
    assert p.k == 4 and p.n_tokens == 254 and "eval-callback capture -c 128 --chunks 2 top-4" in p.source
    for name in ("frequency", "coact", "mlp", "next-router"):
        assert re.search(rf"^{name}\s+d1\s+4\s+[\d.]+", o, re.M), name
    assert "capture [####" in e and "mlp [####" in e and "held-out accuracy: 254 tokens, top-4" in o


def test_runtime_mlp_errors(tmp_path, calibrated, fixture_dir):
    from pyvis import moe
    from pyvis.runtime.native import VisError
    from conftest import LOGITS_KW
    with pytest.raises(VisError, match=r"--moe-predict mlp needs --moe-predict-profile.*--mlp"):
        moe.load(FIXTURE, moe.MoeConfig(slots=8, predict="mlp"), **LOGITS_KW)
    q = pp.read_predictor_profile(calibrated[0])
    plain = pp.write_predictor_profile(tmp_path / "plain.gguf", prof.model_fingerprint(FIXTURE), q.freq, q.coact,
                                       q.k, q.n_tokens, "t", model_path=FIXTURE)
    with pytest.raises(VisError, match=r"plain.gguf holds no MLP.*calibrate predictor .*--mlp"):
        moe.load(FIXTURE, moe.MoeConfig(slots=8, predict="mlp", predict_profile=str(plain)), **LOGITS_KW)
    with pytest.raises(VisError, match=r"another model"):
        moe.load(fixture_dir / "deepseek2.gguf", moe.MoeConfig(slots=8, predict="mlp", predict_profile=str(calibrated[0])),
                 **LOGITS_KW)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(calibrated[0].read_bytes()[:-100])
    with pytest.raises(VisError, match=r"--moe-predict-profile .*cut.gguf: cannot read it as GGUF"):
        moe.load(FIXTURE, moe.MoeConfig(slots=8, predict="mlp", predict_profile=str(cut)), **LOGITS_KW)
    llm = moe.load(FIXTURE, moe.MoeConfig(slots=8, predict="mlp", predict_profile=str(calibrated[0]), lookahead=2),
                   **LOGITS_KW)
    llm.eval(llm.tokenize(b"Experts ahead", add_bos=True))
    for _ in range(4):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    st = moe.prefetch_stats(llm)
    assert st["n_steps"] > 0 and st["n_predicted"] == st["n_steps"] * 8


def test_runtime_mlp_predicts_what_its_weights_score_on_the_captured_states(tmp_path):
    """The runtime feeds the MLP the state its weights were fitted on: a planted MLP (each expert's score a random
    projection of layer l's FFN input, no history term) run by --moe-predict mlp counts, per layer, exactly the hits
    of MlpWeights.scores on the FFN inputs captured for the same tokens (top-B, ties to the lower id) against the
    routing of the run's trace.  Another row, stride, layer or tensor fed to the MLP changes its predictions."""
    from conftest import greedy_logits
    from pyvis import moe
    from pyvis.runtime import trace as vtrace
    from pyvis.testbed import _llm
    fp = prof.model_fingerprint(FIXTURE)
    L, E, k = fp["n_layer"], fp["n_expert"], fp["n_expert_used"]
    n = 64                                                   # the fixture's n_embd
    rng = np.random.default_rng(5)
    w1 = np.zeros((L, E, E + n), np.float32)
    w1[:, :, E:] = rng.standard_normal((L, E, n)) / np.sqrt(n)   # u_e . h ~ N(0, 1) on an RMS-normed h
    b1 = np.full((L, E), 4.0, np.float32)                          # relu(u_e . h + 4) - 4 = u_e . h
    w2 = np.tile(np.eye(E, dtype=np.float32), (L, 1, 1))
    b2 = np.full((L, E), -4.0, np.float32)
    w = MlpWeights(1, E, n, 1, 0.5, 0.8, np.array([1] * (L - 1) + [0], np.int32), w1, b1, w2, b2)
    path = pp.write_predictor_profile(tmp_path / "planted-mlp.gguf", fp, np.full((L, E), k / E),
                                      np.zeros((1, L, E, E)), k, 1000, "planted", model_path=FIXTURE, mlp=w)
    N = 10
    tr = tmp_path / "run.trace"
    _, llm = greedy_logits(FIXTURE, "Experts ahead of need, predicted by a small network", N, slots=k,
                           predict="mlp", predict_profile=str(path), lookahead=1, prefetch_tune=False, trace=str(tr))
    stats = {t: moe.prefetch_stats(llm, t) for t in range(1, L)}
    tokens = [int(x) for x in llm.input_ids[: llm.n_tokens]]
    del llm                                                  # closes the trace
    t_run = vtrace.read(tr)
    hidden: dict[int, np.ndarray] = {}

    def on_tensor(name, t):
        x = ctypes.cast(t, ctypes.POINTER(_llm.ggml_tensor)).contents
        hidden[int(M._LOGITS.match(name).group(1))] = _llm.read_tensor(x.src[1]).astype(np.float32)

    with _llm.Runner(str(FIXTURE), n_ctx=256, n_threads=2, raw=True, on_tensor=on_tensor,
                     want=lambda nm: M._LOGITS.match(nm) is not None) as r:
        r.eval_chunk(tokens)
    for t in range(1, L):
        src = t - 1
        ids_src, ids_t = t_run.for_layer(src).ids[-N:], t_run.for_layer(t).ids[-N:]   # the decode steps' rows
        s = w.scores(src, 1, history({src: pr.masks(ids_src, E)}, src, 1, 0.5), hidden[src][-N:])
        top = np.argsort(-s, axis=1, kind="stable")[:, :k]
        want = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top, ids_t))
        st = stats[t]
        assert st["n_steps"] == N and st["n_predicted"] == N * k, st
        assert st["n_pred_hits"] == want, (t, st["n_pred_hits"], want)
