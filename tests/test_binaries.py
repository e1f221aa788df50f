"""Every fixture loads and generates through our build's binaries."""
from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import llama_server, run


def test_llama_cli_generates(bindir, text_model):
    r = run([bindir / "llama-cli", "-m", text_model, "-p", "Hello, experts", "-n", "8", "-st",
             "--temp", "0", "-c", "256", "-t", "2", "--no-warmup"], timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "> Hello, experts" in r.stdout
    assert "Generation:" in r.stdout  # the tool's own speed line after a finished turn


def test_llama_cli_names_the_fork(bindir, fixture_dir):
    """patch 0001: the system_info line of every tool names the fork and its upstream commit."""
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "hi", "-n", "1", "-st", "-c", "128",
             "-v"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "VIS_MOE : VERSION = 0.1.0 | UPSTREAM = 0c1e570 |" in r.stdout + r.stderr


def test_llama_bench_runs(bindir, fixture_dir):
    r = run([bindir / "llama-bench", "-m", fixture_dir / "qwen3moe.gguf", "-p", "16", "-n", "4", "-r", "1",
             "-t", "2", "-o", "json"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert {row["n_prompt"] for row in rows} >= {16}
    assert all(row["avg_ts"] > 0 for row in rows)
    assert all(row["vis_moe"] == "" for row in rows)


def test_llama_bench_names_the_moe_settings_it_ran_with(bindir, fixture_dir):
    """llama-bench takes the --moe-* settings from VIS_MOE_* (patch 0012): its vis_moe field and markdown column
    say which, in table order; without any, the markdown table has no such column."""
    env = {"VIS_MOE_PREDICT": "coact", "VIS_MOE_SLOTS": "4"}
    args = [bindir / "llama-bench", "-m", fixture_dir / "qwen3moe.gguf", "-p", "16", "-n", "2", "-r", "1", "-t", "2"]
    r = run([*args, "-o", "json"], timeout=180, extra_env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {row["vis_moe"] for row in json.loads(r.stdout)} == {"slots=4 predict=coact"}
    r = run(args, timeout=180, extra_env=env)
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("| model"))
    assert "vis_moe" in header and "slots=4 predict=coact" in r.stdout, r.stdout
    r = run(args, timeout=180)
    assert r.returncode == 0 and "vis_moe" not in r.stdout, r.stdout


def test_llama_perplexity_runs(bindir, fixture_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. " * 40).strip())
    r = run([bindir / "llama-perplexity", "-m", fixture_dir / "mixtral.gguf", "-f", text, "-c", "64", "-b", "64",
             "-t", "2", "--chunks", "2"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Final estimate: PPL" in r.stdout + r.stderr


def test_llama_server_completes(bindir, fixture_dir, tmp_path):
    with llama_server(bindir, fixture_dir / "deepseek2.gguf", "-c", "512", "-t", "2", "-np", "2",
                      log=tmp_path / "server.log") as (_, port):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                     data=json.dumps({"prompt": "Experts are", "n_predict": 6,
                                                      "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
        assert out["tokens_predicted"] == 6
        assert isinstance(out["content"], str)
