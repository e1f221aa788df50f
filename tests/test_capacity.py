"""Entropy-weighted capacity (issue #14 item 3, docs/precision.md): image pairs over a layer's capacity of missing
experts rerouted to experts in memory (MACS on one device).  The rule itself is checked by hand in
tests/test-vis-capacity.cpp; here the runtime:

- text prompts with --moe-capacity on: byte-identical (text tokens are never rerouted);
- an image prompt: the image ubatches see the rule (R_v = 1: libmtmd decodes images in ubatches of their own),
  experts over capacity are rerouted, and the loaded + overflow counts add up; a capacity no image needs changes
  nothing (same text and routing trace as off);
- the MACS weights of the runtime equal pyvis's (the pruning score's entropy);
- a modality profile from `pyvis calibrate modality` loads; a wrong file and bad values are clear errors.
"""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import pyvis  # noqa: F401
from pyvis import moe
from pyvis.runtime import native
from pyvis.runtime import trace as vtrace
from pyvis.runtime.cachesim import lru_misses
from pyvis.runtime.native import VisError
from pyvis.vlm import prune
from conftest import greedy_logits, run

PROMPT = "Capacity is for images; text keeps every expert it routes."


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3vlmoe"])
def test_text_is_byte_identical(fixture_dir, name):
    model = fixture_dir / f"{name}.gguf"
    ref, _ = greedy_logits(model, PROMPT, 4, slots=2)
    got, llm = greedy_logits(model, PROMPT, 4, slots=2, capacity=1, cap_rho=2.0)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert moe.cap_stats(llm)["n_ubatches"] == 0


def _mtmd(bindir, fixture_dir, *extra, trace=None):
    t = ["--moe-trace", trace] if trace else []
    return run([bindir / "llama-mtmd-cli", "-m", fixture_dir / "qwen3vlmoe.gguf",
                "--mmproj", fixture_dir / "qwen3vlmoe-mmproj.gguf", "--image", fixture_dir / "test-image.png",
                "-p", "Describe the image.", "-n", "6", "--temp", "0", "-c", "512", "-t", "2", "--moe-slots", "4",
                "--moe-stats", *t, *extra], timeout=240,
               extra_env={"VIS_MOE_POLICY": "lru"})   # the residency check below replays LRU (resident_before)


def _cap_total(text):
    i = text.find("entropy-weighted capacity (--moe-capacity)")
    m = re.search(r"vis-moe:\s+total\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)",
                  text[i:])
    assert i >= 0 and m, text[-3000:]
    g = m.groups()
    return dict(ubatches=int(g[0]), cap=float(g[1]), rv=float(g[2]), missing=int(g[3]), loaded=int(g[4]),
                overflow=int(g[5]), forced=int(g[6]), rerouted=int(g[7]), dropped=int(g[8]))


def test_image_prompt_reroutes_over_capacity(bindir, fixture_dir, tmp_path):
    off = _mtmd(bindir, fixture_dir, trace=tmp_path / "off.trace")
    big = _mtmd(bindir, fixture_dir, "--moe-capacity", "64", trace=tmp_path / "big.trace")
    one = _mtmd(bindir, fixture_dir, "--moe-capacity", "1", "--moe-cap-rho", "0", trace=tmp_path / "one.trace")
    for r in (off, big, one):
        assert r.returncode == 0, r.stderr[-3000:]
    t = _cap_total(one.stderr)
    assert t["ubatches"] > 0 and t["rv"] == 1.0 and t["cap"] == 1.0
    assert t["loaded"] + t["overflow"] == t["missing"] and t["loaded"] <= t["ubatches"]
    assert t["overflow"] > 0 and t["rerouted"] > 0 and t["forced"] == 0
    # what the reroutes did: the SUB1 records (the experts the passes ran) show stand-ins on image rows only, each
    # in memory for its ubatch (resident before it, per the LRU of the experts that ran, or run by a pair that kept
    # its routed expert), and the computation changed: the routing of later layers and steps differs from off
    o, a = vtrace.read(tmp_path / "one.trace"), vtrace.read(tmp_path / "off.trace")
    moved = o.exec_ids != o.ids
    assert moved.any() and o.modality[moved.any(axis=1)].all()
    assert o.ids.shape != a.ids.shape or not np.array_equal(o.ids, a.ids) or \
        not np.array_equal(o.weights.view(np.uint32), a.weights.view(np.uint32))
    n_checked = 0
    for il in np.unique(o.layer):
        lt = o.for_layer(int(il))
        ubs = np.unique(lt.ubatch)
        ran = [list(dict.fromkeys(lt.exec_ids[lt.ubatch == u].reshape(-1).tolist())) for u in ubs]
        before: list[set[int]] = []
        lru_misses(ran, 4, resident_before=before)              # --moe-slots 4
        for u, res in zip(ubs, before):
            rows = lt.ubatch == u
            ex, ids = lt.exec_ids[rows], lt.ids[rows]
            kept = set(ex[ex == ids].tolist())
            for s in ex[ex != ids].tolist():
                assert s in res or s in kept, (int(il), int(u), s, sorted(res), sorted(kept))
                n_checked += 1
    assert n_checked == int(moved.sum())
    # a capacity above what any layer misses: nothing over it, the same text and routing as off
    b = _cap_total(big.stderr)
    assert b["overflow"] == 0 and b["rerouted"] == 0 and b["rv"] == 1.0 and b["cap"] == 96.0   # 64 * (1 + 0.5)
    assert big.stdout == off.stdout
    a, c = vtrace.read(tmp_path / "off.trace"), vtrace.read(tmp_path / "big.trace")
    assert np.array_equal(a.ids, c.ids) and np.array_equal(a.weights.view(np.uint32), c.weights.view(np.uint32))


