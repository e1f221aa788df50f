"""The configurator's cost model from measured quantities (issue #24 item 1, docs/planning.md#cost-model):
llama_vis_moe_cost_probe times the compute side through the ggml backend once per (weight type, shape, threads) and
caches it next to the bandwidth probe; the knobs override it; a cache line that does not parse is probed again with
a warning; `pyvis plan --json` carries the probed numbers and prices with them.  No timing is asserted: the
arithmetic of the model is (more slots: faster decode; a smaller ubatch: more passes priced; the probed compute
reaches the prefill price)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MIB = 1 << 20
KNOBS = ("VIS_MOE_READ_MBPS", "VIS_MOE_MEM_MBPS", "VIS_MOE_TOKEN_NS_PER_MIB", "VIS_MOE_PASS_US", "VIS_MOE_PASS_TOKEN_US",
         "VIS_MOE_PROBE_CACHE")
# the probe in a fresh process (the settings are read from its environment): the cost dict as JSON
PROBE = """
import json, sys
from pyvis.runtime import native
kw = json.loads(sys.argv[2])
try:
    print(json.dumps(native.cost_probe(sys.argv[1], **kw)))
except native.VisError as e:
    print("ERROR", e)
"""
SHAPE = dict(type_=0, n_embd=128, n_ff_exp=128, n_expert_used=4, n_threads=2)


def _probe(model, cache: Path, shape=SHAPE, **env):
    e = {k: v for k, v in os.environ.items() if k not in KNOBS}
    # the read probe is not under test here; the cache is written whatever the machine's load (auto skips it on a
    # busy machine, which the suite's machine may be)
    e.update(XDG_CACHE_HOME=str(cache), VIS_MOE_READ_MBPS="400", VIS_MOE_PROBE_CACHE="on")
    e.update(env)
    r = subprocess.run([sys.executable, "-c", PROBE, str(model), json.dumps(shape)], capture_output=True, text=True,
                       env=e, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip().splitlines()[-1]
    return (out if out.startswith("ERROR") else json.loads(out)), r.stderr


def _lines(cache: Path) -> list[str]:
    f = cache / "vis-moe" / "compute"
    return f.read_text().splitlines() if f.exists() else []


@pytest.fixture(scope="module")
def model(medium_model) -> Path:
    """The file the read probe would read (VIS_MOE_READ_MBPS skips it here); the compute probe takes its shape
    from the arguments."""
    return medium_model


def test_probed_once_cached_and_reused_and_a_new_shape_probes_again(model, tmp_path):
    c1, _ = _probe(model, tmp_path)
    assert c1["probed"] == 1 and c1["mem_bps"] > 0 and c1["token_byte_s"] > 0
    assert c1["pass_s"] >= 0 and c1["pass_token_s"] >= 0
    lines = _lines(tmp_path)
    assert len(lines) == 1 and lines[0].startswith("cpu-f32-e128-f128-k4-t2 ")
    c2, _ = _probe(model, tmp_path)       # a second start reads the cache: the same numbers, no new line
    assert c2 == c1 and _lines(tmp_path) == lines
    # every number comes from the cache line (a re-probe would not repeat the floats)
    vals = [float(x) for x in lines[0].split()[1:]]
    assert vals == pytest.approx([c1["mem_bps"], c1["token_byte_s"], c1["pass_s"], c1["pass_token_s"]], rel=1e-6)
    c3, _ = _probe(model, tmp_path, shape=SHAPE | dict(n_embd=256))   # another shape: probed again, appended
    assert c3["probed"] == 1 and len(_lines(tmp_path)) == 2 and _lines(tmp_path)[1].startswith("cpu-f32-e256-")
    _probe(model, tmp_path, shape=SHAPE | dict(n_threads=1))          # another thread count too
    assert len(_lines(tmp_path)) == 3


def test_the_knobs_override_each_number_and_all_four_skip_the_probe(model, tmp_path):
    knobs = dict(VIS_MOE_MEM_MBPS="5000", VIS_MOE_TOKEN_NS_PER_MIB="3000", VIS_MOE_PASS_US="40",
                 VIS_MOE_PASS_TOKEN_US="0.5")
    c, _ = _probe(model, tmp_path, **knobs)
    assert c["probed"] == 0 and not _lines(tmp_path)                  # nothing timed, nothing cached
    assert c["mem_bps"] == pytest.approx(5000 * MIB) and c["token_byte_s"] == pytest.approx(3000e-9 / MIB)
    assert c["pass_s"] == pytest.approx(40e-6) and c["pass_token_s"] == pytest.approx(0.5e-6)
    c1, _ = _probe(model, tmp_path, VIS_MOE_PASS_US="40")             # one knob: the rest is probed
    assert c1["probed"] == 1 and c1["pass_s"] == pytest.approx(40e-6) and len(_lines(tmp_path)) == 1
    cached = float(_lines(tmp_path)[0].split()[3])
    assert cached != pytest.approx(40e-6)                              # the cache keeps the probe's own number


def test_probe_cache_off_times_every_start(model, tmp_path):
    c1, _ = _probe(model, tmp_path, VIS_MOE_PROBE_CACHE="off")
    c2, _ = _probe(model, tmp_path, VIS_MOE_PROBE_CACHE="off")
    assert c1["probed"] == c2["probed"] == 1 and not _lines(tmp_path)
    _probe(model, tmp_path)                                           # on: cached, and off then ignores the cache
    c3, _ = _probe(model, tmp_path, VIS_MOE_PROBE_CACHE="off")
    assert len(_lines(tmp_path)) == 1 and c3["mem_bps"] != float(_lines(tmp_path)[0].split()[1])


@pytest.mark.parametrize("var,value", [("VIS_MOE_MEM_MBPS", "fast"), ("VIS_MOE_TOKEN_NS_PER_MIB", "-1"),
                                       ("VIS_MOE_PASS_US", "1e9"), ("VIS_MOE_PASS_TOKEN_US", "2us"),
                                       ("VIS_MOE_PROBE_CACHE", "sometimes")])
def test_a_bad_knob_is_an_error_naming_it(model, tmp_path, var, value):
    c, _ = _probe(model, tmp_path, **{var: value})
    assert isinstance(c, str) and c.startswith("ERROR") and var in c and "fix or unset" in c


@pytest.mark.parametrize("garbage", ["cpu-f32-e128-f128-k4-t2 nan 1 2 3", "cpu-f32-e128-f128-k4-t2 12 abc",
                                     "cpu-f32-e128-f128-k4-t2 1 2 3 4 5", "cpu-f32-e128-f128-k4-t2 -5 1e-11 1e-5 0"])
def test_a_cache_line_that_does_not_parse_is_probed_again_with_a_warning(model, tmp_path, garbage):
    f = tmp_path / "vis-moe" / "compute"
    f.parent.mkdir(parents=True)
    f.write_text("\x00\x01 binary junk\n" + garbage + "\n")
    c, err = _probe(model, tmp_path)
    assert c["probed"] == 1 and c["mem_bps"] > 0
    assert str(f) in err and "do not parse; probing again" in err, err[-1500:]
    lines = _lines(tmp_path)
    assert len(lines) == 3 and lines[-1].startswith("cpu-f32-e128-f128-k4-t2 ")
    c2, err2 = _probe(model, tmp_path)    # the good line appended after it wins from now on: no warning, no probe
    assert c2 == c and "do not parse" not in err2 and len(_lines(tmp_path)) == 3


# the model's arithmetic (llama_vis_moe_configure with a given cost): a medium-fixture-like request
COST = dict(read_bps=400 * MIB, mem_bps=10000 * MIB, pass_s=50e-6, pass_token_s=1e-6, token_s=0.0, stream_passes=8,
            prompt_tokens=512, gen_tokens=128, token_byte_s=1e-11)
REQ = dict(budget=200 * MIB, resident_bytes=20 * MIB, kv_bytes=4 * MIB, expert_bytes=int(0.8 * MIB),
           n_managed_layers=4, n_expert=128, n_expert_used=4, unified=1, host_mib=-1, n_slots=0, no_staging=1)
SHAPE_RQ = dict(n_vocab=49152, n_embd=512, n_ff_exp=512)


def _priced(budget_mib=200, u=128, **cost):
    from pyvis.runtime import native
    c = native.configure(REQ | dict(budget=budget_mib * MIB), **SHAPE_RQ, n_ubatch=u, n_ubatch_min=u,
                         cost=COST | cost)
    assert c["ok"], c
    return c


def test_more_slots_are_priced_faster():
    d = [(_priced(b)["plan"]["n_slots"], _priced(b)["decode_tps"]) for b in (180, 240, 300, 400)]
    assert [s for s, _ in d] == sorted(s for s, _ in d) and d[0][0] < d[-1][0]
    assert all(t0 < t1 for (_, t0), (_, t1) in zip(d, d[1:]))


def test_a_smaller_ubatch_prices_more_passes():
    """Below the slots a ubatch routes to, a smaller ubatch runs more passes in all (more ubatches, each with its
    extra passes; streaming off): raising pass_s slows the prefill of -ub 32 by more than that of -ub 256."""
    def slowdown(u):
        a, b = _priced(200, u, pass_s=0.0, stream_passes=0), _priced(200, u, pass_s=5e-3, stream_passes=0)
        assert a["plan"]["n_slots"] == b["plan"]["n_slots"] < 64
        return 1 / b["prefill_tps"] - 1 / a["prefill_tps"]
    assert slowdown(32) > slowdown(256) > 0


def test_the_probed_compute_reaches_the_price():
    """token_byte_s prices prefill compute (doubling it slows prefill, decode unchanged); mem_bps prices decode."""
    a, b = _priced(token_byte_s=1e-11), _priced(token_byte_s=2e-11)
    assert b["prefill_tps"] < a["prefill_tps"] and b["decode_tps"] == pytest.approx(a["decode_tps"])
    c = _priced(mem_bps=20000 * MIB)
    assert c["decode_tps"] > a["decode_tps"]


def test_pyvis_plan_json_carries_the_probe_and_prices_with_it(model, tmp_path):
    """`pyvis plan --json`: 'cost' is the probe's (probed 1, the cache's numbers); a knob moves the prediction."""
    env = {k: v for k, v in os.environ.items() if k not in KNOBS} | dict(XDG_CACHE_HOME=str(tmp_path),
                                                                          VIS_MOE_READ_MBPS="400",
                                                                          VIS_MOE_PROBE_CACHE="on")
    def plan(**kw):
        r = subprocess.run([sys.executable, "-m", "pyvis", "plan", str(model), "--budget", "auto", "-c", "512", "-t",
                            "2", "--json"], capture_output=True, text=True, env=env | kw, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)
    p = plan()
    cost, conf = p["cost"], p["configuration"]
    assert cost["probed"] == 1 and cost["token_byte_s"] > 0 and conf["decode_tps"] > 0 and conf["prefill_tps"] > 0
    line = [float(x) for x in _lines(tmp_path)[0].split()[1:]]
    assert line == pytest.approx([cost["mem_bps"], cost["token_byte_s"], cost["pass_s"], cost["pass_token_s"]],
                                 rel=1e-6)
    slow = plan(VIS_MOE_TOKEN_NS_PER_MIB=str(cost["token_byte_s"] * 1e9 * MIB * 4))
    assert slow["cost"]["probed"] == 1 and slow["configuration"]["prefill_tps"] < conf["prefill_tps"]
