"""Shadow experts (issue #14 item 1, docs/shadow.md): `pyvis shadow` and `--moe-shadow`.

- the sidecar's tensors dequantise (through ggml) to within the type's error of the model's experts;
- they are exactly what ggml_quantize_chunk gives for the same rows (the writer quantises nothing itself);
- writing twice gives identical bytes, whatever the thread count;
- wrong model, truncated, not a GGUF, a predictor profile given as a shadow, an imatrix type, rows that do not fit
  the type's blocks, --out = the model: each a clear error (Python writer/reader, llama-cli, pyvis.moe.load);
- --moe-shadow through llama-cli and pyvis.moe.load: loads, logs one line, output byte-identical (not used yet).
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from pyvis.runtime import ggml_quant as gq
from pyvis import moe
from pyvis.runtime import predict_profile as pp
from pyvis.runtime import profile as vprof
from pyvis.runtime import shadow as sh
from pyvis.runtime.native import VisError
from conftest import greedy_logits, run

PYVIS = [sys.executable, "-m", "pyvis"]
PROMPT = "A low-bit copy of every expert waits in the shadows."
FIX = "pyvis shadow MODEL --type TYPE --out FILE"
NOT_USED = "validated; --moe-precision is off, so no miss runs from them"
# relative RMS error of the shadow against the model's (dequantised) experts, Gaussian-like weights
MAX_REL_RMS = {"Q4_0": 0.12, "Q8_0": 0.01, "Q5_1": 0.06}


def _rel_rms(a, b):
    return float(np.sqrt(((a - b) ** 2).mean()) / np.sqrt((b ** 2).mean()))


@pytest.fixture(scope="module")
def qwen_q4(fixture_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("shadow") / "qwen3moe.shadow-Q4_0.gguf"
    sh.write_shadow(fixture_dir / "qwen3moe.gguf", "Q4_0", out, threads=2)
    return out


def _model_tensors(model):
    return {t.name: t for _, t in sh.expert_tensors(vprof.model_readers(model))}


@pytest.mark.parametrize("name, typ", [("qwen3moe", "Q4_0"), ("deepseek2", "Q8_0"), ("gptoss", "Q5_1")])
def test_shadow_is_close_and_is_ggml_quantize_chunk(fixture_dir, tmp_path, name, typ):
    model = fixture_dir / f"{name}.gguf"
    out = tmp_path / "s.gguf"
    res = sh.write_shadow(model, typ, out, threads=2)
    sf = sh.read_shadow(out, model)
    mts = _model_tensors(model)
    assert set(sf.tensors) == set(mts) and res["tensors"] == len(mts)
    assert sf.type == typ and sf.layers == sorted({int(n.split(".")[1]) for n in mts})
    assert res["shadow_bytes"] == sf.shadow_bytes < res["model_bytes"] == sf.model_bytes or typ == "Q8_0"
    for tname, mt in mts.items():
        ne0, ne1, n_exp = (int(x) for x in mt.shape[:3])
        src = gq.type_of(mt.tensor_type.name)
        orig = gq.dequantize(src, np.asarray(mt.data), ne0)                  # [n_exp * ne1, ne0]
        assert sf.tensors[tname][0] == src.name and sf.tensors[tname][1][:3] == (ne0, ne1, n_exp)
        shadow = sh.dequantized(sf, tname).reshape(-1, ne0)
        assert _rel_rms(shadow, orig) < MAX_REL_RMS[typ], tname
        # exactly ggml_quantize_chunk of the same rows, all experts at once
        want = gq.quantize(gq.type_of(typ), orig)
        got = np.asarray(sf.tensors[tname][2].data).reshape(want.shape)
        assert np.array_equal(got, want), tname


def test_quantize_is_ggml_and_shadow_error_is_the_types(fixture_dir):
    """The Python helpers call ggml: Q4_0 of rows with one value per block at +-8 steps is exact; the error grows
    from Q8_0 to Q4_0 to Q2_K on the same rows."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((16, 256)).astype(np.float32)
    errs = {t: _rel_rms(gq.dequantize(gq.type_of(t), gq.quantize(gq.type_of(t), rows), 256), rows)
            for t in ("Q8_0", "Q4_0", "Q3_K", "Q2_K")}
    assert errs["Q8_0"] < 0.01 < errs["Q4_0"] < errs["Q3_K"] < errs["Q2_K"] < 0.5, errs
    assert gq.quantize(gq.type_of("Q2_K"), rows).shape == (16, gq.row_bytes(gq.type_of("Q2_K"), 256))


