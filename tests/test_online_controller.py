"""The online controller (issue #24 item 3, VIS_MOE_ONLINE=on; docs/planning.md#online-controller).

llama-server with -np 4 serves concurrent requests of different lengths (contexts grow), then short ones that
replace them (their cells are removed: the KV cache empties).  With the controller on, the expert slots shrink as
the KV cache grows and grow back as it empties; every request is answered and every greedy text is byte-identical to
the same requests served with the controller off and with every expert resident (upstream's path), with flash
attention on and off (off: the V cache is transposed, its pages span cells of many rows).  The controller is not a
no-op: with the same budget it serves from more slots than the fixed plan, so the slot hits differ; and its run stays
inside a memory cgroup of the budget.

The fixture is all F32 (outputs are then bit-identical however a ubatch is cut, docs/planning.md#outputs), so that
the batches the server happens to form do not change the texts, and its KV cache is large per token (12 KiB, a slot
row is 1.1 MiB) so that a few hundred tokens move slots.
"""
from __future__ import annotations

import json
import re
import threading
import urllib.request
from pathlib import Path

import pytest

import pyvis.fixtures as fx
from conftest import llama_server
from test_paging import memory_cgroup

SPEC = fx.ModelSpec(name="online", arch="qwen3moe", n_layer=3, n_embd=128, n_head=8, n_head_kv=8, head_dim=128,
                    n_ff=256, n_ff_exp=256, n_expert=32, n_expert_used=4, expert_type="F32", weight_type="F32",
                    embd_type="F32", extra={"untied_output": True, "embd_std": fx.VARIED_EMBD_STD})
BUDGET = 172  # MiB: 1 slot per layer with the whole KV cache (-c 4096), 18 at its floor (one sequence of 1024)
SERVER = ["-c", "4096", "-np", "4", "-t", "2", "-ub", "64", "-b", "64", "--cache-ram", "0", "--metrics"]
WORDS = "the quick brown fox jumps over a lazy dog while experts route every token to a few of many".split()
LONG = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n)) for i, n in enumerate([700, 500, 800, 400])]
SHORT = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(20)) for i in range(4)]
RESIZE = re.compile(r"^vis-moe: resize: slots (\d+) -> (\d+) per layer \((.*)\)$", re.M)


@pytest.fixture(scope="module")
def model(fixture_dir) -> Path:
    path = fixture_dir / f"online-{SPEC.key()}.gguf"
    if not path.exists():
        fx.write_model(SPEC, path, fast_quant=True)
    return path


def _complete(port, prompt, n=12, cache=True):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                 data=json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0,
                                                  "cache_prompt": cache}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as r:
        assert r.status == 200
        return json.loads(r.read())["content"]


def _hits(port) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(m[1]) for m in re.finditer(r"^llamacpp:vis_moe_hits_total\S* (\S+)$", text, re.M))


