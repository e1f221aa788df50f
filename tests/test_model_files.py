"""The model files users download (#27 item 4): Q4_K_M-style mixed expert types, MXFP4 (gpt-oss) and split GGUFs
run byte-identically to upstream's plain load on every cache path.

Real downloads are not single-type Q4_0: llama.cpp's Q4_K_M gives some layers' ``ffn_down_exps`` Q6_K while their
gate/up stay Q4_K (``use_more_bits``), gpt-oss ships its experts as MXFP4, and files above 50 GB come as
``-0000N-of-0000M.gguf`` shards.  The fixtures here are made the way users' files are: an F32 random-weights model
quantised by libllama's own ``llama_model_quantize`` (Q4_K_M, MXFP4_MOE), and a split written like
``llama-gguf-split``.  Each runs through :func:`conftest.paging_configs` (file tier, host tier, buffered and direct
reads, staging, passes below top-k) and through plain residency (experts copied from the loaded model), and every
logit must equal the plain run's bit for bit.
"""
from __future__ import annotations

import ctypes
import dataclasses

import gguf
import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis.runtime import native as _native
from pyvis.runtime.config import MoeConfig, applied
from conftest import lowlevel_greedy, paging_configs, rewrite_gguf, run, write_split

PROMPT = "Quantised experts of mixed types must page exactly like the rest."
N_DECODE = 4

# qwen3moe with rows of 256 (the K-quants' block), so Q4_K_M keeps K types instead of falling back to Q5/Q8
KQ = fx.ModelSpec(name="kq", arch="qwen3moe", n_layer=3, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                  n_ff_exp=256, n_expert=16, n_expert_used=4, expert_type="F32", weight_type="F32", embd_type="F16",
                  extra={"untied_output": True, "embd_std": fx.VARIED_EMBD_STD})


def _quantize(src, dst, ftype: int) -> None:
    lc = _native.llama_cpp
    p = lc.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, 2
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize failed ({rc})"


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("model-files")
    fx.write_model(KQ, d / "kq-f32.gguf")
    _quantize(d / "kq-f32.gguf", d / "kq-q4_k_m.gguf", _native.llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)
    gx = dataclasses.replace(fx.FIXTURES["gptoss-varied"](), name="gx", expert_type="F32")
    fx.write_model(gx, d / "gx-f32.gguf")
    _quantize(d / "gx-f32.gguf", d / "gx-mxfp4.gguf", _native.llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE)
    shards = write_split(d / "kq-q4_k_m.gguf", d / "split", 12)
    # NVFP4-style per-expert scales (blk.N.ffn_*_exps.scale, shape {n_expert}) on the last layer only: upstream's graph
    # gathers them with the expert ids, which the cache replaces by slot ids, so that layer must stay on its path
    rng = np.random.default_rng(7)
    rewrite_gguf(d / "kq-q4_k_m.gguf", d / "kq-scaled.gguf",
                 add={f"blk.{KQ.n_layer - 1}.ffn_{w}_exps.scale": rng.uniform(0.5, 1.5, KQ.n_expert).astype(np.float32)
                      for w in ("gate", "up", "down")})
    return {"q4_k_m": (d / "kq-q4_k_m.gguf", KQ), "mxfp4": (d / "gx-mxfp4.gguf", gx), "split": (shards, KQ),
            "scaled": (d / "kq-scaled.gguf", KQ)}


def test_the_files_are_what_users_download(files):
    q = _types(files["q4_k_m"][0])
    # one layer mixes types (Q4_K_M's use_more_bits: the last of three layers), the others are all Q4_K
    assert [q[f"blk.{il}.ffn_{w}_exps.weight"] for il in (0, 2) for w in ("gate", "up", "down")] == \
        ["Q4_K"] * 3 + ["Q4_K", "Q4_K", "Q6_K"]
    m = _types(files["mxfp4"][0])
    assert {m[f"blk.{il}.ffn_{w}_exps.weight"] for il in (0, 1) for w in ("gate", "up", "down")} == {"MXFP4"}
    shards = files["split"][0]
    assert len(shards) >= 3 and all(f"-of-{len(shards):05d}.gguf" in s.name for s in shards), shards


