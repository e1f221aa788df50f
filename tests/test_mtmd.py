"""The vision fixture end to end through libmtmd (llama-mtmd-cli): image -> projector -> MoE LM.

The routing trace shows the image tokens inside the language model: their
modality flag, their count (the merged patch grid) and their M-RoPE positions.
"""
from __future__ import annotations

import numpy as np

from pyvis.fixtures import mmproj as mm
from pyvis.runtime import trace as vtrace
from pyvis import fixtures as fx
from conftest import run


def _mtmd(bindir, fixture_dir, image, *extra, timeout=180):
    return run([bindir / "llama-mtmd-cli", "-m", fixture_dir / "qwen3vlmoe.gguf",
                "--mmproj", fixture_dir / "qwen3vlmoe-mmproj.gguf", "--image", image,
                "-p", "Describe the image.", "-n", "8", "--temp", "0", "-c", "512", "-t", "2", *extra], timeout=timeout)


def test_image_prompt_runs_through_the_moe_model(bindir, fixture_dir, tmp_path):
    tr = tmp_path / "mm.trace"
    r = _mtmd(bindir, fixture_dir, fixture_dir / "test-image.png", "--moe-trace", tr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mtmd batch encoding done" in r.stderr
    t = vtrace.read(tr)
    nx, ny = mm.expected_image_tokens(64, 48)
    spec = fx.FIXTURES["qwen3vlmoe"]()
    for il in range(spec.n_layer - 1):   # the last layer only sees output rows
        lt = t.for_layer(il)
        img = lt.modality == 1
        assert img.sum() == nx * ny, (il, img.sum())
        # M-RoPE: every image token shares the temporal position of the image start ...
        p_img = np.unique(lt.pos[img])
        assert len(p_img) == 1
        # ... and the text after the image continues at start + max(nx, ny)
        after = lt.pos[np.where(img)[0][-1] + 1]
        assert after == p_img[0] + max(nx, ny)


def test_expert_cache_is_exact_with_images(bindir, fixture_dir, tmp_path):
    spec = fx.FIXTURES["qwen3vlmoe"]()
    outs, traces = [], []
    for extra in ([], ["--moe-slots", str(spec.n_expert_used), "--moe-stats"]):
        tr = tmp_path / f"t{len(extra)}.trace"
        r = _mtmd(bindir, fixture_dir, fixture_dir / "test-image.png", "--moe-trace", tr, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout)
        traces.append(vtrace.read(tr))
    assert outs[0] == outs[1]
    a, b = traces
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights.view(np.uint32), b.weights.view(np.uint32))
    assert "vis-moe: expert cache stats" in r.stderr


def test_bad_image_is_a_clear_error(bindir, fixture_dir, tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    r = _mtmd(bindir, fixture_dir, empty, timeout=60)
    assert r.returncode == 1
    assert "failed to decode" in r.stderr or "failed to load image" in r.stderr
    r = _mtmd(bindir, fixture_dir, tmp_path / "missing.png", timeout=60)
    assert r.returncode != 0 and r.returncode < 128  # an error exit, not a crash
