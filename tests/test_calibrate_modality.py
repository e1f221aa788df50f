"""`pyvis calibrate modality` (issue #14 item 3): image / text routing per expert, the visual share, the labels and
the modality profile (docs/modality.md), on hand-written traces and on a real llama-mtmd-cli trace of the VLM
fixture."""
from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest

from conftest import run
from pyvis.calibrate import modality as M
from pyvis.cli import main
from pyvis.fixtures import mmproj as mm
from pyvis.runtime import modality_profile as mp
from pyvis.runtime import profile as prof
from pyvis.runtime import trace as vtrace
from test_substitution_profile import router, tiny_model, trace_bytes

IMG, TXT = 1, 0


# --------------------------------------------------------------------------
# a trace written by hand: 2 layers x 4 experts, top-2
# --------------------------------------------------------------------------
def hand_trace(path):
    """Layer 0: an image ubatch of 4 tokens and a text ubatch of 2 (one without gate weights); layer 1 (like the
    last layer of a real run) sees only one text row."""
    recs = [("REC1", 0, 0, [[0, 1], [0, 1], [0, 2], [0, 1]], [[3, 1], [1, 1], [1, 3], [1, 0]], IMG),
            ("REC1", 1, 0, [[2, 3], [1, 3]], [[1, 1], [0, 0]], TXT),
            ("REC1", 1, 1, [[0, 1]], [[0.6, 0.2]], TXT)]
    path.write_bytes(trace_bytes(2, 4, 2, recs))
    return path


def test_counts_shares_and_labels_by_hand(tmp_path):
    t = vtrace.read(hand_trace(tmp_path / "h.trace"))
    f = M.label(M.count([t], 2, 4))
    # layer 0, image rows, normalised weights: [.75 .25] [.5 .5] [.25 .75] [1 0]
    assert f.image_pairs[0].tolist() == [4, 3, 1, 0] and f.text_pairs[0].tolist() == [0, 1, 1, 2]
    assert np.allclose(f.image_mass[0], [2.5, 0.75, 0.75, 0])
    assert np.allclose(f.text_mass[0], [0, 0.5, 0.5, 1.0])        # the row without weights: 1/2 each
    assert f.image_rows.tolist() == [4, 0] and f.text_rows.tolist() == [2, 1]
    assert (f.n_image_tokens, f.n_text_tokens, f.n_unweighted, f.k) == (4, 2, 1, 2)
    # a_I = [.625 .1875 .1875 0], a_T = [0 .25 .25 .5]
    assert np.allclose(f.visual_share[0], [1, 3 / 7, 3 / 7, 0])
    assert np.isnan(f.visual_share[1]).all()                      # layer 1 has no image rows
    lab = [[mp.LABELS[x] for x in row] for row in f.label]
    assert lab == [["visual", "shared", "shared", "text"], ["unknown", "unknown", "unused", "unused"]]
    # the equivalent form: raw image share s normalised by the image share pi of the layer's rows
    s = f.image_mass[0] / (f.image_mass[0] + f.text_mass[0])
    pi = 4 / 6
    assert np.allclose(f.visual_share[0], (s / pi) / (s / pi + (1 - s) / (1 - pi)))
    # thresholds are inclusive and move the shared experts
    f = M.label(f, visual_min=0.9, text_max=3 / 7)
    assert [mp.LABELS[x] for x in f.label[0]] == ["visual", "text", "text", "text"]
    f = M.label(f, visual_min=1.0, text_max=0.0)                  # v = 1 and v = 0 sit on the bounds
    assert [mp.LABELS[x] for x in f.label[0]] == ["visual", "shared", "shared", "text"]


def test_an_expert_used_in_proportion_to_the_data_has_v_one_half():
    """Three times as many image tokens as text tokens, the same routing: v = 0.5 exactly (the raw share is 0.75)."""
    ids = np.tile(np.arange(4), 30)[:, None]
    recs = [("REC1", 0, 0, ids, np.ones((120, 1)), IMG), ("REC1", 1, 0, ids[:40], np.full((40, 1), 7.0), TXT)]
    f = M.label(M.count([vtrace.parse(trace_bytes(1, 5, 1, recs))], 1, 5))
    assert np.allclose(f.image_mass[0, :4] / (f.image_mass[0, :4] + f.text_mass[0, :4]), 0.75)
    assert np.allclose(f.visual_share[0, :4], 0.5) and np.isnan(f.visual_share[0, 4])
    assert [mp.LABELS[x] for x in f.label[0]] == ["shared"] * 4 + ["unused"]
    # 5 more image tokens, all to expert 4: it becomes visual (v = 1), the others' image share drops to 120 / 125
    recs.append(("REC1", 2, 0, [[4]] * 5, np.ones((5, 1)), IMG))
    f = M.label(M.count([vtrace.parse(trace_bytes(1, 5, 1, recs))], 1, 5))
    a_i, a_t = np.array([30, 30, 30, 30, 5]) / 125, np.array([10, 10, 10, 10, 0]) / 40
    assert np.allclose(f.visual_share[0], a_i / (a_i + a_t)) and f.visual_share[0, 4] == 1
    assert [mp.LABELS[x] for x in f.label[0]] == ["shared"] * 4 + ["visual"]
    assert f.n_image_tokens == 125 and f.n_text_tokens == 40


