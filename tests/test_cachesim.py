"""Trace import and offline replay: ``pyvis trace import``, ``pyvis cachesim`` and the policies of
pyvis.runtime.policies (docs/policies.md).  Pure Python, no model.

The shared trace (../shared/traces/qwen3-30b-a3b-top6.route.csv, recorded from the real Qwen3-30B-A3B) lives
beside the repository, not in it: the tests that read it are skipped where it is absent.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyvis.runtime import cachesim, cachesim_replay, policies, policy_bounds
from pyvis.runtime.trace import TraceError
from pyvis.runtime.trace_csv import load_any as load, read_csv

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces" / "qwen3-30b-a3b-top6.route.csv"
needs_shared = pytest.mark.skipif(not SHARED.is_file(), reason=f"the shared trace is not beside the repo ({SHARED})")


def _pyvis(*args) -> subprocess.CompletedProcess:
    """`pyvis ARGS` in this process (a subprocess would import the bindings again for every call): exit status,
    stdout and stderr as the command line would give them."""
    from pyvis.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                rc = 1
            else:
                rc = e.code or 0
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _csv_lines(n_layer=2, n_expert=16, k=2, prompt=4, decode=24, seed=0) -> list[str]:
    """A small route trace with some locality: each token keeps one expert of the previous one."""
    rng = np.random.default_rng(seed)
    out = ["# route_trace v1", f"# model=x.gguf arch=qwen3moe n_layer={n_layer} n_expert={n_expert} n_expert_used={k}"]
    out += [f"# layer={il} expert_bytes={1 << 20} dense_bytes=0" for il in range(n_layer)]
    out.append("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes")
    prev = {il: list(rng.choice(n_expert, k, replace=False)) for il in range(n_layer)}
    for step in range(prompt + decode):
        for il in range(n_layer):
            keep = prev[il][:1] if rng.random() < 0.6 else []
            rest = [e for e in rng.permutation(n_expert).tolist() if e not in keep][:k - len(keep)]
            cur = keep + rest
            prev[il] = cur
            w = rng.dirichlet(np.ones(k))
            for slot, (e, x) in enumerate(zip(cur, sorted(w, reverse=True))):
                out.append(f"0,{int(step >= prompt)},{step},{il},{slot},{e},{x:.6f},0,{1 << 20}")
    return out


def _row(lines: list[str], i: int) -> list[str]:
    return lines[i].split(",")


def _field(lines: list[str], i: int, col: int, value: str) -> list[str]:
    """`lines` with column `col` of line index i (file line i + 1) set to `value`."""
    f = _row(lines, i)
    f[col] = value
    return lines[:i] + [",".join(f)] + lines[i + 1:]


@pytest.fixture
def small_csv(tmp_path) -> Path:
    p = tmp_path / "small.route.csv"
    p.write_text("\n".join(_csv_lines()) + "\n")
    return p


# ---------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------
def test_csv_import_round_trip(small_csv, tmp_path):
    t = read_csv(small_csv)
    assert (t.n_layer, t.n_expert, t.k) == (2, 16, 2)
    assert len(np.unique(t.ubatch)) == 28 and int(t.phase.sum()) == 24 * 2   # 4 prompt + 24 decode tokens, 2 layers
    assert t.expert_bytes.tolist() == [1 << 20, 1 << 20]
    rows = [ln.split(",") for ln in _csv_lines() if not ln.startswith(("#", "turn"))]
    assert t.ids.reshape(-1).tolist() == [int(r[5]) for r in rows]
    assert np.allclose(t.weights.reshape(-1), [float(r[6]) for r in rows], atol=1e-6)
    out = tmp_path / "small.npz"
    r = _pyvis("trace", "import", small_csv, "-o", out)
    assert r.returncode == 0, r.stderr
    u = load(out)
    for c in ("ubatch", "layer", "pos", "ids", "phase", "expert_bytes"):
        assert np.array_equal(getattr(u, c), getattr(t, c)), c
    assert np.array_equal(u.weights, t.weights)


def test_import_never_overwrites_its_input(small_csv):
    before = small_csv.read_bytes()
    r = _pyvis("trace", "import", small_csv, "-o", small_csv)
    assert r.returncode != 0 and "is the input trace" in r.stderr, r.stderr
    assert small_csv.read_bytes() == before


@pytest.mark.parametrize("edit, message", [
    (lambda ls: ls[:-1], r"small\.route\.csv:\d+: the last \(token, layer\) has 1 of 2 slots \(truncated file\?\)"),
    (lambda ls: ls[:-1] + [ls[-1][:5]], r"small\.route\.csv:\d+: expected 7 or more columns, got 3"),
    (lambda ls: ls[:4] + ["turn,phase,step,layer,expert,slot,weight"] + ls[5:], r"small\.route\.csv:5: wrong header"),
    (lambda ls: ["# something else"] + ls[1:], r"small\.route\.csv: not a routing trace: .* CSV\s+route trace, first line"),
    (lambda ls: ["# route_trace v2"] + ls[1:], r"small\.route\.csv:1: not a CSV route trace \(expected the first line"),
    (lambda ls: ls[:1] + ls[2:], r"small\.route\.csv: the preamble has no model line"),
    (lambda ls: _field(ls, 6, 5, "99"), r"small\.route\.csv:7: expert 99 is out of range 0\.\.15"),
    (lambda ls: _field(ls, 6, 3, "7"), r"small\.route\.csv:7: layer 7 is out of range 0\.\.1"),
    (lambda ls: _field(ls, 7, 1, "x"), r"small\.route\.csv:8: phase is not a number: 'x'"),
    (lambda ls: _field(ls, 6, 4, "0"), r"small\.route\.csv:6: a \(token, layer\) must list slots 0\.\.1 in order"),
    (lambda ls: _field(ls, 6, 5, _row(ls, 5)[5]), r"small\.route\.csv:6: a token selects the same expert twice"),
])
def test_malformed_csv_is_a_clear_error(tmp_path, edit, message):
    p = tmp_path / "small.route.csv"
    p.write_text("\n".join(edit(_csv_lines())) + "\n")
    with pytest.raises(TraceError, match=message):
        load(p)
    r = _pyvis("cachesim", p, "--slots", "4")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "small.route.csv" in r.stderr, r.stderr


# ---------------------------------------------------------------------------
# the simulator's policies
# ---------------------------------------------------------------------------
def _random_requests(seed: int, n: int = 300, E: int = 24, k: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    hot = rng.permutation(E)[:8]
    return [list(dict.fromkeys(int(rng.choice(hot) if rng.random() < 0.5 else rng.integers(E)) for _ in range(k)))
            for _ in range(n)]


@pytest.mark.parametrize("capacity", [2, 3, 6, 12])
def test_policy_replay_of_lru_is_lru_misses(capacity):
    """The generic replay with the lru policy is the runtime-tested lru_misses, passes, streaming and lending
    included (capacity 2 and 3 < the request size: several passes)."""
    for seed in range(3):
        req = _random_requests(seed)
        streamed = [i % 17 == 5 for i in range(len(req))]
        for kw in ({}, {"streamed": streamed}, {"streamed": streamed, "lent": True}):
            a, b = [], []
            assert cachesim.policy_misses(req, capacity, policies.make("lru", capacity), a, **kw) == \
                cachesim.lru_misses(req, capacity, b, **kw), (seed, kw)
            assert a == b


def test_lfu_keeps_the_frequent_expert():
    seq = [[1], [1], [1], [2], [3], [1], [2], [3], [1]]
    # LRU, 2 slots: 1 . . 2 3(-1) 1(-2) 2(-3) 3(-1) 1(-2): 7 loads; LFU keeps 1: 1 . . 2 3(-2) . 2(-3) 3(-2) .: 5
    assert cachesim.lru_misses(seq, 2) == 7
    assert cachesim.policy_misses(seq, 2, policies.make("lfu", 2)) == 5
    # and forgets it once it stops being used (decay): 1 used 40 times, then 2 and 3 30 times each; without the
    # decay 1 would stay and 4 would evict 2 (30 uses < 40)
    seq = [[1]] * 40 + [[2], [3]] * 30 + [[4], [2], [3]]
    per: list[int] = []
    cachesim.policy_misses(seq, 3, policies.make("lfu", 3), per)
    assert per[-3:] == [1, 0, 0]          # 4 evicts the stale 1


def test_every_policy_is_a_valid_cache():
    """Each policy: no more loads than requests, never fewer than Belady's optimum (the optimum with bypass for a
    policy that may decline a miss), deterministic."""
    req = _random_requests(4)
    opt, opt_bypass = cachesim.belady_misses(req, 6), cachesim.belady_bypass_misses(req, 6)
    for name in policies.POLICIES:
        p = policies.make(name, 6)
        m = cachesim.policy_misses(req, 6, p)
        admits_all = type(p).admit is policies.Policy.admit
        assert (opt if admits_all else opt_bypass) <= m <= sum(len(s) for s in req), name
        assert m == cachesim.policy_misses(req, 6, policies.make(name, 6)), name
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        policies.make("nope", 4)


def test_belady_with_bypass_bounds_admission():
    """The optimum that may decline a miss: capacity 1, [1] [2] [1] reads 2 once and keeps 1 (2 loads, Belady 3);
    below Belady on random requests and never below one load per distinct expert.  The simulator's admission
    filter (lfu-admit) declines misses for real: its loads differ from LFU's on the same requests."""
    assert cachesim.belady_misses([[1], [2], [1]], 1) == 3
    per: list[int] = []
    assert cachesim.belady_bypass_misses([[1], [2], [1]], 1, per) == 2 and per == [1, 1, 0]
    for seed in range(3):
        req = _random_requests(seed)
        for cap in (4, 6, 12):
            b = cachesim.belady_bypass_misses(req, cap)
            assert len({e for s in req for e in s}) <= b < cachesim.belady_misses(req, cap), (seed, cap)
    req = _random_requests(1)
    assert cachesim.policy_misses(req, 6, policies.make("lfu-admit", 6)) != \
        cachesim.policy_misses(req, 6, policies.make("lfu", 6))
    with pytest.raises(ValueError, match="capacity"):
        cachesim.belady_bypass_misses(req, 0)


