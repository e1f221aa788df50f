"""--moe-topk N (lossy, off by default): each token runs its N highest-weighted experts instead of the model's k.

What it computes is defined by upstream: the same model with `<arch>.expert_used_count` overridden to N. So the
logits must equal that run bit for bit, with and without the expert cache, on every fixture architecture; and they
must differ from the model's own (a no-op --moe-topk fails here).
"""
from __future__ import annotations

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from pyvis.runtime import native, trace as vtrace
from conftest import LOGITS_KW, TEXT_FIXTURES, greedy_logits, run

PROMPT = "Fewer experts per token: each token keeps only its highest-weighted experts."
N_DECODE = 4


def _arch_and_k(name: str) -> tuple[str, int]:
    spec = fx.FIXTURES[name]()
    return spec.arch, spec.n_expert_used


def _override_logits(path, arch: str, n: int):
    """Upstream's path with expert_used_count = n (no vis-moe setting in force)."""
    kw = dict(LOGITS_KW, kv_overrides={f"{arch}.expert_used_count": n})
    llm = native.llama_cpp.Llama(str(path), **kw)
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    for _ in range(N_DECODE):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return np.array(llm.scores[: llm.n_tokens], copy=True)


@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_topk_is_upstream_with_fewer_experts(fixture_dir, monkeypatch, name):
    path = fixture_dir / f"{name}.gguf"
    arch, k = _arch_and_k(name)
    n = k - 1
    ref = _override_logits(path, arch, n)
    own, _ = greedy_logits(path, PROMPT, N_DECODE)
    cached, llm = greedy_logits(path, PROMPT, N_DECODE, slots=max(1, n // 2), topk=n)  # with the cache, in passes
    monkeypatch.setenv("VIS_MOE_TOPK", str(n))
    plain, _ = greedy_logits(path, PROMPT, N_DECODE)          # no cache (the variable): only the graph's k changes
    assert moe.stats(llm) is not None and moe.stats(llm).n_misses > 0
    assert np.array_equal(plain, ref), name
    assert np.array_equal(cached, ref), name
    assert not np.array_equal(plain[: ref.shape[0]], own[: ref.shape[0]]), f"{name}: --moe-topk {n} changed nothing"


def test_topk_at_the_models_k_is_the_model(fixture_dir, monkeypatch):
    path = fixture_dir / "qwen3moe.gguf"
    _, k = _arch_and_k("qwen3moe")
    own, _ = greedy_logits(path, PROMPT, N_DECODE)
    monkeypatch.setenv("VIS_MOE_TOPK", str(k))
    same, _ = greedy_logits(path, PROMPT, N_DECODE)
    assert np.array_equal(own, same)


def test_trace_records_the_experts_that_ran(fixture_dir, tmp_path):
    """The routing trace of a --moe-topk run holds N experts per token, each token's N best of the model's k."""
    path = fixture_dir / "mixtral.gguf"
    _, k = _arch_and_k("mixtral")
    full_t, topk_t = tmp_path / "full.trace", tmp_path / "topk.trace"
    greedy_logits(path, PROMPT, 0, trace=str(full_t))
    greedy_logits(path, PROMPT, 0, trace=str(topk_t), topk=1)
    full, top = vtrace.read(full_t), vtrace.read(topk_t)
    assert (full.n_expert_used, top.n_expert_used) == (k, 1)
    for il in full.layers().tolist():
        f, t = full.for_layer(il), top.for_layer(il)
        best = f.ids[np.arange(len(f)), np.argmax(f.weights, axis=1)]
        assert np.array_equal(t.ids[:, 0], best)
        assert np.allclose(t.weights[:, 0], 1.0)                  # renormalised over the one expert it runs


def test_topk_above_the_models_k_is_a_clear_error(bindir, fixture_dir, monkeypatch):
    _, k = _arch_and_k("qwen3moe")
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "hi", "-n", "2", "-st", "--no-warmup",
             "--moe-topk", str(k + 1)])
    assert r.returncode != 0
    assert f"--moe-topk {k + 1}: the model runs {k} experts per token" in r.stderr
    monkeypatch.setenv("VIS_MOE_TOPK", "two")
    with pytest.raises(native.VisError, match="VIS_MOE_TOPK.*expected an integer"):
        moe.load(fixture_dir / "qwen3moe.gguf", n_ctx=64, verbose=False)


def test_topk_run_says_it_is_lossy(bindir, fixture_dir):
    """The log (llama-cli shows it with -v) and the --moe-stats footer say that the run is lossy."""
    for flag in ("-v", "--moe-stats"):
        r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "hi", "-n", "2", "-st", "--no-warmup",
                 "--moe-topk", "1", flag])
        assert r.returncode == 0, r.stderr[-2000:]
        assert ("--moe-topk 1: each token runs its 1 highest-weighted experts instead of the model's 8 (lossy" in
                r.stdout + r.stderr), flag
