"""The --moe-mem configurator (issue #24 item 1, docs/planning.md): llama_vis_moe_configure chooses the ubatch and
the slots with the lowest predicted latency in one budget; the runtime applies a lower ubatch before its KV cache
and compute buffers, outputs stay byte-identical to upstream's, the run stays inside a memory cgroup, `pyvis plan`
says what the runtime does, and a budget too small even at the smallest ubatch is refused naming the budget that
works.  On the medium fixture (qwen3moe, 4 x 128 experts, 49152-token vocabulary: a -ub 512 compute buffer of
~180 MiB against 3.2 MiB per slot row), where lowering -ub buys many slots."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from conftest import run
from test_paging import memory_cgroup

MIB = 1 << 20
COST = dict(read_bps=400 * MIB, mem_bps=10000 * MIB, pass_s=10e-3, pass_token_s=2e-3, token_s=0.0, stream_passes=8,
            prompt_tokens=512, gen_tokens=128)
# a medium-fixture-like request: 4 managed layers x 128 experts of 0.8 MiB, top-4, CPU only (no staging slot)
REQ = dict(budget=200 * MIB, resident_bytes=20 * MIB, kv_bytes=4 * MIB, expert_bytes=int(0.8 * MIB),
           n_managed_layers=4, n_expert=128, n_expert_used=4, unified=1, host_mib=-1, n_slots=0, no_staging=1)
SHAPE = dict(n_vocab=49152, n_embd=512, n_ff_exp=512)
LOWERED = re.compile(r"--moe-mem: -ub (\d+) lowered to (\d+): .* buys (\d+) expert slots? per layer")


def _total(c: dict) -> float:
    return COST["prompt_tokens"] / c["prefill_tps"] + COST["gen_tokens"] / c["decode_tps"]


def test_the_configurator_picks_the_cheapest_ubatch_it_prices():
    """Against every candidate priced alone (n_ubatch = n_ubatch_min = u): the chosen ubatch has the lowest predicted
    latency (within the 2 % by which the asked one stands), and it is below the asked one where -ub 512's compute
    buffer leaves one slot per layer; a no-op (the asked ubatch) fails the second assertion."""
    from pyvis.runtime import native
    c = native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST)
    assert c["ok"] and c["asked_n_slots"] == 1
    alone = {u: native.configure(REQ, **SHAPE, n_ubatch=u, n_ubatch_min=u, cost=COST) for u in (512, 256, 128, 64, 32, 16)}
    best = min(alone, key=lambda u: _total(alone[u]))
    assert c["n_ubatch"] < 512 and c["plan"]["n_slots"] > c["asked_n_slots"]
    assert _total(alone[c["n_ubatch"]]) <= _total(alone[best]) / 0.98
    assert c["plan"] == alone[c["n_ubatch"]]["plan"]          # the runtime's own plan at that ubatch
    # the marginal values at the optimum (seconds per request per MiB): a slot row still buys time
    assert c["mv_slot"] > 0 and c["mv_next_slot"] > 0
    # a plenty budget: the asked ubatch stands
    assert native.configure(REQ | dict(budget=800 * MIB), **SHAPE, n_ubatch=512, cost=COST)["n_ubatch"] == 512


def test_per_layer_curves_give_per_layer_slots():
    """A skewed layer (its misses fall to 0 by 8 slots) gets fewer slots than uniform ones from the same slab bytes,
    and the split predicts a faster decode than equal slots; a curve that is the prior gives equal slots."""
    from pyvis.runtime import native
    n, k = 128, 4
    prior = np.array([k * (1 - s / n) for s in range(n + 1)])
    skewed = np.maximum(0.0, k * (1 - np.arange(n + 1) / 8))
    c = native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST, miss_curve=np.stack([skewed, prior, prior, prior]))
    s = c["layer_slots"]
    assert sum(s) == c["plan"]["n_slots"] * 4 and s[0] < min(s[1:]) and s[0] >= 8
    assert c["layer_decode_tps"] > c["decode_tps"]
    flat = native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST, miss_curve=np.stack([prior] * 4))
    assert len(set(flat["layer_slots"])) == 1


def test_bad_cost_is_an_error():
    from pyvis.runtime import native
    with pytest.raises(native.VisError, match="read_bps > 0"):
        native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST | dict(read_bps=0.0))
    with pytest.raises(native.VisError, match="n_ubatch_min <= n_ubatch"):
        native.configure(REQ, **SHAPE, n_ubatch=64, n_ubatch_min=128, cost=COST)


PROMPT = "The expert cache keeps the experts a token needs resident. " * 3
KW = dict(n_ctx=1024, n_batch=512, n_ubatch=512, logits_all=True, n_threads=2, verbose=False, seed=1)


def _logits(path, **moe_kw):
    """Logits of PROMPT and 4 greedy steps at -c 1024 -ub 512 (upstream caps the ubatch at the context), and the
    context's ubatch, slots and reserve (llama_n_ubatch, the cache stats, llama_vis_moe_context_reserve)."""
    from pyvis.runtime import moe, native
    llm = moe.load(path, **moe_kw, **KW) if moe_kw else native.llama_cpp.Llama(str(path), **KW)
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    for _ in range(4):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    st = native.moe_stats(llm, -1)
    got = (np.array(llm.scores[: llm.n_tokens], copy=True), native.llama_cpp.llama_n_ubatch(llm.ctx),
           st.n_slots if st else None, native.context_reserve(llm))
    del llm
    return got


