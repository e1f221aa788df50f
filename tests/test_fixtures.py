"""The synthetic MoE fixtures: deterministic, the declared shapes, real tokenizer."""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from pyvis import fixtures as fx


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    spec = fx.FIXTURES["mixtral"]
    a = fx.write_model(spec(seed=7), tmp_path / "a.gguf")
    b = fx.write_model(spec(seed=7), tmp_path / "b.gguf")
    c = fx.write_model(spec(seed=8), tmp_path / "c.gguf")
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)


@pytest.mark.parametrize("name", list(fx.FIXTURES))
def test_fixture_declares_its_moe_shape(fixture_dir, name):
    spec = fx.FIXTURES[name]()
    r = gguf.GGUFReader(fixture_dir / f"{name}.gguf")
    arch = r.fields["general.architecture"].contents()
    assert arch == spec.arch
    assert r.fields[f"{arch}.expert_count"].contents() == spec.n_expert
    assert r.fields[f"{arch}.expert_used_count"].contents() == spec.n_expert_used
    t = {x.name: x for x in r.tensors}
    last = spec.n_layer - 1
    down = t[f"blk.{last}.ffn_down_exps.weight"]
    assert list(down.shape) == [spec.n_ff_exp, spec.n_embd, spec.n_expert]  # ggml order
    assert down.tensor_type.name == spec.expert_type
    if spec.merged_gate_up:
        assert f"blk.{last}.ffn_gate_up_exps.weight" in t and f"blk.{last}.ffn_gate_exps.weight" not in t
    if spec.n_expert_shared:
        assert f"blk.{last}.ffn_gate_shexp.weight" in t
    if spec.n_dense_lead:
        assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_exps.weight" not in t
    if arch == "gpt-oss":
        assert f"blk.{last}.ffn_down_exps.bias" in t
    # real tokenizer copied from SmolLM2
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_router_is_decisive(fixture_dir):
    """Random routers must not produce ties (ties would make top-k order arbitrary)."""
    r = gguf.GGUFReader(fixture_dir / "qwen3moe.gguf")
    w = next(x for x in r.tensors if x.name == "blk.1.ffn_gate_inp.weight").data  # [n_expert, n_embd]
    x = np.random.default_rng(0).standard_normal((64, w.shape[1]), dtype=np.float32)
    logits = x @ w.T
    top = np.sort(logits, axis=1)[:, ::-1]
    assert np.all(top[:, 7] - top[:, 8] > 0)  # k-th and (k+1)-th differ for every token


def test_large_preset_dimensions():
    s = fx.large_preset(n_layer=48)
    assert (s.n_layer, s.n_expert, s.n_expert_used, s.n_embd, s.n_ff_exp) == (48, 128, 8, 2048, 768)
    expert_bytes = sum(fx._byte_size(t) for t in fx.tensor_plan(s) if "_exps" in t.name)
    # 48 layers * 128 experts * 3 matrices * 2048*768 values at Q4_0 (18 bytes / 32 values)
    assert expert_bytes == 48 * 128 * 3 * 2048 * 768 // 32 * 18


def test_large_fast_quant_is_valid_gguf(tmp_path):
    s = fx.large_preset(n_layer=1, name="large-1l")
    p = fx.write_model(s, tmp_path / "l.gguf", fast_quant=True)
    r = gguf.GGUFReader(p)
    t = {x.name: x for x in r.tensors}
    assert t["blk.0.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    # the scales are finite f16 values
    raw = np.asarray(t["blk.0.ffn_up_exps.weight"].data).reshape(-1, 18)
    d = raw[:1000, :2].copy().view(np.float16)
    assert np.all(np.isfinite(d)) and np.all(d > 0)


def _greedy_tokens(path, n: int = 12) -> list[int]:
    import llama_cpp
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    llm.eval(llm.tokenize(b"Mixture-of-experts layers route every token to a few experts", add_bos=True))
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


@pytest.mark.parametrize("name", sorted(set(fx.VARIED_TEXT.values())))
def test_varied_text_fixtures_generate_more_than_one_token(fixture_dir, name):
    """A test that compares generated text uses these (fx.VARIED_TEXT): their greedy text is not one token repeated,
    so a change in what the layers compute can show in it (tests/test_substitution.py: router substitution does)."""
    out = _greedy_tokens(fixture_dir / f"{name}.gguf")
    assert len(set(out)) >= 4, out


def test_tied_fixtures_repeat_one_token(fixture_dir):
    """Why the -varied variants exist: with the output tied to large embeddings, greedy text is the prompt's last
    token over and over (the check above rejects it)."""
    out = _greedy_tokens(fixture_dir / "qwen3moe.gguf")
    assert len(set(out)) == 1, out
    # a variant is its base model with an output matrix and the embeddings scaled down: nothing else differs
    r, u = (gguf.GGUFReader(fixture_dir / f"{n}.gguf") for n in ("qwen3moe", "qwen3moe-varied"))
    tu = {t.name: t for t in u.tensors}
    assert set(tu) == {t.name for t in r.tensors} | {"output.weight"}
    for t in r.tensors:
        a, b = np.asarray(t.data), np.asarray(tu[t.name].data)
        if t.name == "token_embd.weight":
            assert np.allclose(b, a * fx.VARIED_EMBD_STD, rtol=2e-3, atol=1e-7)
        else:
            assert np.array_equal(a, b), t.name