# --------------------------------------------------------------------------
# the CLI on hand-written traces, the profile
# --------------------------------------------------------------------------
@pytest.fixture
def model(tmp_path):
    """A fingerprint-only GGUF of 2 layers x 4 experts, top-2."""
    return tiny_model(tmp_path / "m.gguf", {0: router(seed=1), 1: router(seed=2)})


def test_cli_end_to_end_and_profile_round_trip(tmp_path, model, capsys):
    tr = hand_trace(tmp_path / "h.trace")
    out, js, png = tmp_path / "m.modality.gguf", tmp_path / "m.json", tmp_path / "m.png"
    rc = main(["calibrate", "modality", "-m", str(model), "--trace", str(tr), "--out", str(out), "--json", str(js),
               "--plot", str(png), "--visual-min", "0.75", "--text-max", "0.25"])
    o = capsys.readouterr()
    assert rc == 0, o.err
    assert "reading [" in o.err and "modality [" in o.err                  # the progress bars
    assert re.search(r"^\s+0\s+4\s+2\s+1\s+2\s+1\s+0\s+0\s", o.out, re.M), o.out   # layer 0: 1 visual 2 shared 1 text
    assert re.search(r"^\s+1\s+0\s+1\s+0\s+0\s+0\s+2\s+2\s", o.out, re.M), o.out   # layer 1: 2 unused 2 unknown
    assert "4 image tokens, 2 text tokens" in o.out and f"wrote {out}" in o.out
    p = mp.load_modality_profile(out, model)
    fp = prof.model_fingerprint(model)
    assert (p.arch, p.n_layer, p.n_expert, p.router_hash, p.k) == ("qwen3moe", 2, 4, fp["router_hash"], 2)
    assert (p.n_image_tokens, p.n_text_tokens, p.n_tokens) == (4, 2, 6)
    assert (p.visual_min, p.text_max) == (0.75, 0.25)
    assert p.source.startswith(f"traces {tr} sha256:")
    assert p.image_pairs.tolist() == [[4, 3, 1, 0], [0, 0, 0, 0]]
    assert p.text_pairs.tolist() == [[0, 1, 1, 2], [1, 1, 0, 0]]
    assert np.allclose(p.image_mass[0], [2.5, 0.75, 0.75, 0]) and p.image_rows.tolist() == [4, 0]
    assert np.allclose(p.visual_share[0], [1, 3 / 7, 3 / 7, 0]) and np.isnan(p.visual_share[1]).all()
    assert p.experts("visual", 0) == [0] and p.experts("shared", 0) == [1, 2] and p.experts("unused", 1) == [2, 3]
    # the documented layout: kind, version, numpy shapes [n_layer, n_expert] (GGUF ne reversed), types
    r = gguf.GGUFReader(str(out))
    assert r.fields["vis.profile.kind"].contents() == "modality" and r.fields["vis.profile.version"].contents() == 1
    assert r.fields["general.architecture"].contents() == "vis-profile"
    ts = {t.name: t for t in r.tensors}
    assert ts["modality.image_mass"].shape.tolist() == [4, 2]
    assert ts["modality.label"].tensor_type == gguf.GGMLQuantizationType.I32
    assert ts["modality.image_rows"].shape.tolist() == [2]
    j = json.loads(js.read_text())
    assert j["label"][0] == ["visual", "shared", "shared", "text"] and j["visual_share"][1] == [None] * 4
    assert j["totals"] == {"unused": 2, "text": 1, "shared": 2, "visual": 1, "unknown": 2}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # without -m: the same report, no profile
    assert main(["calibrate", "modality", "--trace", str(tr)]) == 0
    assert "1 visual" in capsys.readouterr().out