def _serve(bindir, model, log, extra=(), env=None, wrap=None):
    """Two rounds of four concurrent requests (long prompts, then short ones that replace them in the slots): the
    texts in order, and the slot hits the server counted."""
    texts, hits = [], None
    with llama_server(bindir, model, *SERVER, *extra, log=log, env=env, wrap=wrap) as (proc, port):
        # the long prompts at once; the longest again, alone, generating on (decode steps whose graphs are reused
        # while its context grows below top-k slots: a graph built at another slot limit must not be); the short
        # ones replace them.  The long generation recomputes its prompt (cache_prompt false): its cached cells came
        # from batches the requests' timing formed, and upstream's attention is not bit-identical across those
        # (measured: upstream's own text of 200 tokens differed between two runs), which 200 tokens would amplify
        for prompts, n in ((LONG, 12), (LONG[2:3], 200), (SHORT, 12)):
            out, errors = {}, []

            def go(i, p):
                try:
                    out[i] = _complete(port, p, n, cache=n == 12)
                except Exception as e:  # noqa: BLE001 - reported below: a request must never be lost
                    errors.append(f"request {i}: {e!r}")
            threads = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(prompts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors and len(out) == len(prompts), (errors, Path(log).read_text()[-3000:])
            texts += [out[i] for i in range(len(prompts))]
        hits = _hits(port)
    return texts, hits


@pytest.mark.parametrize("fa", ["on", "off"])
def test_resizes_under_concurrent_load_lose_no_request_and_change_no_text(bindir, model, tmp_path, fa):
    # the plan never exceeds its budget: the controller's run inside a memory cgroup of the budget (killed if not)
    with memory_cgroup(BUDGET << 20) as (wrap, peak):
        on, m_on = _serve(bindir, model, tmp_path / "on.log", ["-fa", fa, "--moe-mem", str(BUDGET)],
                          env={"VIS_MOE_ONLINE": "on"}, wrap=wrap)
        assert 0 < peak() <= BUDGET << 20
    log = (tmp_path / "on.log").read_text()
    resizes = [(int(a), int(b), why) for a, b, why in RESIZE.findall(log)]
    # both directions: the contexts grew (shrinks), then the short prompts replaced them (a growth)
    assert any(b < a for a, b, _ in resizes), log[-3000:]
    assert any(b > a for a, b, _ in resizes), log[-3000:]
    # each line names its reason: the KV cache's resident bytes and cells
    assert all(re.match(r"KV \d+ -> \d+ MiB: \d+ cells used", why) for _, _, why in resizes), resizes
    # the plan: slots for the KV cache's floor, and never fewer than with the whole KV cache resident
    start = re.search(r"resize: slots (\d+) per layer \(start: .*the plan: (\d+) slots with the whole KV cache, "
                      r"(\d+) at its floor", log)
    assert start and int(start[2]) < int(start[3]), log[-3000:]
    assert all(int(start[2]) <= b <= int(start[3]) for _, b, _ in resizes)

    off, m_off = _serve(bindir, model, tmp_path / "off.log", ["-fa", fa, "--moe-mem", str(BUDGET)],
                        env={"VIS_MOE_ONLINE": "off"})
    assert "resize:" not in (tmp_path / "off.log").read_text()
    assert len(set(on)) == 9, on  # the texts differ between requests: a mix-up would be seen
    assert on == off
    if fa == "on":  # and upstream's, every expert resident (once: the same texts)
        assert on == _serve(bindir, model, tmp_path / "resident.log", ["-fa", fa])[0]
    # not a no-op: the controller served from more slots than the fixed plan (1 slot per layer): more hits
    assert m_on > m_off, (m_on, m_off)


def test_online_is_refused_where_it_cannot_work(bindir, model, tmp_path):
    from conftest import run
    r = run([bindir / "llama-cli", "-m", model, "-p", "hi", "-n", "2", "-st", "-c", "256", "--moe-slots", "4"],
            extra_env={"VIS_MOE_ONLINE": "on"})
    assert r.returncode != 0 and "VIS_MOE_ONLINE=on needs a --moe-mem budget" in r.stdout + r.stderr
    r = run([bindir / "llama-cli", "-m", model, "-p", "hi", "-n", "2", "-st", "-c", "256", "--moe-slots", "4"],
            extra_env={"VIS_MOE_ONLINE": "maybe"})
    assert r.returncode != 0 and "VIS_MOE_ONLINE" in r.stdout + r.stderr and "maybe" in r.stdout + r.stderr


@pytest.mark.parametrize("fa", [1, 0])
def test_kv_pages_are_released_exactly(model, tmp_path, fa):
    """Sequence 0 (900 words) is removed after sequence 1 (40 words) was served, then sequence 1 generates 24 tokens
    into the cells sequence 0 left (one unified stream): with VIS_MOE_ONLINE=on those pages were dropped (they read
    as zeros), off they hold sequence 0's stale values.  The logits are bit-identical, with flash attention on and off
    (off: the V cache is transposed).  And the pages really go: the KV cache is not resident when the context is
    made, and removing the sequence gives its ~10 MiB back (off: nothing)."""
    import subprocess
    import sys
    import numpy as np
    probe = Path(__file__).with_name("online_kv_probe.py")
    rss = {}
    for mode in ("on", "off"):
        r = subprocess.run([sys.executable, str(probe), str(model), str(fa), str(tmp_path / f"{mode}.npy")],
                           capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                              "VIS_MOE_ONLINE": mode})
        assert r.returncode == 0, r.stderr[-3000:]
        rss[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert np.array_equal(np.load(tmp_path / "on.npy"), np.load(tmp_path / "off.npy"))
    kv_kib = 2048 * 12  # the context's KV cache: 2048 cells of 12 KiB
    assert rss["off"]["made"] - rss["on"]["made"] > kv_kib * 3 // 4, rss       # not written at creation
    # ~900 cells dropped by seq_rm: K and V with flash attention; without it the transposed V's pages each span all
    # 2048 cells, sequence 1's among them, so only K's half goes
    assert rss["on"]["long"] - rss["on"]["removed"] > (8 if fa else 4) * 1024, rss
    assert rss["off"]["long"] - rss["off"]["removed"] < 1024, rss


def _rss_anon_kib(pid) -> int:
    m = re.search(r"^RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m[1])


def test_staging_leaves_no_pages_in_the_slots_the_controller_gave_away(bindir, model, tmp_path):
    """Staged prefill streaming writes its buffers over whole slabs, the slots above the controller's limit too
    (vis-moe-stage.h).  With every prompt ubatch streaming (VIS_MOE_STREAM_PASSES=1), three long prompts grow the KV
    cache and shrink the slots, then a fourth streams: the server's anonymous memory must end where it ends when
    streaming goes through the page cache instead (VIS_MOE_STREAM_STAGE=off), not the ~16 MiB of staged pages above
    the limit higher, and the texts are the same.  The staged arm must really have staged (else it proves nothing)."""
    out = {}
    for arm, extra_env in (("staged", {}), ("mapped", {"VIS_MOE_STREAM_STAGE": "off"})):
        log = tmp_path / f"{arm}.log"
        env = {"VIS_MOE_ONLINE": "on", "VIS_MOE_STREAM_PASSES": "1", **extra_env}
        with llama_server(bindir, model, *SERVER, "--moe-mem", BUDGET, "--moe-stats", log=log, env=env) as (proc, port):
            texts = [_complete(port, p, 4) for p in LONG]
            rss = _rss_anon_kib(proc.pid)
        text = log.read_text()
        shrunk = [int(m[2]) for m in RESIZE.finditer(text)]
        assert shrunk and min(shrunk) < 23 // 2, text[-3000:]  # the KV cache took most of the slabs' memory
        out[arm] = (texts, rss, text)
    assert out["staged"][0] == out["mapped"][0]
    assert re.search(r"vis-moe: staged streaming: [1-9]\d* layers", out["staged"][2]), out["staged"][2][-3000:]
    assert "staged streaming" not in out["mapped"][2]
    assert out["staged"][1] - out["mapped"][1] < 6 * 1024, (out["staged"][1], out["mapped"][1])