def test_runtime_weights_are_pyvis_weights():
    rng = np.random.default_rng(3)
    embd = rng.standard_normal((37, 64)).astype(np.float32) * rng.uniform(0.1, 4.0, (37, 1)).astype(np.float32)
    for delta in (0.5, 1.0, 3.0):
        c = native.macs_weights(embd, delta)
        py = prune.macs_weights(embd, delta)
        assert np.allclose(c, py, rtol=0, atol=2e-6), np.abs(c - py).max()
    # pruning's entropy score is these weights, min-max normalised
    w = prune.macs_weights(embd)
    assert np.allclose(prune.entropy_scores(embd), (w - w.min()) / (w.max() - w.min()))
    with pytest.raises(VisError, match="embeddings must be"):
        native.macs_weights(np.zeros((3, 0), np.float32))


def test_modality_profile_and_errors(bindir, fixture_dir, tmp_path):
    tr = tmp_path / "cal.trace"
    assert _mtmd(bindir, fixture_dir, trace=tr).returncode == 0
    prof = tmp_path / "vl.modality.gguf"
    r = run([sys.executable, "-m", "pyvis", "calibrate", "modality", "--trace", tr, "-m",
             fixture_dir / "qwen3vlmoe.gguf", "--out", prof], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    ok = _mtmd(bindir, fixture_dir, "--moe-capacity", "2", "--moe-cap-profile", prof)
    assert ok.returncode == 0 and _cap_total(ok.stderr)["ubatches"] > 0, ok.stderr[-2000:]
    # another model's file, a model, and bad values
    bad = _mtmd(bindir, fixture_dir, "--moe-capacity", "2", "--moe-cap-profile", fixture_dir / "qwen3vlmoe.gguf")
    assert bad.returncode != 0 and "VIS_MOE_CAP_PROFILE=" in bad.stderr and "pyvis calibrate modality" in bad.stderr
    for extra, says in ((["--moe-capacity", "0"], "--moe-capacity: expected an integer in 1..65536 (or off, auto)"),
                        (["--moe-cap-rho", "5"], "--moe-cap-rho: expected a number in 0..4"),
                        (["--moe-cap-delta", "-1"], "--moe-cap-delta: expected a number in 0..16"),
                        (["--moe-cap-drop", "x"], "--moe-cap-drop: expected on or off")):
        r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "hi", "-n", "1", "-st",
                 "--moe-slots", "2", *extra], timeout=60)
        assert r.returncode != 0 and says in r.stdout + r.stderr, (extra, (r.stdout + r.stderr)[-1500:])
    with pytest.raises(VisError, match="--moe-cap-rho"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=2, capacity=2, cap_rho=9.0),
                 n_ctx=128, verbose=False)