def test_profile_of_another_model_and_bad_files(tmp_path, model):
    t = vtrace.read(hand_trace(tmp_path / "h.trace"))
    f = M.label(M.count([t], 2, 4))
    fp = prof.model_fingerprint(model)
    out = mp.write_modality_profile(tmp_path / "p.gguf", fp, f.arrays(), 0.7, 0.3, 4, 2, 2, "test", model_path=model)
    other = tiny_model(tmp_path / "o.gguf", {0: router(seed=1), 1: router(seed=3)})
    with pytest.raises(prof.ProfileError, match=r"for another model .*router_hash.*pyvis calibrate modality"):
        mp.load_modality_profile(out, other)
    with pytest.raises(prof.ProfileError, match="not a GGUF file, or truncated|truncated GGUF"):
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(out.read_bytes()[:-64])
        mp.load_modality_profile(cut)
    with pytest.raises(prof.ProfileError, match="not a vis profile"):
        mp.load_modality_profile(model)
    with pytest.raises(prof.ProfileError, match="not found"):
        mp.load_modality_profile(tmp_path / "missing.gguf")
    bd = prof.write_buddy_profile(tmp_path / "b.gguf", fp, np.full((2, 4, 1), -1), np.zeros((2, 4, 1)),
                                  np.zeros((2, 101)), 0.9, 1, 2, 6, "test")
    with pytest.raises(prof.ProfileError, match="a 'buddies' profile, not a 'modality' one"):
        mp.load_modality_profile(bd)
    # another version, inconsistent labels, bad thresholds: each named, with the fix
    w = prof.start_profile(tmp_path / "v2.gguf", fp, "modality", 2, 2, 6, "test")
    prof.finish_profile(w, tmp_path / "v2.gguf")
    with pytest.raises(prof.ProfileError, match="version 2 is not supported"):
        mp.load_modality_profile(tmp_path / "v2.gguf")
    bad = f.arrays() | {"label": np.where(f.label == mp.UNUSED, mp.SHARED, f.label)}
    with pytest.raises(prof.ProfileError, match=r"label\[1, 2\] = shared but the expert has 0 routed pairs"):
        mp.write_modality_profile(tmp_path / "bad.gguf", fp, bad, 0.7, 0.3, 4, 2, 2, "test")
    with pytest.raises(prof.ProfileError, match="must be below"):
        mp.write_modality_profile(tmp_path / "bad.gguf", fp, f.arrays(), 0.3, 0.7, 4, 2, 2, "test")
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.gguf.part").exists()


def _err(capsys, argv) -> tuple[int, str]:
    rc = main(["calibrate", "modality", *map(str, argv)])
    return rc, capsys.readouterr().err


def test_cli_errors(tmp_path, model, capsys):
    tr = hand_trace(tmp_path / "h.trace")
    before = model.read_bytes()
    # thresholds: unparsable or out of range -> argparse (2); contradictory -> 1
    for flag, v in (("--visual-min", "1.5"), ("--text-max", "nan"), ("--visual-min", "0.7x"), ("--text-max", "-0.1")):
        with pytest.raises(SystemExit) as e:
            main(["calibrate", "modality", "--trace", str(tr), flag, v])
        assert e.value.code == 2
        assert f"argument {flag}: '{v}' is not a number in [0, 1]" in capsys.readouterr().err
    rc, err = _err(capsys, ["--trace", tr, "--visual-min", "0.4", "--text-max", "0.4"])
    assert rc == 1 and "--text-max 0.4 must be below --visual-min 0.4" in err
    # inputs: missing, truncated, foreign
    rc, err = _err(capsys, ["--trace", tmp_path / "none.trace"])
    assert rc == 1 and "trace not found" in err
    cut = tmp_path / "cut.trace"
    cut.write_bytes(tr.read_bytes()[:-3])
    rc, err = _err(capsys, ["--trace", cut])
    assert rc == 1 and "truncated record" in err
    rc, err = _err(capsys, ["--trace", model])
    assert rc == 1 and "not a routing trace" in err
    # no image tokens; no text tokens
    text_only = tmp_path / "t.trace"
    text_only.write_bytes(trace_bytes(2, 4, 2, [("REC1", 0, 0, [[0, 1]], [[1, 1]], TXT)]))
    rc, err = _err(capsys, ["--trace", text_only])
    assert rc == 1 and "no image tokens" in err and "run an image prompt through llama-mtmd-cli with --moe-trace" in err
    img_only = tmp_path / "i.trace"
    img_only.write_bytes(trace_bytes(2, 4, 2, [("REC1", 0, 0, [[0, 1]], [[1, 1]], IMG)]))
    rc, err = _err(capsys, ["--trace", img_only])
    assert rc == 1 and "no text tokens" in err
    # traces of another model: other expert count, other layer count; two traces that disagree
    e8 = tmp_path / "e8.trace"
    e8.write_bytes(trace_bytes(2, 8, 2, [("REC1", 0, 0, [[0, 5]], [[1, 1]], IMG)]))
    rc, err = _err(capsys, ["-m", model, "--trace", e8])
    assert rc == 1 and "8 experts per layer, the model has 4: a trace of another model" in err
    l3 = tmp_path / "l3.trace"
    l3.write_bytes(trace_bytes(3, 4, 2, [("REC1", 0, 0, [[0, 1]], [[1, 1]], IMG)]))
    rc, err = _err(capsys, ["-m", model, "--trace", l3])
    assert rc == 1 and "traced a model of 3 layers" in err and "a trace of another model" in err
    rc, err = _err(capsys, ["--trace", tr, "--trace", e8])
    assert rc == 1 and "traces of different models" in err
    # outputs: --out needs -m; never over the model, a trace or a non-profile file
    rc, err = _err(capsys, ["--trace", tr, "--out", tmp_path / "p.gguf"])
    assert rc == 1 and "--out needs -m MODEL" in err
    rc, err = _err(capsys, ["-m", model, "--trace", tr, "--out", model])
    assert rc == 1 and "refusing to overwrite an input" in err
    rc, err = _err(capsys, ["--trace", tr, "--json", tr])
    assert rc == 1 and "--json" in err and "refusing to overwrite an input" in err
    note = tmp_path / "notes.txt"
    note.write_text("keep me")
    rc, err = _err(capsys, ["-m", model, "--trace", tr, "--out", note])
    assert rc == 1 and "is not a vis profile" in err and note.read_text() == "keep me"
    assert model.read_bytes() == before and tr.read_bytes() == hand_trace(tmp_path / "again.trace").read_bytes()


