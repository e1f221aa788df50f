"""Pruned multimodal evaluation (pyvis.vlm) on the qwen3vlmoe fixture (M-RoPE + deepstack).

* keep ratio 1 is byte-identical to upstream's mtmd_helper_eval_chunks (text + several images);
* kept tokens are decoded at their original (t, y, x, z) positions and the text after a pruned
  image continues at pos_0 + max(nx, ny), as the routing trace of the decode shows;
* the affinity probe's prefix routing equals the routing of the unpruned decode;
* bad input fails with a clear error.
"""
from __future__ import annotations

import numpy as np
import pytest

import pyvis.vlm as vlm
from pyvis.fixtures import mmproj as mm
from pyvis.runtime import trace as vtrace
from pyvis.vlm import prune

from llama_cpp import mtmd_cpp as M  # noqa: E402  (after pyvis configured the library paths)

PROMPT = "Describe the image."


@pytest.fixture(scope="module")
def files(fixture_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    big = mm.write_test_image(str(d / "big.png"), 160, 128, seed=3)       # 5 x 4 merged grid
    return {"model": fixture_dir / "qwen3vlmoe.gguf", "mmproj": fixture_dir / "qwen3vlmoe-mmproj.gguf",
            "img": fixture_dir / "test-image.png", "big": big, "dir": d}


@pytest.fixture(scope="module")
def session(files):
    s = vlm.Session(files["model"], files["mmproj"], n_ctx=512, n_threads=1)
    yield s
    s.close()


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("n_batch", [512, 5])
def test_keep_all_is_byte_identical_to_mtmd_helper(files, n_batch):
    prompt = f"First {M.mtmd_default_marker().decode()} then {M.mtmd_default_marker().decode()}: " \
             "what differs?"
    imgs = [files["img"], files["big"]]
    with vlm.Session(files["model"], files["mmproj"], n_ctx=512, n_batch=n_batch, n_threads=1) as s:
        ref, ref_past = s.eval_reference(prompt, imgs)
        for method in ("none", "affinity", "random"):
            p = s.prepare(prompt, imgs, keep_ratio=1.0, method=method)
            assert p.n_past == ref_past
            assert len(p.images) == 2 and p.n_image_kept == p.n_image_tokens
            assert np.array_equal(_bits(p.logits), _bits(ref)), method
        # and a pruned prompt is not (the check above can fail)
        p = s.prepare(prompt, imgs, keep_ratio=0.5, method="random")
        assert p.n_past == ref_past
        assert not np.array_equal(_bits(p.logits), _bits(ref))


def _expected_positions(pos_0, nx, idx):
    idx = np.asarray(idx)
    return np.stack([np.full(idx.size, pos_0), pos_0 + idx // nx, pos_0 + idx % nx, np.zeros(idx.size, int)])


def test_position_rules():
    # M-RoPE: the kept columns of the full layout, and the text continues after the full extent
    full = vlm.mrope_positions(10, 5, 20)
    assert np.array_equal(full, _expected_positions(10, 5, np.arange(20)))
    kept = np.array([1, 6, 19])
    assert vlm.kept_positions(full, kept, 10, True).tolist() == [[10, 10, 10], [10, 11, 13], [11, 11, 14], [0, 0, 0]]
    assert vlm.next_position(10, 5, 3, True) == 15
    # ordinary RoPE: renumbered contiguously, the text continues after the kept tokens
    flat = (10 + np.arange(20))[None, :]
    assert vlm.kept_positions(flat, kept, 10, False).tolist() == [[10, 11, 12]]
    assert vlm.next_position(10, 20, 3, False) == 13


@pytest.mark.parametrize("method", ["random", "saliency", "entropy", "affinity"])
def test_kept_tokens_keep_their_positions(files, tmp_path, method):
    tr = tmp_path / "decode.trace"
    with vlm.Session(files["model"], files["mmproj"], vlm.MoeConfig(trace=str(tr)), n_ctx=512, n_threads=1) as s:
        p = s.prepare(PROMPT, [files["big"]], keep_ratio=0.5, method=method, seed=5)
    im = p.images[0]
    assert (im.nx, im.ny, im.n_tokens) == (5, 4, 20) == (*mm.expected_image_tokens(160, 128), 20)
    assert im.n_kept == 10 and np.all(np.diff(im.kept) > 0)
    assert np.array_equal(im.positions, _expected_positions(im.pos_0, im.nx, im.kept))
    # what llama.cpp saw: layer 0 of the decode trace (without the native prefix probe's records)
    t = vlm.read_decode_trace(p, tr).for_layer(0)
    img = t.modality == 1
    assert img.sum() == im.n_kept
    assert set(t.pos[img].tolist()) == {im.pos_0}                     # section 0 (t) of every kept token
    after = np.flatnonzero(img)[-1] + 1
    assert t.pos[after] == im.pos_0 + max(im.nx, im.ny)               # text continues past the full extent
    assert p.n_past == t.pos.max() + 1


@pytest.mark.parametrize("probe", ["shadow", "native"])
@pytest.mark.parametrize("prefix_layers", [1, 2])
def test_affinity_probe_routing_matches_unpruned_decode(files, tmp_path, probe, prefix_layers):
    tr = tmp_path / "full.trace"
    prompt = f"{M.mtmd_default_marker().decode()} and {M.mtmd_default_marker().decode()}: " + PROMPT
    imgs = [files["img"], files["big"]]     # the second image's probe sees the first (pruned) image
    with vlm.Session(files["model"], files["mmproj"], vlm.MoeConfig(trace=str(tr)), n_ctx=512, n_threads=1) as s:
        s.prepare(prompt, imgs, method="none")
    full = vtrace.read(tr)
    with vlm.Session(files["model"], files["mmproj"], n_ctx=512, n_threads=1) as s:
        ref, _ = s.eval_reference(prompt, imgs)
        p = s.prepare(prompt, imgs, keep_ratio=0.5, method="affinity", alpha=0.1, keep_scores=True, probe=probe,
                      prefix_layers=prefix_layers)
        # the probe left no trace in the context: keep ratio 1 after it is still upstream, bit for bit
        q = s.prepare(prompt, imgs, keep_ratio=1.0, method="affinity", probe=probe)
        assert np.array_equal(_bits(q.logits), _bits(ref))
    # first image: same left context as the unpruned run -> identical prefix routing
    im = p.images[0]
    assert im.probe == probe and im.prefix_ids.shape == (prefix_layers, 12, 4)
    for l in range(prefix_layers):
        lt = full.for_layer(l)
        assert np.array_equal(im.prefix_ids[l], lt.ids[lt.modality == 1][:12])
    # the kept set is Algorithm 1 on the scores and prefix routing the session used
    for im in p.images:
        want = prune.affinity_select(im.scores["saliency"], prune.expert_masks(im.prefix_ids, 16), 0.5, 0.1, 2.0)
        assert im.kept.tolist() == want.tolist()
    assert p.images[1].prefix_ids.shape == (prefix_layers, 20, 4)


def test_native_probe_equals_shadow_probe(files):
    prompt = f"{M.mtmd_default_marker().decode()} and {M.mtmd_default_marker().decode()}: " + PROMPT
    imgs = [files["big"], files["img"]]
    out = {}
    for probe in ("shadow", "native"):
        with vlm.Session(files["model"], files["mmproj"], n_ctx=512, n_threads=1) as s:
            out[probe] = s.prepare(prompt, imgs, keep_ratio=0.5, method="affinity", probe=probe, prefix_layers=2)
    for a, b in zip(out["shadow"].images, out["native"].images):
        assert np.array_equal(a.prefix_ids, b.prefix_ids) and a.kept.tolist() == b.kept.tolist()
    assert np.array_equal(_bits(out["shadow"].logits), _bits(out["native"].logits))


def test_generate_continues_after_pruned_image(session, files):
    p = session.prepare(PROMPT, [files["big"]], keep_ratio=0.5, method="entropy")
    n0 = p.n_past
    p.generate(4)
    assert p.n_past == n0 + len(p.generated) and len(p.generated) >= 1
    q = vlm.prepare(session, PROMPT, [files["big"]], keep_ratio=0.5, method="entropy")
    assert np.array_equal(_bits(q.logits), _bits(p.logits))          # same prompt, same result
    assert q.images[0].kept.tolist() == p.images[0].kept.tolist()     # deterministic


def test_bad_input_errors(session, files, tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"this is not an image at all" * 10)
    with pytest.raises(vlm.VLMError, match="empty"):
        session.prepare(PROMPT, [empty])
    with pytest.raises(vlm.VLMError, match="not found"):
        session.prepare(PROMPT, [tmp_path / "missing.png"])
    with pytest.raises(vlm.VLMError, match="failed to load image"):
        session.prepare(PROMPT, [junk])
    for bad in (0.0, 1.5, -1):
        with pytest.raises(vlm.VLMError, match="keep ratio"):
            session.prepare(PROMPT, [files["img"]], keep_ratio=bad, method="random")
    with pytest.raises(vlm.VLMError, match="alpha"):
        session.prepare(PROMPT, [files["img"]], keep_ratio=0.2, alpha=0.5, method="affinity")
    with pytest.raises(vlm.VLMError, match="unknown pruning method"):
        session.prepare(PROMPT, [files["img"]], method="magic")
    with pytest.raises(vlm.VLMError, match="media markers"):
        session.prepare(f"{session.marker} {session.marker}", [files["img"]])
    huge = mm.write_test_image(str(tmp_path / "huge.png"), 448, 448, seed=1)     # 196 tokens
    with vlm.Session(files["model"], files["mmproj"], n_ctx=256, n_threads=1) as small:
        with pytest.raises(vlm.VLMError, match="raise the context size"):
            small.prepare(PROMPT, [huge, huge], keep_ratio=0.5, method="random")
        assert small.prepare(PROMPT, [huge], keep_ratio=0.5, method="random").n_image_kept == 98
    # the session still works after the errors
    assert session.prepare(PROMPT, [files["img"]]).n_image_tokens == 12


def test_model_without_vision_is_an_error(fixture_dir):
    # a text-only MoE model with the VL projector (n_embd mismatch), and a text GGUF as the projector
    with pytest.raises(vlm.VLMError, match="projector"):
        vlm.Session(fixture_dir / "qwen3moe.gguf", fixture_dir / "qwen3vlmoe-mmproj.gguf", n_ctx=128)
    with pytest.raises(vlm.VLMError, match="projector"):
        vlm.Session(fixture_dir / "qwen3vlmoe.gguf", fixture_dir / "qwen3moe.gguf", n_ctx=128)


def _cli(argv, capsys):
    from pyvis import cli
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_chat_cli(files, capsys):
    base = ["chat", "-m", files["model"], "--mmproj", files["mmproj"], "--image", files["img"], "-c", 512, "-t", 1]
    rc, out, err = _cli(base + ["--image", files["big"], "--keep-ratio", 0.5, "--prune-method", "affinity", "-n", 3,
                                "--moe-slots", 8, "--moe-pinned-layers", 1], capsys)
    assert rc == 0, err
    assert "image tokens: kept 16 of 32 (affinity, keep ratio 0.5)" in err
    assert "[image 0] 4x3 grid: kept 6/12" in err and "[image 1] 5x4 grid: kept 10/20" in err
    assert "expert cache (prefill): hit rate" in err and "prefill" in err
    rc, out, err = _cli(base + ["--keep-ratio", 1.5], capsys)
    assert rc == 1 and "keep ratio must be in (0, 1]" in err
    rc, out, err = _cli(["chat", "-m", files["model"], "--mmproj", files["mmproj"], "--image",
                         files["dir"] / "nope.png"], capsys)
    assert rc == 1 and "image not found" in err


def test_prune_report_cli(files, tmp_path, capsys):
    import json
    rc, out, err = _cli(["prune-report", "-m", files["model"], "--mmproj", files["mmproj"], "--image", files["big"],
                         "--methods", "random", "affinity", "--keep-ratio", 0.5, "--moe-slots", 8,
                         "--moe-pinned-layers", 1, "-c", 512, "-t", 1, "-o", tmp_path, "--name", "fx"], capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "fx.json").read_text())["results"]
    assert [(r["method"], r["keep_ratio"], r["n_image_kept"]) for r in res] == \
        [("none", 1.0, 20), ("random", 0.5, 10), ("affinity", 0.5, 10)]
    for r in res:
        assert r["image"]["n_tokens"] == r["n_image_kept"]
        assert all(1 <= d <= 16 for d in r["image"]["distinct"])
        assert 0 < r["cache"]["hit_rate"] < 1 and r["cache"]["n_hits"] + r["cache"]["n_misses"] == r["cache"]["n_routed"]
    assert res[2]["timings_ms"]["probe"] > 0 and res[1]["timings_ms"]["probe"] == 0
    assert (tmp_path / "fx-affinity-0.5.png").read_bytes()[:4] == b"\x89PNG"
    assert "affinity a=0.1  0.50   10/20" in out
    assert res[0]["kl"] == 0.0 and res[1]["kl"] > 0 and 0 < res[2]["saliency_mass"] <= 1


def test_prune_eval_harness(files, tmp_path, capsys):
    import json
    from pyvis.vlm import evaluate as pe
    d = tmp_path / "ds"
    d.mkdir()
    rows = [{"image": str(files["img"]), "question": "What is shown?", "answer": "placeholder"},
            {"image": [str(files["big"]), str(files["img"])], "question": "Compare.", "answer": ["x", "y"]}]
    (d / "items.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["prune-eval", "-m", files["model"], "--mmproj", files["mmproj"], "--items", d, "--methods", "affinity",
            "--keep-ratio", 0.5, "-n", 3, "-c", 512, "-t", 1, "--json", tmp_path / "r.json"]
    rc, out, err = _cli(argv, capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["method"], r["keep_ratio"], r["n"]) for r in res] == [("none", 1.0, 2), ("affinity", 0.5, 2)]
    assert res[0]["kept_mean"] == 22.0 and res[1]["kept_mean"] == 11.0     # (12 + 20 + 12 tokens) / 2 items
    # make the unpruned run's own answers the ground truth: it must then score 1.0 (the scorer works)
    for r, it in zip(rows, res[0]["items"]):
        r["answer"] = it["prediction"].upper() + "."
    (d / "items.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc, out, err = _cli(argv, capsys)
    res = json.loads((tmp_path / "r.json").read_text())["results"]
    assert res[0]["accuracy"] == 1.0 and res[0]["correct"] == 2
    assert "none       1.00    1.000    2/2" in out
    assert pe.is_match("The cat", ["the cat."]) and not pe.is_match("cats", ["cat"])
    assert pe.is_match("cat, sitting", ["cat"], "prefix") and not pe.is_match("cats", ["cat"], "prefix")
    (d / "items.jsonl").write_text('{"image": "nope.png", "question": "q", "answer": "a"}\n')
    rc, out, err = _cli(argv, capsys)
    assert rc == 1 and "image not found" in err


def test_session_on_a_loaded_llama(files):
    from pyvis import moe
    llm = moe.load(str(files["model"]), moe.MoeConfig(slots=8, pinned_layers=1), n_ctx=512, n_threads=1, verbose=False)
    s = vlm.Session(llm, files["mmproj"])
    assert s.n_ctx == 512 and s.config is not None
    ref, _ = s.eval_reference(PROMPT, [files["big"]])
    p = vlm.prepare(s, PROMPT, [files["big"]], keep_ratio=1.0, method="affinity")
    assert np.array_equal(_bits(p.logits), _bits(ref))
    p = s.prepare(PROMPT, [files["big"]], keep_ratio=0.5, method="affinity")
    assert p.n_image_kept == 10 and p.moe_stats is not None and p.moe_stats.n_routed > 0
    s.close()                                  # leaves the Llama usable
    assert llm.n_ctx() == 512 and llm.tokenize(b"hi")
    del llm
