"""Telemetry (issue #27 item 3, docs/telemetry.md): --moe-csv rows against the cache's own counters and the
--moe-stats table, the bytes a run read, refused output paths, the live status line on a terminal (and never
elsewhere), llama-server's /metrics and /props, pyvis report.  Each test fails when its feature does nothing."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import fcntl
import time
import urllib.request
from pathlib import Path

import pytest

from pyvis import moe
from pyvis.runtime import capi, telemetry
from conftest import llama_server, run

PROMPT = ["-p", "Experts route each token", "-st", "-c", "256", "-t", "2", "--temp", "0"]
KW = dict(n_ctx=256, n_threads=2, verbose=False)


def _cli(bindir, model, *extra, n=8, env=None, **kw):
    r = run([bindir / "llama-cli", "-m", model, *PROMPT, "-n", str(n), *extra], timeout=120, extra_env=env, **kw)
    return r, r.stdout + r.stderr


def _text(stdout):
    """The prompt and generated text of llama-cli's stdout, without the loading spinner (it varies run to run)."""
    i, j = stdout.find("> " + PROMPT[1][:20]), stdout.find("[ Prompt:")
    assert 0 <= i < j, stdout[-2000:]
    return stdout[i:j]


def _rows(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, "no rows"
    return rows


def _sum(rows, col):
    return sum(float(r[col]) if "." in r[col] else int(r[col]) for r in rows)


def _sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


# --------------------------------------------------------------------------
# the CSV: its rows are the cache's counters, ubatch by ubatch
# --------------------------------------------------------------------------
def _generate(model, out, slots, n=6):
    llm = moe.load(model, moe.MoeConfig(slots=slots, pinned_layers=0, csv=str(out)), **KW)
    toks = llm.tokenize(b"Experts route each token to", add_bos=True)
    llm.eval(toks)
    for _ in range(n):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    st, io = moe.stats(llm), moe.io_stats(llm)
    rows = _rows(out)          # flushed row by row: readable while the context is alive
    del llm
    return rows, st, io, len(toks)


def test_csv_rows_sum_to_the_counters_and_fewer_slots_read_more(fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    few, st_few, io_few, n_prompt = _generate(model, tmp_path / "few.csv", slots=4)
    many, st_many, io_many, _ = _generate(model, tmp_path / "many.csv", slots=16)
    for rows, st, io in ((few, st_few, io_few), (many, st_many, io_many)):
        assert [r["phase"] for r in rows] == ["prompt"] + ["decode"] * 6
        assert [int(r["tokens"]) for r in rows] == [n_prompt] + [1] * 6
        assert _sum(rows, "routed") == st.n_routed and _sum(rows, "hits") == st.n_hits
        assert _sum(rows, "misses") == st.n_misses > 0
        assert _sum(rows, "loaded_bytes") == st.bytes_loaded
        assert _sum(rows, "file_reads") == io["file_reads"] and _sum(rows, "host_hits") == io["host_hits"]
        assert _sum(rows, "read_bytes") == io["bytes_read"] > 0          # the bytes the run read from the file
        assert all(float(r["compute_ms"]) + float(r["stall_ms"]) == pytest.approx(float(r["wall_ms"]), abs=0.002)
                   for r in rows)
        assert {r["mode"] for r in rows} == {"exact"}
        assert _sum(rows, "substituted") + _sum(rows, "dropped") + _sum(rows, "shadow") + _sum(rows, "rerouted") == 0
        t = [float(r["t_ms"]) for r in rows]
        assert t == sorted(t) and t[0] > 0
    # fewer slots: more misses and more bytes read, in the decode rows too
    dec = lambda rows, c: _sum([r for r in rows if r["phase"] == "decode"], c)  # noqa: E731
    assert _sum(few, "read_bytes") > _sum(many, "read_bytes")
    assert dec(few, "misses") > dec(many, "misses") and dec(few, "read_bytes") > dec(many, "read_bytes")


def _table_total(out):
    """The --moe-stats table's total row: routed, hits, misses, MiB loaded, stall ms; and the tiers line."""
    m = re.search(r"vis-moe:\s+total\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+%\s+([\d.]+)\s+([\d.]+)", out)
    t = re.search(r"host-cache hits (\d+) \| file reads (\d+) \(([\d.]+) MiB payload", out)
    assert m and t, out[-3000:]
    return [int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])], [int(t[1]), int(t[2]), float(t[3])]