def test_deterministic(fixture_dir, tmp_path, qwen_q4):
    again = tmp_path / "again.gguf"
    sh.write_shadow(fixture_dir / "qwen3moe.gguf", "Q4_0", again, threads=1)
    assert again.read_bytes() == qwen_q4.read_bytes()


def test_layers(fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    res = sh.write_shadow(model, "Q4_0", tmp_path / "m.gguf", layers="managed", pinned=1)
    assert res["layers"] == [1, 2]
    assert sh.write_shadow(model, "Q4_0", tmp_path / "r.gguf", layers="1..1")["layers"] == [1]
    for spec, says in (("3..9", "expected N <= M < 3"), ("2..1", "expected N <= M"), ("some", "expected all, managed")):
        with pytest.raises(sh.ShadowError, match=says):
            sh.write_shadow(model, "Q4_0", tmp_path / "x.gguf", layers=spec)


def test_writer_errors(fixture_dir, tmp_path, qwen_q4):
    model = fixture_dir / "qwen3moe.gguf"
    with pytest.raises(gq.QuantError, match="IQ2_XXS: ggml needs an importance matrix"):
        sh.write_shadow(model, "IQ2_XXS", tmp_path / "a.gguf")
    with pytest.raises(gq.QuantError, match="--type F16: not a type ggml quantises to"):
        sh.write_shadow(model, "F16", tmp_path / "a.gguf")
    with pytest.raises(gq.QuantError, match="unknown ggml type 'Q9_9'"):
        sh.write_shadow(model, "Q9_9", tmp_path / "a.gguf")
    # qwen3moe's rows are 64 and 32 wide: not multiples of Q2_K's 256
    with pytest.raises(sh.ShadowError, match=r"blk\.0\.ffn_gate_exps\.weight: rows of 64 values do not fit Q2_K blocks "
                                             r"of 256"):
        sh.write_shadow(model, "Q2_K", tmp_path / "a.gguf")
    before = model.read_bytes()
    with pytest.raises(vprof.ProfileError, match="refusing to write the profile over the model itself"):
        sh.write_shadow(model, "Q4_0", model)
    other = tmp_path / "notes.txt"
    other.write_text("keep me\n")
    with pytest.raises(vprof.ProfileError, match="it exists and is not a vis profile"):
        sh.write_shadow(model, "Q4_0", other)
    assert model.read_bytes() == before and other.read_text() == "keep me\n"
    assert not list(tmp_path.glob("*.part"))
    # through the command line: exit 1 and the message
    r = run([*PYVIS, "shadow", model, "--type", "IQ1_S", "--out", tmp_path / "b.gguf"], timeout=120)
    assert r.returncode == 1 and "error: --type IQ1_S: ggml needs an importance matrix" in r.stderr, r.stderr
    r = run([*PYVIS, "shadow", model, "--type", "Q4_0", "--out", model], timeout=120)
    assert r.returncode == 1 and "over the model itself" in r.stderr, r.stderr
    r = run([*PYVIS, "shadow", model, "--type", "Q4_0", "-t", "0"], timeout=120)
    assert r.returncode == 2 and "invalid _threads value" in r.stderr, r.stderr


def test_cli_writes_and_reports(fixture_dir, tmp_path):
    out = tmp_path / "cli.gguf"
    r = run([*PYVIS, "shadow", fixture_dir / "mixtral.gguf", "--type", "Q4_0", "--out", out, "-t", "2"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"shadow: {out}: Q4_0" in r.stdout and "ratio 0.5" in r.stdout and "shadow [" in r.stderr


def _bad_sidecars(fixture_dir, tmp_path, good):
    """(path, what the error says) for each kind of bad shadow sidecar, for the qwen3moe fixture."""
    other = sh.write_shadow(fixture_dir / "mixtral.gguf", "Q4_0", tmp_path / "mixtral.shadow.gguf")["path"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    txt = tmp_path / "notes.txt"
    txt.write_text("not a shadow\n")
    part = sh.write_shadow(fixture_dir / "qwen3moe.gguf", "Q4_0", tmp_path / "part.gguf", layers="1..2")["path"]
    fp = vprof.model_fingerprint(fixture_dir / "qwen3moe.gguf")
    L, E = fp["n_layer"], fp["n_expert"]
    pred = pp.write_predictor_profile(tmp_path / "pred.gguf", fp, np.full((L, E), 8 / E), np.full((1, L, E, E), 1 / E),
                                      8, 10, "t")
    return [
        (other, "was made for another model (architecture llama, this model is qwen3moe)"),
        (cut, "ends at byte"), (cut, "past the end of the file"),
        (txt, "cannot read it as GGUF: not a GGUF file"),
        (fixture_dir / "deepseek2.gguf", "missing key vis.profile.kind"),
        (pred, "is a 'predictor' profile, not a 'shadow' one (it goes to --moe-predict-profile)"),
        (part, "has no tensor blk.0.ffn_gate_exps.weight: layer 0 is managed here"),
        (tmp_path / "nope.gguf", "cannot read it as GGUF: No such file or directory"),
    ]


# what pyvis's own reader says for the first five of _bad_sidecars, case by case (the runtime words them as `says`)
PY_SAYS = ["was calibrated for another model than {model} (architecture: profile llama, model qwen3moe",
           ": not a GGUF file, or truncated (ValueError: cannot reshape array",      # gguf cannot map a cut tensor
           ": not a GGUF file, or truncated (ValueError: cannot reshape array",
           ": not a GGUF file, or truncated (", "a GGUF without vis.profile.kind: not a vis profile"]


def test_python_reader_errors(fixture_dir, tmp_path, qwen_q4):
    model = fixture_dir / "qwen3moe.gguf"
    for (path, says), py_says in zip(_bad_sidecars(fixture_dir, tmp_path, qwen_q4)[:5], PY_SAYS):
        with pytest.raises(vprof.ProfileError) as e:
            sh.read_shadow(path, model)
        msg = str(e.value)
        assert str(path) in msg and py_says.format(model=model) in msg, (says, msg)


def _cli(bindir, model, *extra, n=6, env=None):
    r = run([bindir / "llama-cli", "-m", model, "-p", PROMPT, "-n", str(n), "-st", "--temp", "0", "-c", "256",
             "-t", "2", "--no-warmup", "-lv", "4", "--moe-slots", "8", *extra], timeout=180, extra_env=env)
    return r, r.stdout + r.stderr


def test_bad_sidecars_through_the_cli(bindir, fixture_dir, tmp_path, qwen_q4):
    model = fixture_dir / "qwen3moe.gguf"
    for path, says in _bad_sidecars(fixture_dir, tmp_path, qwen_q4):
        r, out = _cli(bindir, model, "--moe-shadow", path, n=1)
        assert r.returncode != 0, (path, out[-1500:])
        assert f"--moe-shadow {path}: " in out and says in out and FIX in out, (path, out[-1500:])


def test_bad_sidecars_through_python(fixture_dir, tmp_path, qwen_q4):
    model = fixture_dir / "qwen3moe.gguf"
    for path, says in _bad_sidecars(fixture_dir, tmp_path, qwen_q4):
        with pytest.raises(VisError) as e:
            moe.load(model, moe.MoeConfig(slots=8, shadow=path), n_ctx=128, verbose=False)
        msg = str(e.value)
        assert f"--moe-shadow {path}: " in msg and says in msg and FIX in msg, msg


def _text(stdout):
    """The prompt and generated text of llama-cli's stdout, without the loading spinner (it varies run to run)."""
    return stdout[stdout.find("> " + PROMPT[:20]):stdout.find("[ Prompt:")]


def test_cli_loads_logs_and_changes_nothing(bindir, fixture_dir, qwen_q4):
    model = fixture_dir / "qwen3moe.gguf"
    r0, out0 = _cli(bindir, model)
    r1, out1 = _cli(bindir, model, "--moe-shadow", qwen_q4)
    assert r0.returncode == 0 and r1.returncode == 0, out1[-2000:]
    assert f"--moe-shadow {qwen_q4}: q4_0 shadows of 3 managed layers (0..2)" in out1 and NOT_USED in out1
    assert _text(r1.stdout) == _text(r0.stdout) and len(_text(r0.stdout)) > len(PROMPT)   # byte for byte
    # through the environment, like every flag
    r3, out3 = _cli(bindir, model, n=1, env={"VIS_MOE_SHADOW": str(qwen_q4)})
    assert r3.returncode == 0 and f"--moe-shadow {qwen_q4}: q4_0 shadows" in out3, out3[-2000:]
    # without the expert cache it is not used, and says so; the file is still checked (issue #25)
    r2 = run([bindir / "llama-cli", "-m", model, "-p", PROMPT, "-n", "2", "-st", "-c", "256", "-t", "2",
              "--no-warmup", "-lv", "4", "--moe-shadow", qwen_q4], timeout=180)
    assert r2.returncode == 0 and "--moe-shadow " + str(qwen_q4) + " ignored" in r2.stdout + r2.stderr
    r2 = run([bindir / "llama-cli", "-m", model, "-p", PROMPT, "-n", "2", "-st", "-c", "256", "-t", "2",
              "--no-warmup", "-lv", "4", "--moe-shadow", model], timeout=180)
    assert r2.returncode != 0 and "missing key vis.profile.kind" in r2.stdout + r2.stderr
    r4 = run([bindir / "llama-cli", "-m", model, "-p", PROMPT, "-n", "1", "-st", "-c", "256", "-t", "2",
              "--no-warmup", "-lv", "4", "--moe-mem", "4000", "--moe-shadow", qwen_q4], timeout=180)
    assert r4.returncode == 0 and "ignored: shadows are for the managed layers of the expert cache, which is not " \
        "used: the whole model fits the memory budget" in r4.stdout + r4.stderr


def test_python_load_same_logits(fixture_dir, qwen_q4):
    model = fixture_dir / "qwen3moe.gguf"
    ref, _ = greedy_logits(model, PROMPT, 6, slots=8)
    got, llm = greedy_logits(model, PROMPT, 6, slots=8, shadow=qwen_q4)
    assert ref.shape == got.shape and np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert moe.stats(llm).n_slots == 8


def test_empty_flag_is_an_error(bindir, fixture_dir):
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "x", "-n", "1", "-st",
             "--moe-shadow", ""], timeout=60)
    assert r.returncode != 0 and "--moe-shadow: expected a file path, got ''" in r.stdout + r.stderr


def _fnv64(b: bytes) -> int:
    h = 0xCBF29CE484222325
    for c in b:
        h = ((h ^ c) * 0x100000001B3) & (1 << 64) - 1
    return h


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2"])
def test_c_loader_positioned_reads(bindir, fixture_dir, tmp_path, name):
    """test-vis-shadow reads the last expert of every shadow tensor through vis_io_pool at the offset and stride the
    C loader exposes: the bytes are the file's, as the gguf package reads them."""
    model = fixture_dir / f"{name}.gguf"
    out = sh.write_shadow(model, "Q8_0", tmp_path / "s.gguf")["path"]
    r = run([bindir / "test-vis-shadow", model, out], timeout=120)
    assert r.returncode == 0 and "test-vis-shadow: ok" in r.stdout, (r.stdout + r.stderr)[-2000:]
    got = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("blk.")}
    sf = sh.read_shadow(out, model)
    assert set(got) == set(sf.tensors)
    for tname, (_, ne, t) in sf.tensors.items():
        nb2 = int(t.n_bytes) // ne[2]
        last = np.asarray(t.data).reshape(ne[2], -1)[-1].tobytes()
        assert len(last) == nb2
        assert got[tname] == ["q8_0", str(int(t.data_offset)), str(nb2), str(ne[2]), f"{_fnv64(last):016x}"], tname