def test_lowered_ubatch_runs_byte_identical_and_as_planned(medium_model, monkeypatch):
    """--moe-mem 200 at -ub 512: the runtime lowers the ubatch and plans more slots than with the configurator off;
    its logits equal upstream's at -ub 512 bit for bit; `pyvis plan --json` names the same ubatch, slots and reserve
    the context reports."""
    ref = _logits(medium_model)[0]
    out = run([sys.executable, "-m", "pyvis", "plan", medium_model, "--budget", "200", "-c", "1024", "--json"])
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    conf = plan["configuration"]
    got, ub, slots, reserve = _logits(medium_model, mem=200)
    assert ub == conf["n_ubatch"] < 512 and slots == plan["plan"]["n_slots"] == conf["plan"]["n_slots"]
    assert reserve == plan["plan"]["request"]["reserve_bytes"]
    assert np.array_equal(got, ref)
    monkeypatch.setenv("VIS_MOE_CONFIGURE", "off")
    off, ub_off, slots_off, _ = _logits(medium_model, mem=200)
    assert ub_off == 512 and slots_off < slots
    assert np.array_equal(off, ref)


@pytest.mark.parametrize("limit_mib", [180, 210])
def test_a_configured_run_stays_inside_the_cgroup(bindir, medium_model, limit_mib):
    """llama-cli --moe-mem auto -ub 512 in a memory cgroup: the configurator lowers -ub (its line says so), the run
    finishes with its peak inside the limit and prints upstream's greedy text."""
    cli = ["-p", PROMPT, "-n", "8", "-st", "-t", "2", "--temp", "0", "-c", "1024", "-ub", "512"]
    ref = run([bindir / "llama-cli", "-m", medium_model, *cli], timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    with memory_cgroup(limit_mib * MIB) as (wrap, peak):
        r = run(wrap([bindir / "llama-cli", "-m", medium_model, *cli, "--moe-mem", "auto"]), timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-2500:]
        assert 0 < peak() <= limit_mib * MIB
    m = LOWERED.search(out)
    assert m and int(m.group(2)) < 512, out[-2500:]
    assert _generated(r.stdout) == _generated(ref.stdout)


def _generated(stdout: str) -> str:
    """llama-cli's text after the echoed prompt, up to its speed line (the loading spinner differs run to run)."""
    m = re.search(r"\n> [^\n]*\n(.*?)\[ Prompt: ", stdout, re.S)
    assert m, stdout[-1500:]
    return m.group(1)


def test_too_small_even_at_the_smallest_ubatch_is_refused_naming_a_budget_that_works(bindir, medium_model):
    """A budget below the floor at every ubatch: llama-cli refuses, naming the smallest budget at the smallest ubatch
    (below -ub 512's, which a configurator that kept -ub would name), the same as `pyvis plan`; that budget runs."""
    from pyvis.runtime import plan as P
    cli = ["-p", "hi", "-n", "2", "-st", "-t", "2", "--temp", "0", "-c", "256", "-ub", "512"]
    r = run([bindir / "llama-cli", "-m", medium_model, *cli, "--moe-mem", "50"], timeout=300)
    out = r.stdout + r.stderr
    m = re.search(r"smallest budget for this \d+-token context: (\d+) MiB", out)
    assert r.returncode == 1 and m, out[-2500:]
    named = int(m.group(1))
    p = run([sys.executable, "-m", "pyvis", "plan", medium_model, "--budget", "50", "-c", "256"])
    assert p.returncode == 2 and f"smallest budget for this 256-token context: {named} MiB" in p.stderr, p.stderr[-1500:]
    at512 = P.make_plan(P.read_shape(medium_model), budget_mib=50, n_ctx=256, n_ubatch=512, search=False)
    assert named < -(-at512["min_budget"] // MIB)
    ok = run([bindir / "llama-cli", "-m", medium_model, *cli, "--moe-mem", str(named)], timeout=300)
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-2500:]
