"""MoEfication builder: a tiny real-weights build loads in our llama.cpp, equals the dense model with
every expert selected, routes for real below that, is deterministic, and rejects bad input clearly."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import pyvis  # noqa: F401
from pyvis.assets import sha256_file
from pyvis.testbed import corpus, moefy, partition
from pyvis import fixtures as fx

ROOT = Path(__file__).resolve().parent.parent
TINY_DIR = ROOT / "models" / "testbed" / "test"
TINY_K = 4


def tiny_spec(**kw) -> moefy.MoefySpec:
    """512 shared + 16 experts x 64 on the first 3 layers of SmolLM2 (layer 0 dense), 1024 calibration tokens."""
    return moefy.preset("shared+16", n_layers=3, calib_tokens=1024, calib_ctx=256, n_expert_used=TINY_K, **kw)


def tiny_calib() -> str:
    return corpus.calibration(max_chars=60_000).text


def _code_hash() -> str:
    h = hashlib.sha256()
    for f in ("moefy.py", "_llm.py", "corpus.py"):
        h.update((ROOT / "pyvis" / "testbed" / f).read_bytes())
    return h.hexdigest()[:16]


def tiny_model() -> Path:
    """The tiny MoE, built once and cached under models/testbed/test/ (rebuilt when the code changes)."""
    from pyvis.assets import smollm2_gguf
    spec = tiny_spec()
    out = TINY_DIR / "tiny-shared16-3L.gguf"
    stamp = out.with_name(out.name + ".stamp")
    want = f"{spec.key()} {_code_hash()} {smollm2_gguf().stat().st_size}"
    if not (out.is_file() and stamp.is_file() and stamp.read_text().strip() == want):
        moefy.build(smollm2_gguf(), out, spec, tiny_calib(), "tiny", progress=None)
        stamp.write_text(want + "\n")
    return out


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def tiny_dense(tiny) -> Path:
    return tiny.with_name("dense-f32-3L.gguf")


def _logits(path: Path, prompt: str, kv: dict | None = None) -> np.ndarray:
    from pyvis.testbed import _llm
    with _llm.Runner(str(path), n_ctx=128, kv_overrides=kv, n_threads=2) as r:
        toks = r.tokenize(prompt)[:96]
        return r.eval_chunk(toks)


PROMPT = ("The mixture of experts model routes each token to a few experts. Vim is a text editor; "
          "to move the cursor, press h, j, k or l. Python's argparse module parses command lines.")


def test_tiny_build_has_deepseek_layout(tiny):
    import gguf
    r = gguf.GGUFReader(str(tiny))
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith(("deepseek.", "general.arch"))}
    assert f["general.architecture"] == "deepseek"
    assert f["deepseek.block_count"] == 3 and f["deepseek.leading_dense_block_count"] == 1
    assert f["deepseek.expert_count"] == 16 and f["deepseek.expert_used_count"] == TINY_K
    assert f["deepseek.expert_feed_forward_length"] == 64 and f["deepseek.expert_shared_count"] == 8
    assert f["deepseek.expert_weights_scale"] == pytest.approx(16.0)
    t = {x.name: x for x in r.tensors}
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t
    assert [int(x) for x in t["blk.1.ffn_gate_exps.weight"].shape] == [576, 64, 16]
    assert [int(x) for x in t["blk.1.ffn_down_exps.weight"].shape] == [64, 576, 16]
    assert [int(x) for x in t["blk.2.ffn_up_shexp.weight"].shape] == [576, 512]
    assert [int(x) for x in t["blk.2.ffn_gate_inp.weight"].shape] == [576, 16]
    # the neurons are a partition of the dense FFN: every dense row appears exactly once
    d = gguf.GGUFReader(str(tiny.with_name("dense-f32-3L.gguf")))
    dg = {x.name: x for x in d.tensors}["blk.1.ffn_gate.weight"].data
    rows = np.concatenate([t["blk.1.ffn_gate_shexp.weight"].data,
                           t["blk.1.ffn_gate_exps.weight"].data.reshape(-1, 576)])
    assert rows.shape == dg.shape
    assert np.array_equal(np.sort(rows.view(np.uint32), axis=0), np.sort(dg.view(np.uint32), axis=0))
    stats = json.loads(Path(str(tiny) + ".json").read_text())
    assert stats["provenance"]["calibration_tokens"] > 0 and len(stats["layers"]) == 2


def test_all_experts_selected_equals_dense(tiny, tiny_dense):
    dense = _logits(tiny_dense, PROMPT)
    full = _logits(tiny, PROMPT, {"deepseek.expert_used_count": 16})
    scale = np.abs(dense).max()
    err = np.abs(full - dense).max()
    assert err < 1e-4 * scale + 1e-3, (err, scale)
    assert (full.argmax(1) == dense.argmax(1)).all()
    # below E it is a real MoE: the output changes, but stays close to the dense model
    topk = _logits(tiny, PROMPT)
    assert np.abs(topk - dense).max() > 100 * err
    assert (topk.argmax(1) == dense.argmax(1)).mean() > 0.5


def test_tiny_model_loads_in_llama_cli_and_perplexity(tiny, bindir, tmp_path):
    from conftest import run
    r = run([bindir / "llama-cli", "-m", tiny, "-p", "Hello, experts", "-n", "4", "-st", "--temp", "0",
             "-c", "128", "-t", "2", "--no-warmup", "-nr", "--override-kv", "deepseek.expert_used_count=int:2"],
            timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    from pyvis.testbed import quality
    f = tmp_path / "t.txt"
    f.write_text(corpus.heldout().text[:12_000])
    res = quality.perplexity(quality.with_k(str(tiny), 8), str(f), ctx=128, chunks=3, threads=2)
    assert np.isfinite(res["ppl"]) and res["ppl"] > 1 and res["chunks"] == 3


def test_routing_trace_of_the_tiny_model(tiny):
    from pyvis.testbed.collect import collect
    text = corpus.heldout().text[:8000]
    tr = collect(tiny, text, n_ctx=128, n_chunks=2, n_threads=2)
    ids, layers = tr.routes()
    assert ids.shape == (2, 2 * 127, TINY_K) and layers.tolist() == [1, 2] and tr.n_expert == 16
    assert len(np.unique(ids[1])) >= 8          # routing spreads over experts
    full = collect(tiny, text, n_ctx=128, n_chunks=1, n_expert_used=16, n_threads=2)
    assert full.k == 16 and (np.sort(full.routes()[0], axis=2) == np.arange(16)).all()


def test_deterministic_for_a_fixed_seed(tiny, tmp_path):
    from pyvis.assets import smollm2_gguf
    res = moefy.build(smollm2_gguf(), tmp_path / "again.gguf", tiny_spec(), tiny_calib(), "tiny",
                      dense_path=tiny.with_name("dense-f32-3L.gguf"), progress=None)
    assert sha256_file(res.path) == sha256_file(tiny)


def test_balanced_kmeans_equal_sizes_and_seeded():
    rng = np.random.default_rng(0)
    P = rng.standard_normal((96, 40)).astype(np.float32)
    P[:48] += 3.0                                        # two clear groups
    P /= np.linalg.norm(P, axis=1, keepdims=True)
    a = partition.balanced_kmeans(P, 4, np.random.default_rng(1))
    b = partition.balanced_kmeans(P, 4, np.random.default_rng(1))
    assert np.array_equal(a, b)
    assert np.bincount(a, minlength=4).tolist() == [24, 24, 24, 24]
    # the clusters respect the two groups
    assert len(set(a[:48]) & set(a[48:])) == 0


def test_shared_neurons_are_the_most_frequent_top_contributors():
    H = np.zeros((50, 20), np.float32)
    H[:, 3] = 5.0                                        # always large
    H[:40, 7] = 4.0                                      # usually large
    H[:, :] += np.linspace(0.01, 0.1, 20)[None, :]
    got = partition.pick_shared(H, np.ones(20, np.float32), 2, top_frac=0.1)
    assert got.tolist() == [3, 7]


# ---------------------------------------------------------------- bad input
def test_rejects_non_llama_gguf():
    p = fx.ensure("qwen3moe")
    with pytest.raises(moefy.MoefyError, match=r"architecture is 'qwen3moe'.*already a MoE"):
        moefy.open_dense(p)


def test_rejects_llama_gguf_that_is_already_moe():
    p = fx.ensure("mixtral")
    with pytest.raises(moefy.MoefyError, match="already a MoE"):
        moefy.open_dense(p)


def test_rejects_expert_counts_that_do_not_divide():
    with pytest.raises(moefy.MoefyError, match="do not divide into 7 equal experts"):
        moefy.check_spec(moefy.preset("shared+16", n_expert=7), 1536, 30)
    with pytest.raises(moefy.MoefyError, match="not a multiple of the expert size"):
        moefy.check_spec(moefy.preset("shared+16", n_shared=500, n_expert=4), 1536, 30)


def test_rejects_empty_calibration_text(tmp_path):
    from pyvis.assets import smollm2_gguf
    with pytest.raises(moefy.MoefyError, match="calibration text is empty"):
        moefy.build(smollm2_gguf(), tmp_path / "x.gguf", tiny_spec(), "  \n ", progress=None)
    assert not (tmp_path / "x.gguf").exists()


def test_cli_reports_errors(tmp_path, capsys):
    from pyvis.cli import main
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["moefy", "-m", str(fx.ensure("qwen3moe")), "-o", str(tmp_path / "o.gguf")]) == 1
    assert "needs a dense 'llama'" in capsys.readouterr().err
    assert main(["moefy", "--n-expert", "7", "--calib-file", str(empty), "-o", str(tmp_path / "o.gguf")]) == 1
    assert "do not divide" in capsys.readouterr().err
    assert main(["moefy", "--calib-file", str(empty), "-o", str(tmp_path / "o.gguf")]) == 1
    assert "calibration text is empty" in capsys.readouterr().err


def test_corpus_texts_are_disjoint_and_recorded():
    h = corpus.heldout()
    c = corpus.calibration(max_chars=200_000)
    assert corpus.check_disjoint(c, h) == 0
    assert len(h.files) == 8 and all(f.endswith(".txt") for f in h.files)
    assert c.files and len(c.sha256) == 64
    with pytest.raises(corpus.CorpusError, match="unknown held-out"):
        corpus.heldout("nope")


def test_presets_fit_smollm2():
    for name, want in (("shared+16", (16, 64, 8)), ("shared+64", (64, 16, 32)), ("mixtral8", (8, 192, 1))):
        s = moefy.preset(name)
        moefy.check_spec(s, 1536, 30)
        m = (1536 - s.n_shared) // s.n_expert
        assert (s.n_expert, m, max(1, s.n_shared // m)) == want
    with pytest.raises(moefy.MoefyError, match="unknown preset"):
        moefy.preset("nope")