def _configs(spec) -> list[dict]:
    k = spec.n_expert_used
    return paging_configs(spec) + [dict(slots=k, store="model"), dict(slots=1, pinned_layers=1, store="model")]


def _greedy(path, extra_bufts: bool, cfg: dict | None):
    """conftest.lowlevel_greedy with the cache settings `cfg` (None: upstream's plain path)."""
    cm = applied(MoeConfig(**cfg)) if cfg else None
    return lowlevel_greedy(path, PROMPT.encode(), N_DECODE, extra_bufts, cm)


def _same(a, b) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kind", ["q4_k_m", "mxfp4", "split"])
def test_byte_identical_on_every_cache_path(files, kind):
    """Without repacking (upstream `--no-repack`, `use_extra_bufts = false`) every layout is the file's, and every
    cache path must equal upstream bit for bit; the reference of the split model is the unsplit file's plain run."""
    path, spec = files[kind]
    first = path[0] if isinstance(path, list) else path
    ref, _ = _greedy(files["q4_k_m"][0] if kind == "split" else first, False, None)
    assert len({int(np.argmax(r)) for r in ref[-N_DECODE:]}) >= 2, "greedy text repeats one token: cannot prove text"
    for cfg in _configs(spec):
        got, (st, io) = _greedy(first, False, cfg)
        where = f"{kind} {cfg}"
        assert _same(got, ref), f"{where}: max |diff| {np.abs(got - ref).max()}"
        assert st is not None and st.n_misses > 0, where          # the cache ran and missed
        if cfg.get("store") == "model":
            assert io["model_copies"] > 0 and io["file_reads"] == 0, where
        else:
            assert io["file_reads"] > 0 and io["model_copies"] == 0, where   # experts came from the file (shards)


@pytest.mark.parametrize("kind", ["q4_k_m", "split"])
def test_repacked_resident_weights_are_the_same_at_every_cache_size(files, kind):
    """With upstream's default repacking of this CPU, resident weights (attention, the pinned prefix) stay repacked
    and managed layers compute on the file's layout (docs/paging.md, "Weight layouts"): a layout upstream cannot
    express, so the contract is the same output at every cache size and tier."""
    path, spec = files[kind]
    first = path[0] if isinstance(path, list) else path
    # (store=model is left out: it would serve experts from the loaded, repacked copy, which the cache refuses with
    # "run with --no-repack"; the file tier never loads or repacks them)
    cfgs = [c for c in _configs(spec) if c.get("store") != "model"]
    outs = {str(cfg): _greedy(first, True, cfg)[0] for cfg in cfgs}
    by_prefix = {}
    for cfg in cfgs:
        by_prefix.setdefault(cfg.get("pinned_layers", 0), []).append(outs[str(cfg)])
    for pinned, group in by_prefix.items():
        assert all(_same(g, group[0]) for g in group[1:]), pinned


def test_a_layout_the_cache_cannot_page_runs_upstreams_path_with_one_line(files, bindir):
    """A layer whose experts carry per-expert scales is a layout the cache does not page (#27 item 4): that layer
    loads and runs as upstream's does, the others page, the output equals upstream's bit for bit, and one line says
    which layers and why.  Before, the attach refused the file."""
    path, spec = files["scaled"]
    ref, _ = _greedy(path, False, None)
    plain, _ = _greedy(files["q4_k_m"][0], False, None)
    assert not _same(ref, plain), "the scales change nothing: the fixture cannot tell"
    k = spec.n_expert_used
    for cfg in (dict(slots=k, pinned_layers=1), dict(slots=1), dict(slots=k, host_mib=1), dict(slots=k, store="model")):
        got, (st, io) = _greedy(path, False, cfg)
        assert _same(got, ref), f"{cfg}: max |diff| {np.abs(got - ref).max()}"
        assert st.n_misses > 0, cfg                                  # the other layers paged
    last = spec.n_layer - 1
    r = run([bindir / "llama-cli", "-m", path, "-p", PROMPT, "-n", "4", "-st", "--no-repack", "-t", "2", "-s", "1",
             "--moe-slots", str(k), "--temp", "0"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "per-expert scales" in ln]
    assert len(lines) == 1 and f"layer {last} runs upstream's path" in lines[0] and \
        f"blk.{last}.ffn_gate_exps.scale" in lines[0], r.stderr[-2000:]