def test_cli_csv_matches_the_exit_table_and_leaves_the_text_alone(bindir, fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe-varied.gguf"      # its greedy text varies: a changed output shows
    out_csv = tmp_path / "run.csv"
    plain, _ = _cli(bindir, model, "--moe-slots", "4", "--moe-stats")
    r, out = _cli(bindir, model, "--moe-slots", "4", "--moe-stats", "--moe-csv", out_csv)
    assert r.returncode == 0 and plain.returncode == 0, out[-2000:]
    assert _text(r.stdout) == _text(plain.stdout)                    # byte-identical text with the CSV on
    rows = _rows(out_csv)
    (routed, hits, misses, mib, stall), (host, reads, payload) = _table_total(out)
    assert (_sum(rows, "routed"), _sum(rows, "hits"), _sum(rows, "misses")) == (routed, hits, misses)
    assert _sum(rows, "loaded_bytes") / 2**20 == pytest.approx(mib, abs=0.006)
    assert (_sum(rows, "host_hits"), _sum(rows, "file_reads")) == (host, reads)
    assert _sum(rows, "read_bytes") / 2**20 == pytest.approx(payload, abs=0.006)
    assert _sum(rows, "stall_ms") >= stall - 0.01                    # the table's stall, plus shadow/staged waits
    assert sum(1 for x in rows if x["phase"] == "decode") >= 6
    # an earlier --moe-csv is ours to overwrite; VIS_MOE_CSV is the same setting; an empty path is an error
    out_csv.write_text(out_csv.read_text() + "0,prompt,1,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,exact\n")
    r2, out2 = _cli(bindir, model, "--moe-slots", "4", env={"VIS_MOE_CSV": str(out_csv)})
    assert r2.returncode == 0, out2[-2000:]
    assert len(_rows(out_csv)) == len(rows)
    r3, out3 = _cli(bindir, model, "--moe-slots", "4", "--moe-csv", "", n=2)
    assert r3.returncode != 0 and "--moe-csv: expected a file path, got ''" in out3, out3[-2000:]


def test_lossy_runs_say_so_in_every_row(fixture_dir, tmp_path):
    out = tmp_path / "lossy.csv"
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4, topk=6, csv=str(out)), **KW)
    llm.eval(llm.tokenize(b"Experts route", add_bos=True))
    llm.eval([1])
    assert {r["mode"] for r in _rows(out)} == {"lossy:topk=6"}
    del llm


# --------------------------------------------------------------------------
# refusals: never over an input, never over a file that is not ours
# --------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["model", "model-upstream-path", "text", "directory", "trace"])
def test_csv_never_overwrites_what_is_not_ours(bindir, fixture_dir, tmp_path, what):
    model = fixture_dir / "qwen3moe.gguf"
    extra, slots = [], ["--moe-slots", "4"]
    if what == "model":
        target, needle = model, "it is the model file of this run"
    elif what == "model-upstream-path":     # no expert cache: the CSV alone, refused by the file's GGUF magic
        target, needle, slots = model, "it is a GGUF model file", []
    elif what == "text":
        target = tmp_path / "notes.csv"
        target.write_text("name,value\nkeep,1\n")
        needle = "it exists and is not a --moe-csv file"
    elif what == "directory":
        target, needle = tmp_path, "it is a directory"
    else:
        target = tmp_path / "same.bin"
        extra, needle = ["--moe-trace", target], "is also the --moe-trace file"
    before = None if target.is_dir() or not target.exists() else _sha(target)
    r, out = _cli(bindir, model, *slots, "--moe-csv", target, *extra, n=2)
    assert r.returncode != 0
    assert f"--moe-csv" in out and needle in out and str(target) in out, out[-2000:]
    if before is not None and what != "trace":
        assert _sha(target) == before


def test_csv_refuses_an_input_named_by_another_option(fixture_dir, tmp_path):
    """A file another option names is refused as that input (before the GGUF check would call it a model)."""
    from pyvis.runtime import shadow as sh
    from pyvis.runtime.native import VisError
    side = tmp_path / "m.shadow.gguf"
    sh.write_shadow(fixture_dir / "qwen3moe.gguf", "Q4_0", side, threads=2)
    before = _sha(side)
    with pytest.raises(VisError, match="--moe-csv: refusing to write .*it is the --moe-shadow file of this run"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4, shadow=str(side), csv=str(side)), **KW)
    assert _sha(side) == before