def test_hawkeye_learns_what_the_optimum_keeps():
    """A cyclic scan of 5 experts through 3 slots: LRU and LFU evict the expert needed next every time (every use
    misses); Belady keeps two and rotates one.  Hawkeye, learning from OPTgen which experts the optimum keeps,
    misses markedly less (an LFU with a no-op predictor would miss as LFU does)."""
    seq = [[i % 5] for i in range(250)]
    lfu = cachesim.policy_misses(seq, 3, policies.make("lfu", 3))
    hawk = cachesim.policy_misses(seq, 3, policies.make("hawkeye", 3))
    assert lfu == 250 and hawk < 0.85 * lfu
    assert hawk >= cachesim.belady_misses(seq, 3)


# ---------------------------------------------------------------------------
# the shared trace: the README's numbers
# ---------------------------------------------------------------------------
@needs_shared
def test_shared_trace_reproduces_its_readme():
    """Decode hits with the prompt warming each cache: LRU loading one expert at a time (the recording engine's
    cache) and Belady's optimum give the README's table; the runtime's LRU (a token's experts resident together)
    hits a little more often."""
    t = load(SHARED)
    assert (t.n_layer, t.n_expert, t.k) == (48, 128, 6) and int((t.phase == 1).sum()) == 128 * 48
    readme = {12: (49.5, 67.3), 16: (59.0, 75.8), 24: (71.9, 85.6), 32: (81.1, 91.2)}
    for slots, (lru_hit, opt_hit) in readme.items():
        res = cachesim_replay.replay(t, slots, "lru", per_expert=True)
        uses = sum(r.uses for r in res)
        assert uses == 128 * 48 * 6
        assert round(100 * (1 - sum(r.misses for r in res) / uses), 1) == lru_hit, slots
        assert round(100 * (1 - sum(r.belady for r in res) / uses), 1) == opt_hit, slots
        tok = cachesim_replay.replay(t, slots, "lru")
        assert sum(r.misses for r in tok) < sum(r.misses for r in res)


