"""Predictor profiles at run time: `--moe-predict-profile` (issue #16 item 2, docs/prediction.md#loading-a-profile).

- a planted profile (every expert of layer l points to one set P of layer l+1, fitted on a million tokens) makes the
  d = 1 prediction of coact exactly P on every decode step: the hits counted equal |P ∩ routed| from the run's trace;
- a profile fitted on the run's own routing lifts coact's recall on its first steps above coact learned online only;
  logits stay byte-identical to prediction off;
- next-router / random say the profile is not used; a profile shorter than --moe-lookahead says what is online only;
- a profile of another model, truncated, a directory, a missing file, a buddy profile: a clear error naming the
  flag, the file and the fix, through llama-cli (non-zero exit) and through Python (VisError).
"""
from __future__ import annotations

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from pyvis.runtime import predict as pr
from pyvis.runtime import predict_profile as pp
from pyvis.runtime import profile as vprof
from pyvis.runtime.native import VisError
from pyvis.runtime import trace as vtrace
from conftest import greedy_logits, run

PROMPT = "Reading experts ahead of need must not change a single bit of the output."
N_DECODE = 10
FIX = "pyvis calibrate predictor"


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _planted(path, model, target_sets: dict, n_tokens=1_000_000):
    """A profile whose rows at layer l are uniform over target_sets[l + 1] (every source expert the same), with
    every expert used k / E of the time."""
    fp = vprof.model_fingerprint(model)
    L, E, k = fp["n_layer"], fp["n_expert"], fp["n_expert_used"]
    freq = np.full((L, E), k / E)
    coact = np.zeros((1, L, E, E))
    for t, P in target_sets.items():
        coact[0, t - 1, :, list(P)] = 1.0 / len(P)
    return pp.write_predictor_profile(path, fp, freq, coact, k, n_tokens, "planted", model_path=model)


def _fitted(path, model, trace_path, W=1):
    """A profile fitted on the routing of a run (its --moe-trace)."""
    fp = vprof.model_fingerprint(model)
    ids, layers = vtrace.load(trace_path).routes()
    c = pr.count([(ids, layers)], fp["n_layer"], fp["n_expert"], W)
    return pp.write_predictor_profile(path, fp, c.freq(), c.tables(), fp["n_expert_used"], ids.shape[1], "fitted",
                                      model_path=model)