def test_pyvis_chat_and_prepare_take_the_lossy_options(fixture_dir, tmp_path):
    """pyvis chat mirrors --moe-shadow / --moe-precision / --moe-capacity (with pruning at keep 0.5: the three
    together), and pyvis.vlm.Session takes them in its MoeConfig (the old sections for one release, with a
    DeprecationWarning: the same config)."""
    from pyvis import vlm
    from pyvis.runtime import shadow as sh
    from pyvis.runtime.config import MoeConfig, VisTypeError
    from pyvis.runtime.settings import CapacityParams, MoeParams, PrecisionParams
    model, mmproj, image = (fixture_dir / "qwen3vlmoe.gguf", fixture_dir / "qwen3vlmoe-mmproj.gguf",
                            fixture_dir / "test-image.png")
    shadow = sh.write_shadow(model, "Q4_0", tmp_path / "s.gguf", threads=2)["path"]
    r = run([sys.executable, "-m", "pyvis", "chat", "-m", model, "--mmproj", mmproj, "--image", image, "-p",
             "Describe the image.", "--keep-ratio", "0.5", "-n", "3", "--moe-slots", "4", "--moe-stats",
             "--moe-shadow", shadow, "--moe-precision", "vision", "--moe-capacity", "2", "--moe-prec-gate", "0.05"],
            timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "precision (--moe-precision vision, q4_0 shadows)" in r.stderr and _cap_total(r.stderr)["ubatches"] > 0
    r = run([sys.executable, "-m", "pyvis", "chat", "-m", model, "--mmproj", mmproj, "--image", image,
             "--moe-slots", "4", "--moe-prec-gate", "2"], timeout=60)
    # the C table's check, naming the field and the flag
    assert r.returncode == 1 and "error: MoeConfig prec_gate: --moe-prec-gate: expected a number in 0..1" in r.stderr
    config = vlm.MoeConfig(slots=4, shadow=str(shadow), precision="vision", capacity=3)
    with vlm.Session(model, mmproj, config, n_ctx=512, n_threads=2) as s:
        p = s.prepare("Describe the image.", [image], keep_ratio=1.0, method="none")
        st, ct = native.prec_stats(s.main.ptr), native.cap_stats(s.main.ptr)
        assert st["n_vision_ubatches"] > 0 and ct["n_ubatches"] > 0 and p.n_past > 0
    with pytest.warns(DeprecationWarning, match=r"Session\(\.\.\., moe=, precision=, capacity=\) is deprecated"):
        old = vlm.Session(model, mmproj, n_ctx=512, moe=MoeParams(slots=4), n_threads=2,
                          precision=PrecisionParams(str(shadow), "vision"), capacity=CapacityParams(3))
    with old:
        assert old.config == MoeConfig.of(MoeParams(slots=4), PrecisionParams(str(shadow), "vision"), CapacityParams(3))
        p = old.prepare("Describe the image.", [image], keep_ratio=1.0, method="none")
        assert native.prec_stats(old.main.ptr)["n_vision_ubatches"] > 0 and native.cap_stats(old.main.ptr)["n_ubatches"] > 0
    with pytest.raises(TypeError, match="not also as moe="):
        vlm.Session(model, mmproj, config, moe=MoeParams(slots=4))
    with pytest.raises(VisTypeError, match=r"config must be a pyvis.moe.MoeConfig, got MoeParams \(write MoeConfig.of"):
        vlm.Session(model, mmproj, MoeParams(slots=4))


def test_capacity_keeps_a_tight_image_ubatch_out_of_streaming(bindir, fixture_dir):
    """One slot per layer: the exact image ubatch needs more passes than --moe-stream-passes and streams the layer;
    with the capacity its experts are bounded (hits + at most round(N (1 + rho / 2)) loads), so the graph has
    1 + ceil(C / slots) passes and the layer is not streamed."""
    def go(*extra):
        r = run([bindir / "llama-mtmd-cli", "-m", fixture_dir / "qwen3vlmoe.gguf",
                 "--mmproj", fixture_dir / "qwen3vlmoe-mmproj.gguf", "--image", fixture_dir / "test-image.png",
                 "-p", "Describe the image.", "-n", "2", "--temp", "0", "-c", "512", "-t", "2", "--moe-slots", "1",
                 "--moe-stream-passes", "4", "--moe-stats", *extra], timeout=240)
        assert r.returncode == 0 and "plan bug" not in r.stderr, r.stderr[-3000:]
        return r.stderr
    def streamed(text):   # experts streamed (the prompt's text ubatches stream in both runs)
        m = re.search(r"prefill streaming: (\d+) experts", text)
        return int(m.group(1)) if m else 0
    exact = go()
    capped = go("--moe-capacity", "auto")
    t = _cap_total(capped)
    assert t["ubatches"] > 0 and t["cap"] == 2.0 and t["overflow"] > 0
    # the image ubatch's layers (16 experts each, most of them routed) no longer stream
    assert streamed(exact) - streamed(capped) >= 2 * 8, (streamed(exact), streamed(capped))