# ---------------------------------------------------------------------------
# pyvis cachesim
# ---------------------------------------------------------------------------
def test_cachesim_cli(small_csv, tmp_path):
    r = _pyvis("cachesim", small_csv, "--slots", "4", "--policy", "lfu", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    t = load(small_csv)
    res = cachesim_replay.replay(t, 4, "lfu")
    assert s["misses"] == sum(x.misses for x in res) and s["belady_misses"] == sum(x.belady for x in res)
    assert s["hit_rate"] == pytest.approx(1 - s["misses"] / s["uses"])
    assert s["policy"] == "lfu" and s["slots"] == 4 and s["decode_steps"] == 24
    assert s["bytes_per_token"] == pytest.approx(s["misses"] * (1 << 20) / 24)
    assert [x["misses"] for x in s["layers"]] == [x.misses for x in res]
    # the budget: 2 layers x 1 MiB per slot; 8 MiB = 4 slots
    b = _pyvis("cachesim", small_csv, "--budget", "8.5", "--policy", "lfu", "--json")
    assert json.loads(b.stdout)["misses"] == s["misses"] and json.loads(b.stdout)["slots"] == 4
    # default = the runtime's default policy
    d = json.loads(_pyvis("cachesim", small_csv, "--slots", "4", "--policy", "default", "--json").stdout)
    lru = json.loads(_pyvis("cachesim", small_csv, "--slots", "4", "--policy", policies.DEFAULT, "--json").stdout)
    assert d["misses"] == lru["misses"] and d["policy"] == policies.DEFAULT
    # the text report: per layer and overall
    txt = _pyvis("cachesim", small_csv, "--slots", "4", "--policy", "lfu")
    assert txt.returncode == 0 and f"misses {s['ratio_to_belady']:.2f}x Belady's" in txt.stdout
    assert "bytes read per decode token" in txt.stdout
    # strict arguments
    for bad in (["--slots", "0"], ["--slots", "4", "--policy", "fifo"], ["--budget", "-1"], []):
        e = _pyvis("cachesim", small_csv, *bad)
        assert e.returncode == 2 and "error:" in e.stderr, bad
    e = _pyvis("cachesim", small_csv, "--budget", "0.5")
    assert e.returncode == 1 and "holds no expert per layer" in e.stderr


def test_cachesim_budget_needs_expert_sizes(tmp_path, small_csv):
    p = tmp_path / "nosizes.route.csv"
    p.write_text("\n".join(ln for ln in _csv_lines() if "expert_bytes=" not in ln) + "\n")
    e = _pyvis("cachesim", p, "--budget", "8")
    assert e.returncode == 1 and "--expert-bytes" in e.stderr, e.stderr
    ok = _pyvis("cachesim", p, "--budget", "8", "--expert-bytes", str(1 << 20), "--json")
    assert json.loads(ok.stdout)["slots"] == 4


def test_cachesim_plot(small_csv, tmp_path):
    png = tmp_path / "curves.png"
    r = _pyvis("cachesim", small_csv, "--slots", "4", "--plot", png, "--plot-slots", "2,4,8")
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = small_csv.read_bytes()
    r = _pyvis("cachesim", small_csv, "--slots", "4", "--plot", small_csv)
    assert r.returncode == 1 and "is the input trace" in r.stderr and small_csv.read_bytes() == before


def test_window_bound_reaches_belady():
    """policy_bounds.WindowBelady, told the whole future, is Belady's optimum; told one request, it can only keep what
    that request uses and otherwise follows LFU, missing more."""
    for seed in range(3):
        req = _random_requests(seed)
        opt = cachesim.belady_misses(req, 6)
        assert cachesim.policy_misses(req, 6, policy_bounds.WindowBelady(req, len(req))) == opt
        assert cachesim.policy_misses(req, 6, policy_bounds.WindowBelady(req, 1)) > opt