def test_planted_profile_predicts_its_sets(fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    spec = fx.FIXTURES["qwen3moe"]()
    k = spec.n_expert_used
    sets = {1: set(range(3, 3 + k)), 2: {0, 2, 4, 6, 9, 11, 13, 15}}
    prof = _planted(tmp_path / "planted.gguf", model, sets)
    trace = tmp_path / "run.trace"
    ref, _ = greedy_logits(model, PROMPT, N_DECODE)
    logits, llm = greedy_logits(model, PROMPT, N_DECODE, slots=k, predict="coact", predict_profile=prof,
                                prefetch_tune=False, trace=str(trace))
    assert _same(logits, ref)
    stats = {t: moe.prefetch_stats(llm, t) for t in sets}
    del llm                                                      # closes the trace
    ids, layers = vtrace.load(trace).routes()
    for t, P in sets.items():
        st = stats[t]
        routed = ids[list(layers).index(t), -N_DECODE:]          # the decode steps' rows of layer t
        assert st["n_steps"] == N_DECODE and st["n_predicted"] == N_DECODE * k, st
        assert st["n_pred_hits"] == sum(len(P & set(r.tolist())) for r in routed), (t, st)
    # without the profile, the online counts of the prompt predict something else
    _, llm0 = greedy_logits(model, PROMPT, N_DECODE, slots=k, predict="coact", prefetch_tune=False)
    assert [moe.prefetch_stats(llm0, t)["n_pred_hits"] for t in sets] != [stats[t]["n_pred_hits"] for t in sets]


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2"])
def test_fitted_profile_lifts_early_recall(fixture_dir, tmp_path, name):
    model = fixture_dir / f"{name}.gguf"
    k = fx.FIXTURES[name]().n_expert_used
    trace = tmp_path / "cal.trace"
    ref, llm = greedy_logits(model, PROMPT, N_DECODE, slots=k, trace=str(trace))
    del llm                                                      # closes the trace
    prof = _fitted(tmp_path / "p.gguf", model, trace, W=2)
    recall = {}
    for label, kw in (("online", {}), ("profile", {"predict_profile": prof})):
        logits, llm = greedy_logits(model, PROMPT, 3, slots=k, predict="coact", lookahead=2, prefetch_tune=False, **kw)
        assert _same(logits, ref[: len(logits)]), label
        st = moe.prefetch_stats(llm)
        recall[label] = st["n_pred_hits"] / st["n_routed"]
    assert recall["profile"] > recall["online"], recall
    # freq starts from the profile's frequencies too (measured: 23 -> 38 hits on qwen3moe, 6 -> 9 on deepseek2)
    hits = [moe.prefetch_stats(greedy_logits(model, PROMPT, 3, slots=k, predict="freq", prefetch_tune=False,
                                             **kw)[1])["n_pred_hits"] for kw in ({}, {"predict_profile": prof})]
    assert hits[1] > hits[0], hits


def _cli(bindir, model, *extra, n=4, env=None):
    r = run([bindir / "llama-cli", "-m", model, "-p", PROMPT, "-n", str(n), "-st", "--temp", "0", "-c", "256",
             "-t", "2", "--no-warmup", "-lv", "4", "--moe-slots", "8", *extra], timeout=180, extra_env=env)
    return r, r.stdout + r.stderr


def test_cli_log_lines(bindir, fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    prof = _planted(tmp_path / "p.gguf", model, {1: set(range(8)), 2: set(range(8, 16))}, n_tokens=1234)
    r, out = _cli(bindir, model, "--moe-predict", "coact", "--moe-predict-profile", prof, "--moe-lookahead", "2")
    assert r.returncode == 0, out[-2000:]
    assert "--moe-predict coact, lookahead 2 layers" in out and f"profile {prof} (1234 tokens)" in out
    assert f"--moe-predict-profile {prof} covers distances 1..1, --moe-lookahead is 2" in out
    for mode in ("next-router", "random"):
        r, out = _cli(bindir, model, "--moe-predict", mode, "--moe-predict-profile", prof)
        assert r.returncode == 0, out[-2000:]
        assert f"--moe-predict-profile {prof} is not used: --moe-predict {mode}" in out
    # through the environment, like every flag
    r, out = _cli(bindir, model, "--moe-predict", "freq", env={"VIS_MOE_PREDICT_PROFILE": str(prof)})
    assert r.returncode == 0 and "--moe-predict freq, lookahead 1 layer" in out and f"profile {prof}" in out


def _bad_profiles(fixture_dir, tmp_path):
    """(path, what the error says) for each kind of bad profile, for the qwen3moe fixture."""
    other = fixture_dir / "deepseek2.gguf"
    good = _planted(tmp_path / "qwen.gguf", fixture_dir / "qwen3moe.gguf", {1: set(range(8))}, n_tokens=10)
    ds = _planted(tmp_path / "deepseek2.gguf", other, {2: set(range(4))}, n_tokens=10)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    txt = tmp_path / "notes.txt"
    txt.write_text("not a profile\n")
    fp = vprof.model_fingerprint(fixture_dir / "qwen3moe.gguf")
    L, E = fp["n_layer"], fp["n_expert"]
    bud = vprof.write_buddy_profile(tmp_path / "buddies.gguf", fp, np.full((L, E, 1), -1), np.zeros((L, E, 1)),
                                    np.zeros((L, 101)), 0.9, 1, 8, 10, "t")
    return [
        (ds, "was made for another model (architecture deepseek2, this model is qwen3moe)"),
        (cut, "cannot read it as GGUF: truncated or damaged"),
        (txt, "cannot read it as GGUF: not a GGUF file"),
        (tmp_path, "cannot read it as GGUF: it is a directory, not a file"),
        (tmp_path / "nope.gguf", "cannot read it as GGUF: No such file or directory"),
        (bud, "is a 'buddies' profile, not a 'predictor' one (it goes to VIS_MOE_SUB_PROFILE)"),
    ]


def test_bad_profiles_through_the_cli(bindir, fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    for path, says in _bad_profiles(fixture_dir, tmp_path):
        r, out = _cli(bindir, model, "--moe-predict", "coact", "--moe-predict-profile", path, n=1)
        assert r.returncode != 0, (path, out[-1500:])
        assert f"--moe-predict-profile {path}: {says}" in out and FIX in out, (path, out[-1500:])


def test_bad_profiles_through_python(fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    for path, says in _bad_profiles(fixture_dir, tmp_path):
        with pytest.raises(VisError) as e:
            moe.load(model, moe.MoeConfig(slots=8, predict="freq", predict_profile=path), n_ctx=128, verbose=False)
        assert f"--moe-predict-profile {path}: {says}" in str(e.value) and FIX in str(e.value), str(e.value)
    # the right model accepts its profile
    profile = _bad_profiles(fixture_dir, tmp_path)[0][0].with_name("qwen.gguf")
    llm = moe.load(model, moe.MoeConfig(slots=8, predict="coact", predict_profile=profile), n_ctx=128, verbose=False)
    assert llm is not None
