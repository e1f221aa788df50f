"""Bad input through the C side (issue #12): every --moe-* value and VIS_MOE_* variable parsed strictly, a trace
path that never overwrites an input, trace write errors, files changed under a running model, --moe-mem when
the model fits.  Each test here failed on the code before the settings table (src/api/vis-moe-settings.cpp)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil

import numpy as np
import pytest

from pyvis import moe
from pyvis.runtime import native as _native
from conftest import run

PROMPT_ARGS = ["-p", "hi", "-n", "2", "-st", "-c", "128", "-t", "2", "--temp", "0"]


def _cli(bindir, model, *extra, env=None, timeout=60):
    r = run([bindir / "llama-cli", "-m", model, *PROMPT_ARGS, *extra], timeout=timeout, extra_env=env)
    return r, r.stdout + r.stderr


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("value", ["1e9", "1.5", "8abc", "abc", "4294967296", "-1", ""])
def test_slots_flag_is_parsed_strictly(bindir, fixture_dir, value):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", value)
    assert r.returncode != 0
    assert f"--moe-slots: expected an integer in 0..65536 (0 = off), got '{value}'" in out, out[-1500:]


@pytest.mark.parametrize("flag, value, needle", [
    ("--moe-pinned-layers", "-2", "--moe-pinned-layers: expected an integer in -1..65536 (-1 = all), got '-2'"),
    ("--moe-cache-mib", "12x", "--moe-cache-mib: expected an integer in 0..1073741824 (0 = off), got '12x'"),
    ("--moe-io-threads", "0", "--moe-io-threads: expected an integer in 1..64, got '0'"),
    ("--moe-mem", "0", "--moe-mem: expected an integer in 1..1073741824 MiB (or auto, off), got '0'"),
    ("--moe-mlock", "auto", "--moe-mlock: expected on or off, got 'auto'"),
    ("--moe-store", "disk", "--moe-store: expected file or model, got 'disk'"),
    ("--moe-stream-passes", "-3", "--moe-stream-passes: expected an integer in 0..65536 (0 = never), got '-3'"),
])
def test_every_flag_names_itself_and_its_range(bindir, fixture_dir, flag, value, needle):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", flag, value)
    assert r.returncode != 0 and needle in out, out[-1500:]


def test_bad_variable_fails_cli_and_bench(bindir, fixture_dir):
    model = fixture_dir / "qwen3moe.gguf"
    r, out = _cli(bindir, model, env={"VIS_MOE_SLOTS": "8abc"})
    assert r.returncode != 0
    assert "invalid environment variable: VIS_MOE_SLOTS: expected an integer in 0..65536 (0 = off), got '8abc'" in out
    assert "fix or unset VIS_MOE_SLOTS" in out
    # llama-bench has its own parser and takes the settings from the variables only: it must not ignore them
    r = run([bindir / "llama-bench", "-m", model, "-p", "0", "-n", "1", "-r", "1"], timeout=120,
            extra_env={"VIS_MOE_MEM": "lots"})
    assert r.returncode != 0
    assert "VIS_MOE_MEM: expected an integer in 1..1073741824 MiB (or auto, off), got 'lots'" in r.stdout + r.stderr
    # a flag overrides its variable: the bad variable no longer matters
    r, out = _cli(bindir, model, "--moe-slots", "8", env={"VIS_MOE_SLOTS": "8abc"})
    assert r.returncode == 0, out[-1500:]


def test_help_lists_every_user_flag_of_the_table(bindir):
    help_text = run([bindir / "llama-cli", "--help"]).stdout
    flags = re.findall(r"^(--moe-[a-z-]+)", help_text, re.M)
    for name in ("--moe-slots", "--moe-pinned-layers", "--moe-stats", "--moe-trace", "--moe-mem"):
        assert name in flags, name
        env = "VIS_MOE_" + {"--moe-pinned-layers": "PINNED"}.get(name, name[6:].upper().replace("-", "_"))
        assert f"(env: {env})" in help_text, env
    # the help lists exactly the table's user rows (llama-cli takes images: the vision ones too), no more, no fewer;
    # the engine knobs are VIS_MOE_* variables (docs/knobs.md, tests/test_knobs.py)
    assert set(flags) == {f.name for f in _native.flags() if not f.knob}


def test_trace_never_overwrites_a_model(bindir, fixture_dir, tmp_path):
    """The data-loss bug: `--moe-trace MODEL` emptied the model before anything checked the path."""
    model = tmp_path / "victim.gguf"
    shutil.copy(fixture_dir / "qwen3moe.gguf", model)
    before = _sha(model)
    r, out = _cli(bindir, model, "--moe-trace", model)
    assert r.returncode != 0
    assert f"--moe-trace: refusing to overwrite '{model}': it is a GGUF model file" in out, out[-1500:]
    assert _sha(model) == before
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-trace", other)
    assert r.returncode != 0 and "it exists and is not a routing trace" in out
    assert other.read_text() == "keep me"
    # an earlier trace is replaced, and the fit probe of llama-cli never opens the trace
    trace = tmp_path / "t.trace"
    for _ in range(2):
        r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-trace", trace)
        assert r.returncode == 0, out[-1500:]
        assert trace.read_bytes()[:8] == b"VISTRACE"


def test_trace_write_error_fails_the_run(bindir, fixture_dir):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-trace", "/dev/full")
    assert r.returncode != 0
    assert "--moe-trace: cannot write '/dev/full'" in out, out[-1500:]


def test_trace_disk_full_during_decode_fails_the_run(bindir, fixture_dir, tmp_path):
    """A file-size limit makes writes fail with EFBIG part-way through (as a full disk does mid-run)."""
    trace = tmp_path / "big.trace"
    cmd = " ".join(f"'{c}'" for c in [bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", *PROMPT_ARGS,
                                      "--moe-trace", trace])
    r = run(["bash", "-c", f"trap '' XFSZ; ulimit -f 4; exec {cmd}"], timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-1500:]
    assert re.search(rf"--moe-trace: writing '{re.escape(str(trace))}' failed: File too large", out), out[-1500:]


def test_file_rewritten_in_place_with_mtime_restored_is_detected(fixture_dir, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(fixture_dir / "qwen3moe.gguf", model)
    llm = moe.load(model, moe.MoeConfig(slots=4), n_ctx=128, n_threads=2, verbose=False)
    llm.eval(llm.tokenize(b"Experts", add_bos=True))
    st = os.stat(model)
    data = model.read_bytes()
    with open(model, "r+b") as f:  # same size, same bytes, same mtime: only the ctime tells
        f.write(data)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(model).st_mtime_ns == st.st_mtime_ns and os.stat(model).st_size == st.st_size
    llm.reset()
    with pytest.raises(Exception):
        llm.eval(llm.tokenize(b"A different prompt reaches other experts", add_bos=True))
    assert "changed since the model was loaded (change time (rewritten in place)" in _native.last_error()


def test_moe_mem_runs_upstreams_path_when_the_model_fits(bindir, fixture_dir):
    model = fixture_dir / "qwen3moe.gguf"
    ref, ref_out = _cli(bindir, model, "-v")
    r, out = _cli(bindir, model, "--moe-mem", "4096", "--moe-stats", "-v")
    assert ref.returncode == 0 and r.returncode == 0, out[-1500:]
    assert "vis-moe: --moe-mem: the whole model fits the memory budget; running upstream's path" in out
    assert "expert cache stats" not in out and "memory plan" not in out
    # repacking as upstream decides: the same buffers as the plain run
    bufs = lambda o: sorted(set(re.findall(r"(\S+) model buffer size", o)))  # noqa: E731
    assert bufs(out) == bufs(ref_out)
    text = lambda o: o.split("> hi", 1)[-1].split("[ Prompt:")[0]  # noqa: E731
    assert text(r.stdout) == text(ref.stdout)


def test_logits_identical_when_the_model_fits(fixture_dir):
    kw = dict(n_ctx=128, logits_all=True, n_threads=2, verbose=False)
    toks = None
    out = []
    for mem in (0, 4096):
        llm = moe.load(fixture_dir / "deepseek2.gguf", moe.MoeConfig(mem=mem),
                       **kw) if mem else _native.llama_cpp.Llama(
            str(fixture_dir / "deepseek2.gguf"), **kw)
        toks = toks or llm.tokenize(b"Fits in memory", add_bos=True)
        llm.eval(toks)
        out.append(np.array(llm.scores[: llm.n_tokens], copy=True))
        assert _native.moe_n_managed(llm) == 0
        del llm
    assert np.array_equal(out[0].view(np.uint32), out[1].view(np.uint32))


def test_perplexity_exits_nonzero_after_an_expert_read_error(bindir, fixture_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} experts route tokens" for i in range(400)))
    args = [bindir / "llama-perplexity", "-m", fixture_dir / "qwen3moe.gguf", "-f", text, "-c", "128", "-b", "128",
            "-t", "2", "--chunks", "2", "--moe-slots", "8"]
    ok = run(args, timeout=300)
    assert ok.returncode == 0, ok.stderr[-1500:]
    bad = run(args, timeout=300, extra_env={"VIS_MOE_FAULT_READ": "*"})
    out = bad.stdout + bad.stderr
    assert bad.returncode == 1, out[-1500:]
    assert "injected by VIS_MOE_FAULT_READ" in out and "failed in the expert cache" in out


def test_server_tells_the_client_why_a_decode_failed(bindir, fixture_dir):
    import json
    import socket
    import subprocess
    import time
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VIS_MOE_FAULT_READ="*", LLAMA_LOG_COLORS="0")
    proc = subprocess.Popen([str(bindir / "llama-server"), "-m", str(fixture_dir / "qwen3moe.gguf"), "--port", str(port),
                             "--host", "127.0.0.1", "-c", "256", "-t", "2", "--moe-slots", "8", "-np", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception:
                assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
                time.sleep(0.3)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                     data=json.dumps({"prompt": "Hello experts", "n_predict": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
            body = ""
        except urllib.error.HTTPError as e:
            body = e.read().decode()
        assert "Compute error. vis-moe:" in body and "injected by VIS_MOE_FAULT_READ" in body, body
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_host_cache_without_a_cache_flag_is_reported(bindir, fixture_dir):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-host-mib", "64", "-v")
    assert r.returncode == 0, out[-1500:]
    assert "vis-moe: --moe-host-mib 64 ignored: the host cache sits below the expert slots, which are off" in out


@pytest.mark.parametrize("medium, budget", [(False, 4096), (True, 300)])
def test_plan_and_runtime_agree_on_whole_model_fits(bindir, fixture_dir, medium_model, medium, budget):
    from pyvis.runtime import plan as vplan
    model = medium_model if medium else fixture_dir / "qwen3moe.gguf"
    p = vplan.make_plan(vplan.read_shape(model), budget_mib=budget, n_ctx=128, gpu=False)
    r, out = _cli(bindir, model, "--moe-mem", str(budget), "-v", timeout=120)
    assert r.returncode == 0, out[-1500:]
    assert p["whole_model_fits"] == ("the whole model fits the memory budget" in out)
    assert p["whole_model_fits"] == (not medium)


def test_bad_variable_is_an_error_through_python_too(fixture_dir, monkeypatch):
    """pyvis applies its settings as a thread override built on the environment: a bad variable is not skipped."""
    monkeypatch.setenv("VIS_MOE_STREAM_PASSES", "many")
    with pytest.raises(_native.VisError) as e:
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4), n_ctx=64, verbose=False)
    assert "VIS_MOE_STREAM_PASSES: expected an integer in 0..65536 (0 = never), got 'many'" in str(e.value)
    monkeypatch.delenv("VIS_MOE_STREAM_PASSES")
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4), n_ctx=64, verbose=False)
    assert _native.moe_n_managed(llm) > 0
