"""`python -m pyvis.demo` (make run): its pieces, without building the testbed (that takes minutes).

The end-to-end run is `make run`; here: argument parsing, the cache stamp of the testbed, the rebuild
decision (with the builder replaced by a stub) and the closing summary formatted from a stats dict."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from pyvis import demo

MIB = 1 << 20


# --------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------
def test_defaults():
    a = demo.parse_args([])
    assert a.prompt == demo.DEFAULT_PROMPT and a.preset == demo.DEFAULT_PRESET
    assert a.budget is None and 0 < a.expert_share < 0.5          # most experts stay in the file
    assert a.top_k is None and not a.no_compare and a.n_predict > 0


def test_arguments():
    a = demo.parse_args(["-p", "Hi", "-n", "8", "--budget", "400", "-k", "4", "--no-compare", "-t", "1"])
    assert (a.prompt, a.n_predict, a.budget, a.top_k, a.no_compare, a.threads) == ("Hi", 8, 400, 4, True, 1)


@pytest.mark.parametrize("argv", [["--expert-share", "0"], ["--expert-share", "1.5"], ["--budget", "0"],
                                  ["-n", "0"], ["--budget", "400", "--expert-share", "0.5"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_equivalent_quotes_the_prompt(tmp_path):
    a = demo.parse_args(["-p", "it's", "--pinned", "1"])
    cmd = demo.cli_equivalent(tmp_path / "m.gguf", a, 500, 12)
    assert "--moe-mem 500" in cmd and "--moe-pinned-layers 1" in cmd
    assert "deepseek.expert_used_count=int:12" in cmd and "-st" in cmd
    assert cmd.endswith("-p 'it'\\''s'")
    assert "qwen3moe.expert_used_count=int:4" in demo.cli_equivalent(tmp_path / "m.gguf", a, 500, 4, "qwen3moe")


def test_help_runs_without_a_build():
    r = subprocess.run([sys.executable, "-m", "pyvis.demo", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--expert-share" in r.stdout


# --------------------------------------------------------------------------
# the cached testbed: stamp and rebuild decision
# --------------------------------------------------------------------------
INPUTS = {"preset": "p", "builder_version": 1, "spec_key": "abc", "source_sha256": "s1", "calibration_sha256": "c1"}


def test_stamp(tmp_path):
    m = tmp_path / "p.gguf"
    assert demo.stale_reason(m, INPUTS) == "not built yet"
    m.write_bytes(b"GGUF" + bytes(60))
    assert "no valid stamp" in demo.stale_reason(m, INPUTS)
    demo.write_stamp(m, INPUTS)
    assert demo.stale_reason(m, INPUTS) is None
    assert "source_sha256" in demo.stale_reason(m, dict(INPUTS, source_sha256="s2"))
    assert "calibration_sha256" in demo.stale_reason(m, dict(INPUTS, calibration_sha256="c2"))
    assert "spec_key" in demo.stale_reason(m, dict(INPUTS, spec_key="def"))
    st = m.stat()
    os.utime(m, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))          # rewritten by someone else
    assert "modified" in demo.stale_reason(m, INPUTS)
    demo.stamp_path(m).write_text("{not json")
    assert "no valid stamp" in demo.stale_reason(m, INPUTS)


def test_inputs_follow_source_and_spec(tmp_path):
    src = tmp_path / "src.gguf"
    src.write_bytes(b"a")
    i1 = demo.testbed_inputs("shared+16", src, "c")
    assert demo.testbed_inputs("shared+16", src, "c") == i1
    assert demo.testbed_inputs("mixtral8", src, "c")["spec_key"] != i1["spec_key"]
    src.write_bytes(b"b")
    assert demo.testbed_inputs("shared+16", src, "c")["source_sha256"] != i1["source_sha256"]


def test_ensure_testbed_builds_once_and_again_when_inputs_change(tmp_path, monkeypatch, capsys):
    """The builder (a subprocess of `pyvis moefy`, minutes) is replaced by a stub that writes the file."""
    import pyvis.assets
    from pyvis.testbed import corpus
    src = tmp_path / "smol.gguf"
    src.write_bytes(b"source")
    calib = {"text": "calibration one"}
    monkeypatch.setattr(pyvis.assets, "smollm2_gguf", lambda: src)
    monkeypatch.setattr(corpus, "calibration", lambda: types.SimpleNamespace(sha256=calib["text"]))
    calls = []

    def fake_run(cmd, *a, **kw):
        calls.append(cmd)
        out = cmd[cmd.index("-o") + 1]
        with open(out, "wb") as f:
            f.write(b"GGUF" + str(len(calls)).encode())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    out = tmp_path / "testbed"
    m = demo.ensure_testbed("shared+16", out, threads=1)
    assert m == out / "shared+16.gguf" and len(calls) == 1
    assert calls[0][1:5] == ["-m", "pyvis.cli", "moefy", "--preset"]
    assert demo.ensure_testbed("shared+16", out, threads=1) == m and len(calls) == 1      # cached
    calib["text"] = "calibration two"
    demo.ensure_testbed("shared+16", out, threads=1)
    assert len(calls) == 2                                                                 # input changed
    demo.ensure_testbed("shared+16", out, threads=1, rebuild=True)
    assert len(calls) == 3
    log = capsys.readouterr().out
    assert "not built yet" in log and "cached" in log and "calibration_sha256" in log


def test_failed_build_is_an_error_and_leaves_no_stamp(tmp_path, monkeypatch):
    import pyvis.assets
    from pyvis.testbed import corpus
    src = tmp_path / "smol.gguf"
    src.write_bytes(b"source")
    monkeypatch.setattr(pyvis.assets, "smollm2_gguf", lambda: src)
    monkeypatch.setattr(corpus, "calibration", lambda: types.SimpleNamespace(sha256="c"))
    monkeypatch.setattr(demo.subprocess, "run", lambda cmd, *a, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(demo.DemoError, match="building the testbed failed"):
        demo.ensure_testbed("shared+16", tmp_path, threads=1)
    assert not demo.stamp_path(tmp_path / "shared+16.gguf").exists()


# --------------------------------------------------------------------------
# the summary
# --------------------------------------------------------------------------
def _stats(identical=True, resident=True, io=True):
    expert = 442368
    managed = 29 * 16 * expert
    slab = 29 * 6 * expert
    paged = {"text": "The sky is blue.", "n_prompt": 41, "prefill_s": 0.5, "n_gen": 58, "decode_s": 10.0,
             "cache": {"n_slots": 6, "n_routed": 20644, "n_hits": 7875, "n_misses": 12769, "n_passes": 3000},
             "io": {"slab_hits": 7875, "host_hits": 0, "file_reads": 12769, "bytes_read": 12769 * expert,
                    "bytes_storage": 12769 * 454656, "read_us": 3_500_000, "direct_io": 1, "rss_peak": 495 * MIB,
                    "slab_bytes": slab, "host_bytes": 0, "streamed": 0, "bytes_streamed": 0} if io else {}}
    return {"model": {"name": "shared+16.gguf", "file_bytes": 541 * 10**6, "expert_bytes": managed,
                      "n_moe_layers": 29, "n_expert": 16, "k": 12},
            "budget_mib": 506,
            "plan": {"ok": True, "n_slots": 6, "slab_bytes": slab, "host_bytes": 0,
                     "file_only_bytes": managed - slab, "managed_layers": 29, "managed_bytes": managed,
                     "request": {"resident_bytes": 318 * MIB, "kv_bytes": 22 * MIB, "reserve_bytes": 91 * MIB}},
            "paged": paged,
            "resident": {"text": paged["text"], "n_prompt": 41, "prefill_s": 0.25, "n_gen": 58, "decode_s": 5.0}
            if resident else None,
            "identical": identical if resident else None}


def test_summary_lines():
    text = "\n".join(demo.summary_lines(_stats()))
    assert text.splitlines()[1] == "== summary"
    assert "--moe-mem 506" in text
    assert "tier 1 slabs 73.4 MiB (6 slots x 29 layers)" in text
    assert "tier 2 host cache 0.0 MiB" in text and "tier 3 file only 122.3 MiB" in text
    assert "(38 %)" in text and "the other 62 %" in text
    assert "answer 58 tokens at 5.8 tok/s" in text and "resident: 164.0 tok/s, 11.6 tok/s" in text
    assert "slab hits 7875 (38.1 %)" in text and "file reads 12769 (61.9 %)" in text
    assert "O_DIRECT" in text and "3.50 s waiting" in text and "peak RSS" in text
    assert "yes, byte-identical (16 bytes)" in text


def test_summary_names_the_slots_that_ran():
    """The runtime may run another slot count than the plan the summary was given (the configurator lowered -ub):
    the slab line names the runtime's, next to the runtime's slab bytes."""
    d = _stats()
    d["paged"]["cache"]["n_slots"] = 7
    d["paged"]["io"]["slab_bytes"] = 29 * 7 * 442368
    text = "\n".join(demo.summary_lines(d))
    assert "tier 1 slabs 85.6 MiB (7 slots x 29 layers)" in text, text
    # the plan's left-over bytes gave 5 of the layers one more slot: the line says so
    d["paged"]["cache"]["layer_slots"] = [7] * 24 + [8] * 5
    text = "\n".join(demo.summary_lines(d))
    assert "(7 slots x 29 layers + 1 in 5)" in text, text


def test_summary_names_the_borrowed_bytes():
    """Borrowed slots (on by default): the runtime's slabs exceed the plan's by bytes the compute reserve leaves idle;
    the summary says how many, so the tier split does not read as over the budget.  No line without them."""
    d = _stats()
    assert "borrowed slots" not in "\n".join(demo.summary_lines(d))
    d["plan"]["borrow"] = {"n_slots": 7, "extra_slots": 0}
    d["paged"]["io"]["slab_bytes"] = 29 * 7 * 442368
    text = "\n".join(demo.summary_lines(d))
    assert "12.2 MiB of the slabs are borrowed slots" in text, text


def test_summary_without_comparison_or_io_stats():
    text = "\n".join(demo.summary_lines(_stats(resident=False, io=False)))
    assert "same text" not in text and "resident:" not in text and "peak RSS" not in text
    assert "20644 expert uses" in text           # totals from the cache stats still count the lookups
    assert "hits 7875 (38.1 %), misses 12769 (61.9 %)" in text


def test_summary_says_when_texts_differ():
    assert "NO: the texts differ" in "\n".join(demo.summary_lines(_stats(identical=False)))
