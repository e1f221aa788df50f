"""Hardening, second round (issue #25): model files replaced the documented way under a running server, split GGUFs
in pyvis, named files always checked, strict keyword arguments, output kinds, misleading errors, sidecar integrity
and truncation inside expert-interleaved files.  Each test here failed on the code before its fix."""
from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest

from pyvis import moe
from pyvis.runtime import plan as vplan
from pyvis.runtime import predict_profile as pp
from pyvis.runtime import profile as prof
from pyvis.runtime import shadow as sh
from pyvis.runtime import trace as vtrace
from conftest import llama_server, run, write_split
from test_hardening import _cli, _sha


def _complete(port, prompt, n=4):
    """(HTTP status, generated text or error body)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                 data=json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0,
                                                  "cache_prompt": False}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())["content"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# --------------------------------------------------------------------------
# 3. replacing the model the documented way keeps a running server serving
# --------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["rename", "rm"])
def test_server_serves_on_after_the_model_is_replaced(bindir, fixture_dir, tmp_path, how):
    model = tmp_path / "m.gguf"
    shutil.copy(fixture_dir / "qwen3moe.gguf", model)
    with llama_server(bindir, model, "-c", "256", "-t", "2", "-np", "1", "--moe-slots", "4") as (proc, port):
        before = _complete(port, "Experts route tokens")
        assert before[0] == 200, before
        if how == "rename":  # docs/paging.md: write a new file and rename it over the old one
            new = tmp_path / "new.gguf"
            shutil.copy(fixture_dir / "deepseek2.gguf", new)   # another model: the server must keep the old inode
            os.rename(new, model)
        else:
            model.unlink()
        other = _complete(port, "A different prompt reaches other experts")
        again = _complete(port, "Experts route tokens")
        assert other[0] == 200, other
        assert again == before                             # the same bytes, read from the open file
        assert proc.poll() is None
    # an in-place rewrite is still caught: tests/test_hardening.py::test_file_rewritten_in_place_with_mtime_restored


# --------------------------------------------------------------------------
# 4. split GGUFs in pyvis; 8. a later shard named for what it is
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_model(fixture_dir, tmp_path_factory):
    """The qwen3moe fixture as llama-gguf-split --split-max-tensors 12 writes it (gguf-py's writer: the first shard
    holds every key, each shard split.no / split.count / split.tensors.count)."""
    shards = write_split(fixture_dir / "qwen3moe.gguf", tmp_path_factory.mktemp("split"), 12)
    assert len(shards) >= 3, shards
    return shards


def test_plan_reads_every_shard(fixture_dir, split_model):
    whole = vplan.read_shape(fixture_dir / "qwen3moe.gguf")
    split = vplan.read_shape(split_model[0])
    assert split.moe_layers == whole.moe_layers and len(whole.moe_layers) == 3
    assert (split.total_bytes, split.expert_bytes, split.n_expert) == (whole.total_bytes, whole.expert_bytes,
                                                                         whole.n_expert)
    kw = dict(budget_mib=64, n_ctx=128, gpu=False)
    a, b = vplan.make_plan(whole, **kw), vplan.make_plan(split, **kw)
    assert {k: a[k] for k in ("ok", "n_slots", "slab_bytes", "min_budget")} == \
        {k: b[k] for k in ("ok", "n_slots", "slab_bytes", "min_budget")}


def test_fingerprint_and_shadow_of_a_split_model(fixture_dir, split_model, tmp_path):
    assert prof.model_fingerprint(split_model[0]) == prof.model_fingerprint(fixture_dir / "qwen3moe.gguf")
    a = sh.write_shadow(fixture_dir / "qwen3moe.gguf", "Q4_0", tmp_path / "a.gguf", threads=2)
    b = sh.write_shadow(split_model[0], "Q4_0", tmp_path / "b.gguf", threads=2)
    assert (a["tensors"], a["shadow_bytes"]) == (b["tensors"], b["shadow_bytes"]) and a["tensors"] == 9
    ra, rb = sh.read_shadow(a["path"], split_model[0]), sh.read_shadow(b["path"], split_model[0])
    for name, (_, _, t) in ra.tensors.items():
        assert np.array_equal(np.asarray(t.data), np.asarray(rb.tensors[name][2].data))


def test_a_later_shard_says_which_file_to_give(split_model, tmp_path, capsys):
    from pyvis.cli import main
    second = split_model[1]
    want = f"shard 2 of {len(split_model)} of a split GGUF; give the first shard, {split_model[0]}"
    assert main(["shadow", str(second), "--type", "Q4_0", "--out", str(tmp_path / "s.gguf")]) == 1
    assert want in capsys.readouterr().err
    assert main(["plan", str(second)]) == 1
    assert want in capsys.readouterr().err
    with pytest.raises(SystemExit, match="shard 2 of"):
        main(["info", "-m", str(second)])


def test_a_missing_shard_is_named(split_model, tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    shutil.copy(split_model[0], d / split_model[0].name)
    with pytest.raises(ValueError, match=r"m-00002-of-0000\d.gguf, .* are missing; put every shard beside the first"):
        vplan.read_shape(d / split_model[0].name)


# --------------------------------------------------------------------------
# 5. a named file is always opened and checked; strict test hooks
# --------------------------------------------------------------------------
def _predictor_profile_of(model, path):
    fp = prof.model_fingerprint(model)
    L, E = fp["n_layer"], fp["n_expert"]
    coact = np.full((1, L, E, E), 1.0 / E, np.float32)
    return pp.write_predictor_profile(path, fp, np.full((L, E), 1.0 / E), coact, fp["n_expert_used"], 10, "test")


@pytest.mark.parametrize("flags, needle", [
    (["--moe-shadow", "nonexist.gguf", "--moe-precision", "all"], "--moe-shadow nonexist.gguf: cannot read it as GGUF"),
    (["--moe-substitute", "buddy", "--moe-sub-profile", "nonexist.gguf"],
     "VIS_MOE_SUB_PROFILE=nonexist.gguf: cannot read it as GGUF"),
    (["--moe-sub-profile", "nonexist.gguf"], "VIS_MOE_SUB_PROFILE=nonexist.gguf: cannot read it as GGUF"),
])
def test_a_named_file_is_checked_without_a_cache_flag(bindir, fixture_dir, flags, needle):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", *flags)
    assert r.returncode != 0, out[-1500:]
    assert needle in out, out[-1500:]


def test_another_models_predictor_profile_is_refused_without_a_cache_flag(bindir, fixture_dir, tmp_path):
    other = _predictor_profile_of(fixture_dir / "deepseek2.gguf", tmp_path / "ds.predict.gguf")
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-predict", "coact", "--moe-predict-profile", other)
    assert r.returncode != 0, out[-1500:]
    assert f"--moe-predict-profile {other}: was made for another model" in out, out[-1500:]
    # with the cache on and a predictor that reads no profile, the file is checked too
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", "8", "--moe-predict", "next-router",
                  "--moe-predict-profile", other)
    assert r.returncode != 0 and "was made for another model" in out, out[-1500:]


def test_a_valid_unused_file_is_checked_and_reported(bindir, fixture_dir, tmp_path):
    mine = _predictor_profile_of(fixture_dir / "qwen3moe.gguf", tmp_path / "q.predict.gguf")
    ref, ref_out = _cli(bindir, fixture_dir / "qwen3moe.gguf")
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-predict-profile", mine, "-v")
    assert ref.returncode == 0 and r.returncode == 0, out[-1500:]
    assert f"--moe-predict-profile {mine}: validated, not used: --moe-predict is off" in out
    text = lambda o: o.split("> hi", 1)[-1].split("[ Prompt:")[0]  # noqa: E731
    assert text(r.stdout) == text(ref.stdout)


@pytest.mark.parametrize("var, value, needle", [
    ("VIS_MOE_SHADOW", "abc", "--moe-shadow abc: cannot read it as GGUF"),
    ("VIS_MOE_FAULT_READ", "abc", "VIS_MOE_FAULT_READ: expected '*' or LAYER:EXPERT"),
    ("VIS_MOE_FAULT_READ", "-1:2", "VIS_MOE_FAULT_READ layer: expected an integer in 0..65536, got '-1'"),
    ("VIS_MOE_FAULT_READ", "1:2x", "VIS_MOE_FAULT_READ expert: expected an integer in 0..65536, got '2x'"),
])
def test_bad_variables_are_errors(bindir, fixture_dir, var, value, needle):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", env={var: value})
    assert r.returncode != 0, out[-1500:]
    assert needle in out, out[-1500:]


def test_fault_read_hook_still_fails_the_named_expert(bindir, fixture_dir):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", "2", env={"VIS_MOE_FAULT_READ": "*"})
    assert r.returncode != 0 and "injected by VIS_MOE_FAULT_READ" in out, out[-1500:]


# --------------------------------------------------------------------------
# 6. pyvis.moe.load: unknown keywords and wrong types
# --------------------------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    (dict(slotz=3), "MoeConfig has no field 'slotz'"),
    (dict(mlock="no"), "mlock (--moe-mlock) must be True or False, got 'no'"),
    (dict(slots=True), "slots (--moe-slots) must be an integer, got True"),
    (dict(sub_beta="1"), "sub_beta (--moe-sub-beta) must be a number, got '1'"),
    (dict(mem=2.5), "mem (--moe-mem) must be an integer or a string, got 2.5"),
])
def test_load_refuses_unknown_names_and_wrong_types(fixture_dir, kw, needle):
    with pytest.raises(TypeError) as e:
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(**kw), n_ctx=64, verbose=False)
    assert needle in str(e.value)
    # not a llama_cpp.Llama keyword either
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) slotz"):
        moe.load(fixture_dir / "qwen3moe.gguf", slotz=3, n_ctx=64, verbose=False)


def test_load_still_takes_llama_keywords_and_paths(fixture_dir, tmp_path):
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=np.int64(4), trace=tmp_path / "t.trace"),
                   n_ctx=64,
                   n_threads=2, verbose=False)
    assert moe.stats(llm).n_slots == 4


# --------------------------------------------------------------------------
# 7. one output kind never replaces another without --force
# --------------------------------------------------------------------------
def test_calibrate_refuses_to_replace_a_shadow_sidecar(fixture_dir, tmp_path, capsys):
    from pyvis.cli import main
    from pyvis.runtime.trace import Trace
    model = fixture_dir / "qwen3moe.gguf"
    side = tmp_path / "m.shadow.gguf"
    sh.write_shadow(model, "Q4_0", side, threads=2)
    digest = _sha(side)
    rng = np.random.default_rng(0)
    cal = Trace.from_routes(np.stack([np.array([rng.choice(32, 8, replace=False) for _ in range(40)])
                                      for _ in range(3)]), 32).save(tmp_path / "cal.npz")
    args = ["calibrate", "predictor", "-m", str(model), "--trace", str(cal), "-o", str(side)]
    assert main(args) == 1
    assert f"refusing to overwrite {side}: it is a 'shadow' sidecar, not a 'predictor' one" in capsys.readouterr().err
    assert _sha(side) == digest
    assert main(args + ["--force"]) == 0
    assert pp.read_predictor_profile(side, model).k == 8
    # and the other way round
    assert main(["shadow", str(model), "--type", "Q4_0", "--out", str(side)]) == 1
    assert "it is a 'predictor' sidecar, not a 'shadow' one" in capsys.readouterr().err
    assert main(["shadow", str(model), "--type", "Q4_0", "--out", str(side), "--force", "-t", "2"]) == 0
    # the same kind is replaced as before
    assert main(["shadow", str(model), "--type", "Q8_0", "--out", str(side), "-t", "2"]) == 0


# --------------------------------------------------------------------------
# 8. errors that say what is wrong
# --------------------------------------------------------------------------
def test_truncated_trace_header_is_called_truncated(bindir, fixture_dir, tmp_path):
    tr = tmp_path / "t.trace"
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-trace", tr)
    assert r.returncode == 0, out[-1500:]
    cut = tmp_path / "cut.trace"
    cut.write_bytes(tr.read_bytes()[:12])
    with pytest.raises(vtrace.TraceError, match=r"truncated header \(12 of 24 bytes"):
        vtrace.read(cut)


def test_info_on_an_mmproj_says_what_it_is(fixture_dir):
    from pyvis.cli import main
    with pytest.raises(SystemExit, match="is a multimodal projector \\(mmproj\\), not a language model"):
        main(["info", "-m", str(fixture_dir / "qwen3vlmoe-mmproj.gguf")])


def test_plan_slots_share_the_runtimes_limit(fixture_dir, capsys):
    from pyvis.cli import main
    with pytest.raises(SystemExit):
        main(["plan", str(fixture_dir / "qwen3moe.gguf"), "--slots", "99999"])
    assert "expected an integer in 0..65536 (0 = planned), got '99999'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--slots must be an integer in 0\.\.65536"):
        vplan.make_plan(vplan.read_shape(fixture_dir / "qwen3moe.gguf"), slots=65537, budget_mib=4096, gpu=False)
    assert main(["plan", str(fixture_dir / "qwen3moe.gguf"), "--slots", "65536", "--budget", "4096"]) == 0


# --------------------------------------------------------------------------
# 9. sidecar integrity
# --------------------------------------------------------------------------
@pytest.fixture()
def sidecar(fixture_dir, tmp_path):
    out = tmp_path / "m.shadow.gguf"
    sh.write_shadow(fixture_dir / "qwen3moe.gguf", "Q4_0", out, threads=2)
    return out


def test_sidecar_checksums_are_written(sidecar, fixture_dir):
    import gguf
    r = gguf.GGUFReader(str(sidecar))
    names = [t.name for t in r.tensors]
    assert names[-1] == sh.T_SUMS
    sums = np.asarray(r.tensors[-1].data).view(np.uint64).reshape(len(names) - 1, -1)
    for j, t in enumerate(r.tensors[:-1]):
        data = np.asarray(t.data).reshape(sums.shape[1], -1)
        assert [prof.bytes_sum(data[e]) for e in range(sums.shape[1])] == sums[j].tolist()


def test_sidecar_with_a_damaged_architecture_is_refused(bindir, fixture_dir, sidecar):
    raw = bytearray(sidecar.read_bytes())
    i = raw.index(b"vis-profile")
    raw[i + 10] ^= 0x01                                  # 'vis-profile' -> 'vis-profild'
    sidecar.write_bytes(bytes(raw))
    with pytest.raises(prof.ProfileError, match="general.architecture is 'vis-profild'"):
        sh.read_shadow(sidecar)
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", "2", "--moe-shadow", sidecar,
                  "--moe-precision", "all")
    assert r.returncode != 0, out[-1500:]
    assert "general.architecture is 'vis-profild', a vis sidecar has 'vis-profile' (damaged file)" in out


def test_sidecar_with_a_flipped_data_byte_fails_the_read(bindir, fixture_dir, sidecar):
    import gguf
    args = ["--moe-slots", "2", "--moe-shadow", sidecar, "--moe-precision", "all"]
    ok, ok_out = _cli(bindir, fixture_dir / "qwen3moe.gguf", *args)
    assert ok.returncode == 0, ok_out[-1500:]
    r = gguf.GGUFReader(str(sidecar))
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_down_exps.weight")
    n_exp = int(t.shape[-1])
    per = int(t.n_bytes) // n_exp
    raw = bytearray(sidecar.read_bytes())
    for e in range(n_exp):                               # one byte in every expert: whichever is read is damaged
        raw[int(t.data_offset) + e * per + per // 2] ^= 0x10
    sidecar.write_bytes(bytes(raw))
    bad, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", *args)
    assert bad.returncode != 0, out[-1500:]
    assert "of tensor blk.1.ffn_down_exps.weight from" in out and "do not match their checksum" in out, out[-1500:]


# --------------------------------------------------------------------------
# 10. truncation inside an expert-interleaved file: an error, never SIGBUS
# --------------------------------------------------------------------------
def test_truncation_inside_interleaved_experts_is_an_error(bindir, fixture_dir, tmp_path):
    import gguf
    model = tmp_path / "g.gguf"
    shutil.copy(fixture_dir / "gptoss.gguf", model)
    r = gguf.GGUFReader(str(model))
    exps0 = min(int(t.data_offset) for t in r.tensors if t.name.startswith("blk.0.") and "_exps." in t.name)
    resident_after = [t.name for t in r.tensors if int(t.data_offset) > exps0 + 4096 and "_exps." not in t.name]
    assert "blk.1.attn_q.weight" in resident_after       # the layout this test is about
    del r
    with llama_server(bindir, model, "-c", "256", "-t", "2", "-np", "1", "--moe-slots", "2") as (proc, port):
        assert _complete(port, "Experts route tokens")[0] == 200
        os.truncate(model, exps0 + 4096)                  # inside layer 0's experts
        status, body = _complete(port, "A different prompt reaches other experts")
        assert proc.poll() is None, f"server died with {proc.returncode}"
        assert status == 500 and "changed since the model was loaded (size" in body, body
        status, body = _complete(port, "Experts route tokens")
        assert proc.poll() is None and status == 500 and "changed since the model was loaded" in body, body


# --------------------------------------------------------------------------
# 1-2. --moe-mem: one plan decides; every expert resident must fit; a budget above the limit is clamped
# --------------------------------------------------------------------------
@pytest.mark.parametrize("flags, plan_kw", [
    (["--moe-pinned-layers", "-1"], dict(pinned=-1)),
    (["--moe-slots", "128"], dict(slots=128)),
])
def test_every_expert_resident_must_fit_the_budget(bindir, medium_model, flags, plan_kw):
    """pyvis plan said "fits" for --pinned -1 at any budget and the run loaded everything (issue #25, item 2)."""
    shape = vplan.read_shape(medium_model)
    for budget in (200, 4096):
        p = vplan.make_plan(shape, budget_mib=budget, n_ctx=128, gpu=False, **plan_kw)
        r, out = _cli(bindir, medium_model, "--moe-mem", str(budget), *flags, timeout=120)
        assert p["ok"] == (r.returncode == 0) == (budget == 4096), (budget, p.get("error"), out[-1500:])
        if budget == 200:
            assert re.search(r"every expert stays resident|cannot hold 408 MiB slabs \(128 slots", p["error"])
            assert f"--moe-mem 200: {flags[0]} " in out and "keeps every expert resident" in out, out[-1500:]
            assert "must fit; raise the budget to at least that" in out


def test_budget_above_the_cgroup_limit_is_clamped(bindir, medium_model):
    """--moe-mem 4000 in a 300 MiB cgroup: planned for 300 MiB with a line, and the run stays inside it (before: a
    warning, then the whole 438 MiB model was loaded by upstream's path and the kernel killed the run)."""
    from test_paging import memory_cgroup
    import sys
    limit = 300 << 20
    with memory_cgroup(limit) as (wrap, peak):
        r = run(wrap([bindir / "llama-cli", "-m", medium_model, *PROMPT, "--moe-mem", "4000", "-v"]), timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-2000:]
        assert "--moe-mem 4000 exceeds what this process may hold (cgroup v" in out and \
            "planned for 300 MiB instead" in out, out[-2000:]
        assert 0 < peak() <= limit
        p = run(wrap([sys.executable, "-m", "pyvis", "plan", medium_model, "--budget", "4000", "-c", "128"]), timeout=120)
        assert "--budget 4000 MiB exceeds what this process may hold (cgroup limit): planned for 300 MiB" in p.stdout, \
            p.stdout + p.stderr


def test_a_kv_cache_the_budget_cannot_hold_is_refused_before_it_is_allocated(bindir, medium_model):
    """-c 131072 (256 MiB of KV cache) under --moe-mem auto in a 250 MiB cgroup: refused with the largest context
    that could fit, before upstream allocates and clears the cache (before: killed while clearing it)."""
    from test_paging import memory_cgroup
    with memory_cgroup(250 << 20) as (wrap, peak):
        r = run(wrap([bindir / "llama-cli", "-m", medium_model, *PROMPT[:-6], "-c", "131072", "-t", "2",
                      "--moe-mem", "auto"]), timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 1, (r.returncode, out[-2000:])
        assert re.search(r"--moe-mem auto: the memory budget of \d+ MiB is too small: .*; smallest budget for this "
                         r"131072-token context: \d+ MiB \(KV cache 256 MiB\); largest context for \d+ MiB: -c \d+",
                         out), out[-2000:]


PROMPT = ["-p", "hi", "-n", "2", "-st", "-c", "128", "-t", "2", "--temp", "0"]