def test_cli_exit_codes_in_a_process(tmp_path, bindir):
    """No traceback from the command: error exit 1, argparse exit 2."""
    import sys
    tr = hand_trace(tmp_path / "h.trace")
    r = run([sys.executable, "-m", "pyvis", "calibrate", "modality", "--trace", tmp_path / "none.trace"], timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "error: trace not found" in r.stderr
    r = run([sys.executable, "-m", "pyvis", "calibrate", "modality", "--trace", tr, "--text-max", "2"], timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr


# --------------------------------------------------------------------------
# a real trace: an image prompt through llama-mtmd-cli on the VLM fixture
# --------------------------------------------------------------------------
def test_real_image_trace_of_the_vlm_fixture(bindir, fixture_dir, tmp_path, capsys):
    model, tr = fixture_dir / "qwen3vlmoe.gguf", tmp_path / "mm.trace"
    r = run([bindir / "llama-mtmd-cli", "-m", model, "--mmproj", fixture_dir / "qwen3vlmoe-mmproj.gguf",
             "--image", fixture_dir / "test-image.png", "-p", "Describe the image.", "-n", "8", "--temp", "0",
             "-c", "512", "-t", "2", "--moe-trace", tr], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out, js = tmp_path / "vl.modality.gguf", tmp_path / "vl.json"
    rc = main(["calibrate", "modality", "-m", str(model), "--trace", str(tr), "--out", str(out), "--json", str(js)])
    o = capsys.readouterr()
    assert rc == 0, o.err
    p = mp.load_modality_profile(out, model)
    t = vtrace.read(tr)
    nx, ny = mm.expected_image_tokens(64, 48)
    assert (p.n_layer, p.n_expert, p.k) == (3, 16, 4) and p.n_image_tokens == nx * ny
    assert p.image_rows.tolist() == [nx * ny, nx * ny, 0]          # the last layer computes output (text) rows only
    n_text = int((t.for_layer(0).modality == 0).sum())
    assert p.n_text_tokens == n_text > 0 and p.text_rows[:2].tolist() == [n_text] * 2
    for il in range(3):                                            # counted independently of the bincounts
        lt = t.for_layer(il)
        for mod, pairs in ((1, p.image_pairs), (0, p.text_pairs)):
            ref = np.zeros(16, np.int64)
            np.add.at(ref, lt.ids[lt.modality == mod].ravel(), 1)
            assert pairs[il].tolist() == ref.tolist(), (il, mod)
    assert np.allclose(p.image_mass.sum(1), p.image_rows, atol=1e-3)
    assert np.allclose(p.text_mass.sum(1), p.text_rows, atol=1e-3)
    assert (p.label[2][p.text_pairs[2] > 0] == mp.UNKNOWN).all()
    v = p.visual_share[:2]
    lab = p.label[:2]
    assert ((v >= 0.7) == (lab == mp.VISUAL)).all() and ((v <= 0.3) == (lab == mp.TEXT)).all()
    assert (lab[(p.image_pairs[:2] + p.text_pairs[:2]) == 0] == mp.UNUSED).all()
    j = json.loads(js.read_text())
    assert [x["image_rows"] for x in j["layers"]] == [nx * ny, nx * ny, 0]
    assert f"{nx * ny} image tokens, {n_text} text tokens" in o.out
