"""The synthetic MoE fixtures: deterministic, the declared shapes, real tokenizer."""
from __future__ import annotations

import hashlib
import sys

import gguf
import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis.fixtures import large
from pyvis.fixtures import mmproj as mm
from pyvis.runtime import trace as vtrace

from conftest import run


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


# ---- pyvis fixtures --large --arch qwen3vlmoe: Qwen3-VL-30B-A3B's pair (pyvis/fixtures/large.py) ----
# the same code path at a small size: the preset's head_dim (128, so the real M-RoPE sections 24/20/20) and its 3
# deepstack layers, a narrower model and a 4-layer encoder with F16 weights
SMALL_VL = dict(n_layer=4, n_embd=256, n_head=2, n_head_kv=1, n_ff=256, n_ff_exp=64, n_expert=16)
SMALL_VISION = dict(n_embd_v=64, n_head=4, n_ff=128, n_layer=4, pos_side=4, deepstack_layers=[1, 2, 3])


def test_large_vlm_text_model_is_the_qwen3moe_large_with_mrope_and_deepstack():
    vl, text = fx.large_preset(arch="qwen3vlmoe"), fx.large_preset()
    assert [(t.name, t.ne, t.qtype) for t in fx.tensor_plan(vl)] == [(t.name, t.ne, t.qtype) for t in fx.tensor_plan(text)]
    assert vl.extra == fx.QWEN3VL_TEXT_EXTRA and sum(vl.extra["rope_sections"]) == vl.head_dim // 2
    shaped = fx.large_preset(arch="qwen3vlmoe", routing="shaped")
    assert shaped.extra == {**fx.large_preset(routing="shaped").extra, **fx.QWEN3VL_TEXT_EXTRA}
    with pytest.raises(fx.FixtureError, match="qwen3vlmoe"):
        fx.large_preset(arch="llama")


@pytest.mark.parametrize("routing", ["random", "shaped"])
def test_large_vlm_pair_runs_in_llama_mtmd_cli(bindir, tmp_path, routing):
    """The written text model + mmproj + image run through llama-mtmd-cli: the encoder's width matches the text
    model's input (n_embd x (1 + 3 deepstack layers), checked by libmtmd) and the image's 8 x 8 tokens reach every
    layer; the encoder's matmul weights are F16 and its deepstack layers are the asked ones."""
    spec = fx.large_preset(arch="qwen3vlmoe", routing=routing, **SMALL_VL)
    text, proj, image = large.write_large(tmp_path, spec, vision=SMALL_VISION)
    assert text.name == f"qwen3vl-30b-a3b-4L-q4_0{'-shaped' if routing == 'shaped' else ''}.gguf"
    r = gguf.GGUFReader(text)
    assert r.fields["qwen3vlmoe.n_deepstack_layers"].contents() == 3
    assert r.fields["qwen3vlmoe.rope.dimension_sections"].contents() == [24, 20, 20, 0]
    t = {x.name: x for x in gguf.GGUFReader(proj).tensors}
    assert t["v.blk.3.ffn_up.weight"].tensor_type.name == "F16" and t["mm.0.weight"].tensor_type.name == "F16"
    assert sorted(n for n in t if n.endswith("fc1.weight")) == [f"v.deepstack.{i}.fc1.weight" for i in (1, 2, 3)]
    tr = tmp_path / "vl.trace"
    c = run([bindir / "llama-mtmd-cli", "-m", text, "--mmproj", proj, "--image", image, "-p", "Describe the image.",
             "-n", "4", "--temp", "0", "-c", "512", "-t", "2", "--moe-trace", tr], timeout=180)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "mtmd batch encoding done" in c.stderr
    trace = vtrace.read(tr)
    nx, ny = mm.expected_image_tokens(*large.IMAGE_SIZE)
    assert (nx, ny) == (8, 8)
    for il in range(spec.n_layer - 1):   # the last layer only sees output rows
        assert (trace.for_layer(il).modality == 1).sum() == nx * ny, il


def test_large_flags_are_strict(tmp_path):
    for args, says in ((["--arch", "qwen3vlmoe"], "only applies to --large"),
                       (["--layers", "48"], "only applies to --large"),
                       (["--large", "--arch", "qwen3vlmoe", "--layers", "3"], "more layers than its 3 deepstack"),
                       (["--large", "--only", "qwen3moe"], "--only picks small fixtures"),
                       (["--large", "--arch", "llama"], "invalid choice")):
        r = run([sys.executable, "-m", "pyvis", "fixtures", "--out", tmp_path, *args])
        assert r.returncode != 0 and says in r.stderr, (args, r.stderr)
    assert not list(tmp_path.iterdir())