def test_two_live_contexts_never_share_a_csv(fixture_dir, tmp_path):
    from pyvis.runtime.native import VisError
    out = tmp_path / "one.csv"
    first = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4, csv=str(out)), **KW)
    first.eval(first.tokenize(b"Experts route", add_bos=True))
    rows = _rows(out)
    with pytest.raises(VisError, match="another context of this process is writing it"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4, csv=str(out)), **KW)
    assert _rows(out) == rows                       # not truncated
    del first
    # free again once it is freed
    again = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4, csv=str(out)), **KW)
    del again


# --------------------------------------------------------------------------
# the status line: on a terminal only
# --------------------------------------------------------------------------
def _on_a_pty(cmd, rows=24, cols=120, stats=True):
    """Run cmd with stderr on a pseudo-terminal of rows x cols: (rc, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**os.environ, "TERM": "xterm", "LLAMA_LOG_COLORS": "0"}
    p = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    got = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:        # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            got += chunk
        elif p.poll() is not None:
            break
    stdout = p.communicate(timeout=30)[0]
    os.close(master)
    return p.returncode, stdout, got.decode(errors="replace")


def test_status_line_is_drawn_on_a_terminal_and_cleared_before_the_summary(bindir, fixture_dir):
    cmd = [bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", *PROMPT, "-n", "6", "--moe-slots", "4"]
    rc, stdout, term = _on_a_pty(cmd + ["--moe-stats"])
    assert rc == 0, term[-2000:]
    m = re.search(r"vis-moe: ([\d.]+) tok/s \| hit ([\d.]+) % \| ([\d.]+) MiB/token read \| stall (\d+) % \| exact", term)
    assert m, term[-3000:]
    assert float(m[1]) > 0 and 0 <= float(m[2]) <= 100 and float(m[3]) > 0     # 4 slots of 32: it reads
    assert "\x1b[1;23r" in term                                       # the last row is kept out of the scrolling
    draw, reset, table = term.index("\x1b[24;1H"), term.rindex("\x1b[r"), term.index("expert cache stats")
    assert draw < reset < table                                       # cleared before the exit summary
    # without --moe-stats, or with stderr not a terminal: never
    rc, _, term = _on_a_pty(cmd)
    assert rc == 0 and "tok/s |" not in term and "\x1b[1;23r" not in term
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", "4", "--moe-stats", n=6)
    assert r.returncode == 0 and "expert cache stats" in out
    assert "tok/s |" not in out and "\x1b[" not in r.stderr


def test_status_line_says_lossy(bindir, fixture_dir):
    cmd = [bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", *PROMPT, "-n", "3", "--moe-slots", "4",
           "--moe-topk", "6", "--moe-stats"]
    rc, _, term = _on_a_pty(cmd)
    assert rc == 0 and re.search(r"stall \d+ % \| lossy \(topk=6\)", term), term[-2000:]


# --------------------------------------------------------------------------
# llama-server: /metrics and /props
# --------------------------------------------------------------------------
def _get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def _metric(text, name, labels=""):
    m = re.search(rf"^llamacpp:vis_moe_{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing:\n{text}"
    return float(m[1])


def _complete(port, prompt, n):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                 data=json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0,
                                                  "cache_prompt": False}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_server_metrics_and_props(bindir, fixture_dir, tmp_path):
    model = fixture_dir / "qwen3moe.gguf"
    with llama_server(bindir, model, "-c", "256", "-t", "2", "-np", "1", "--metrics", "--moe-slots", "4",
                      log=tmp_path / "server.log") as (proc, port):
        before = _get(port, "/metrics")
        _complete(port, "Experts route each token", 8)
        text = _get(port, "/metrics")
        props = json.loads(_get(port, "/props"))
    assert "llamacpp:prompt_tokens_total" in text                      # upstream's metrics are still there
    for name in ("hits_total", "misses_total", "read_bytes_total", "read_stall_seconds_total", "reads_ahead_total",
                 "lossy_events_total", "info"):
        assert f"# TYPE llamacpp:vis_moe_{name} " in text and f"# HELP llamacpp:vis_moe_{name} " in text
    assert _metric(text, "hits_total") > _metric(before, "hits_total")
    assert _metric(text, "misses_total", '{tier="storage"}') > _metric(before, "misses_total", '{tier="storage"}')
    assert _metric(text, "read_bytes_total") > _metric(before, "read_bytes_total")
    assert _metric(text, "tokens_total", '{phase="decode"}') - _metric(before, "tokens_total", '{phase="decode"}') >= 7
    assert _metric(text, "lossy_events_total", '{kind="dropped"}') == 0
    assert _metric(text, "info", '{mode="exact",detail="exact"}') == 1
    vm = props["vis_moe"]
    assert vm["mode"] == "exact" and vm["exact"] is True and vm["lossy"] == []
    assert vm["slots_per_layer"] == 4 and vm["managed_layers"] == 3 and vm["moe_layers"] == 3
    assert vm["n_expert"] == 32 and vm["n_expert_used"] == 8 and vm["kv_bytes"] > 0 and vm["slab_bytes"] > 0


def test_server_props_say_lossy(bindir, fixture_dir):
    with llama_server(bindir, fixture_dir / "qwen3moe.gguf", "-c", "256", "-t", "2", "-np", "1", "--metrics",
                      "--moe-slots", "4", "--moe-topk", "6") as (proc, port):
        props = json.loads(_get(port, "/props"))["vis_moe"]
        text = _get(port, "/metrics")
    assert props["mode"] == "lossy" and props["exact"] is False and props["lossy"] == ["topk=6"]
    assert props["n_expert_used"] == 6
    assert _metric(text, "info", '{mode="lossy",detail="lossy:topk=6"}') == 1


def test_metrics_of_the_c_api_mirror(fixture_dir):
    """The two functions patch 0014 calls, through the Python mirror: they move by what this context read."""
    def counts():
        t = capi.llama_vis_moe_metrics_text().decode()
        return (_metric(t, "read_bytes_total"), _metric(t, "misses_total", '{tier="storage"}')) if t else (0, 0)
    b0, m0 = counts()
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=4), **KW)
    llm.eval(llm.tokenize(b"Experts route", add_bos=True))
    b1, m1 = counts()
    io, st = moe.io_stats(llm), moe.stats(llm)
    assert b1 - b0 == io["bytes_read"] > 0 and m1 - m0 == io["file_reads"] == st.n_misses
    props = json.loads(capi.llama_vis_moe_props_json().decode())
    assert props["slots_per_layer"] == 4 and props["managed_layers"] == 3
    del llm


# --------------------------------------------------------------------------
# pyvis report
# --------------------------------------------------------------------------
def test_pyvis_report(fixture_dir, tmp_path, capsys):
    from pyvis.cli import main
    out = tmp_path / "r.csv"
    rows, st, io, n_prompt = _generate(fixture_dir / "qwen3moe.gguf", out, slots=4)
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    dec = [r for r in rows if r["phase"] == "decode"]
    hit = 100 * _sum(dec, "hits") / _sum(dec, "routed")
    mib = (_sum(dec, "read_bytes") + _sum(dec, "ahead_bytes")) / 2**20 / len(dec)
    assert f"{n_prompt} prompt tokens, 6 generated" in text
    assert f"hit rate {hit:.1f} %" in text and f"{mib:.2f} MiB read per token" in text
    assert f"misses {st.n_misses} " in text and "mode: exact" in text
    s = telemetry.summary(telemetry.load(out))
    assert s["decode_tokens"] == 6 and s["lossy_events"] == 0
    # the plot (matplotlib, a dependency of pyvis), as PNG or SVG by its name
    png, svg = tmp_path / "r.png", tmp_path / "r.svg"
    assert main(["report", str(out), "-o", str(png)]) == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(out), "-o", str(svg)]) == 0 and b"<svg" in svg.read_bytes()[:1000]
    with pytest.raises(SystemExit, match="written as .png or .svg"):
        main(["report", str(out), "-o", str(tmp_path / "r.pdf")])
    # not a --moe-csv file
    with pytest.raises(SystemExit, match="is not a --moe-csv file"):
        main(["report", str(fixture_dir / "qwen3moe.gguf")])
    with pytest.raises(SystemExit, match="is the input CSV"):
        main(["report", str(out), "-o", str(out)])
    assert _rows(out) == rows
