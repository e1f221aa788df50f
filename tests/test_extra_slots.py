"""Slots from the bytes a --moe-mem plan leaves after whole slot rows (llama_vis_moe_plan's extra_slots,
llama_vis_moe_extra_slots; docs/planning.md#slots-from-the-bytes-left-over; issues #24 and #26):

- the plan gives what is left after whole rows (less than one row) as one more slot in that many layers, counted in
  the slabs, never over the budget; none with --moe-slots or on a discrete GPU;
- one rule: the C function and pyvis.runtime.cachesim_split.extra_slots agree, with and without miss curves;
- the runtime runs it: the layers' slot counts are the ones `pyvis plan` prints, the logits equal upstream's bit for
  bit, its misses per layer equal the simulator's replay of its own trace at those counts, and it misses less than
  the same plan without them (--moe-slots at the plan's even count).
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from pyvis import moe
from pyvis.runtime import native, policies
from pyvis.runtime.cachesim import layer_requests, policy_misses, stream_flags
from pyvis.runtime.cachesim_split import extra_slots
from pyvis.runtime.trace import read

from conftest import MEDIUM, greedy_logits, run

PROMPT = "The bytes a plan leaves after whole slot rows buy one more slot in some layers; the output must not change."
N_DECODE = 16
@pytest.fixture(autouse=True)
def _plain_plan(monkeypatch):
    """The plan's slots in every ubatch: borrowed slots (VIS_MOE_BORROW, on by default) grow the slabs to the plan at
    a 16-token ubatch (tests/test_borrow.py), and --moe-slots, the A/B below, turns them off."""
    monkeypatch.setenv("VIS_MOE_BORROW", "off")


# MiB: the medium fixture (4 layers x 128 experts of 0.8 MiB, top-4) gets 2 slots + 1 in 3 layers (below top-k: decode
# steps in passes) and 4 slots + 1 in 2 layers
BUDGETS = (194, 200)


def test_the_plan_gives_the_bytes_left_after_whole_rows_as_slots():
    req = dict(resident_bytes=400 << 20, kv_bytes=8 << 20, reserve_bytes=32 << 20, expert_bytes=3 << 20,
               n_managed_layers=16, n_expert=128, n_expert_used=8, no_staging=1)
    row, seen = 16 * (3 << 20), set()
    for budget_mib in (700, 1000, 1234, 2000, 5000):
        p = native.plan(budget=budget_mib << 20, unified=1, host_mib=-1, **req)
        no_host = native.plan(budget=budget_mib << 20, unified=1, host_mib=0, **req)
        assert p["ok"] and p["n_slots"] == no_host["n_slots"] < 128 and p["host_bytes"] == 0
        left = p["budget"] - p["fixed_bytes"] - p["n_slots"] * row
        assert 0 <= left < row
        assert p["extra_slots"] == left // (3 << 20) < 16
        assert p["slab_bytes"] == p["n_slots"] * row + p["extra_slots"] * (3 << 20)
        assert p["fixed_bytes"] + p["slab_bytes"] + p["host_bytes"] <= p["budget"]
        assert p["file_only_bytes"] == 128 * 16 * (3 << 20) - p["slab_bytes"]
        seen.add(p["extra_slots"])
        # slots asked for (--moe-slots), or a discrete GPU: the even count only
        assert native.plan(budget=budget_mib << 20, unified=1, host_mib=-1, n_slots=p["n_slots"],
                           **req)["extra_slots"] == 0
        assert native.plan(budget=budget_mib << 20, unified=0, host_mib=-1, device_bytes=200 << 20,
                           **req)["extra_slots"] == 0
    assert len(seen - {0}) >= 2                            # some budgets left room for several


def test_c_and_python_pick_the_same_layers():
    rng = np.random.default_rng(11)
    for i in range(300):
        L, n = int(rng.integers(1, 50)), int(rng.integers(2, 130))
        slots = rng.integers(1, n + 1, L).astype(np.int32)
        if i % 4 == 0:
            slots[:] = rng.integers(1, n)                  # the even count, as without a split file
        extra = int(rng.integers(0, L + 2))
        curves = None
        if i % 2:
            curves = np.sort(rng.random((L, n + 1)) * 10, axis=1)[:, ::-1].copy()
            if i % 3 == 0:
                curves = np.round(curves)                  # ties: the first layer wins
        got = native.extra_slots(slots, extra, n, curves)
        assert got == extra_slots(slots.tolist(), extra, n, curves), i
        open_ = int((slots < n).sum())
        assert sum(got) == int(slots.sum()) + min(extra, open_)
        assert all(0 <= g - s <= 1 and g <= n for g, s in zip(got, slots.tolist()))
        if curves is not None and 0 < extra < open_:       # the chosen layers save the most
            gain = [curves[j][s] - curves[j][s + 1] if s < n else -1 for j, s in enumerate(slots.tolist())]
            worst_in = min(gain[j] for j in range(L) if got[j] > slots[j])
            best_out = max(gain[j] for j in range(L) if got[j] == slots[j] and slots[j] < n)
            assert worst_in >= best_out
    # spread: 18 of 48 and 37 of 48 (the 48-layer model at 4 GiB and 12.5 %) reach both ends of the depth
    for x in (18, 37):
        got = native.extra_slots(np.full(48, 5, np.int32), x, 128, None)
        more = [j for j in range(48) if got[j] == 6]
        assert len(more) == x and more[0] < 48 // x + 1 and more[-1] >= 48 - 48 // x - 1


def _plan_slots(model, budget) -> tuple[int, list[int]]:
    """`pyvis plan`'s even count and per-layer slots for the context greedy_logits makes (-c 256: upstream caps
    the ubatch at the context)."""
    r = run([sys.executable, "-m", "pyvis", "plan", model, "--budget", str(budget), "-c", "256", "-ub", "256",
             "-t", "2", "--json"], timeout=300)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["plan"]
    assert p["extra_slots"] > 0 and p["n_slots"] < 8, p    # bytes left over
    return p["n_slots"], list(p["layer_slots"].values())


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_runtime_runs_the_extra_slots_exactly(medium_model, tmp_path, budget):
    n_slots, want = _plan_slots(medium_model, budget)
    assert len(set(want)) == 2
    ref = greedy_logits(medium_model, PROMPT, N_DECODE)[0]
    got = {}
    for arm, kw in (("plan", dict(mem=budget)), ("even", dict(slots=n_slots))):
        logits, llm = greedy_logits(medium_model, PROMPT, N_DECODE, trace=str(tmp_path / f"{arm}.trace"), **kw)
        layers = [il for il in range(MEDIUM.n_layer) if moe.layer_stats(llm, il).managed]
        got[arm] = {il: (moe.layer_stats(llm, il).n_slots, moe.layer_stats(llm, il).n_misses) for il in layers}
        read_bytes = moe.io_stats(llm)["bytes_read"]
        del llm
        assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32)), arm
        got[arm]["read"] = read_bytes
    plan, even = got.pop("plan"), got.pop("even")
    pr, er = plan.pop("read"), even.pop("read")
    assert [plan[il][0] for il in sorted(plan)] == want          # what `pyvis plan` printed
    assert all(even[il][0] == n_slots for il in even)
    # runtime = simulator at the per-layer counts (the prompt streamed with the slabs lent; decode steps in one pass:
    # the simulator has no passes), and fewer misses (and bytes) than the even plan
    if n_slots >= MEDIUM.n_expert_used:
        t = read(tmp_path / "plan.trace")
        for il, (cap, misses) in plan.items():
            assert policy_misses(layer_requests(t, il), cap, policies.make(policies.DEFAULT, cap),
                                 streamed=stream_flags(t, il, cap), lent=True) == misses, il
    assert sum(m for _, m in plan.values()) < sum(m for _, m in even.values())
    assert pr < er


def test_the_configurator_prices_the_extra_slots():
    """llama_vis_moe_configure prices the plan the runtime runs, extra slots included: a budget whose bytes after
    whole rows give 3 of 4 layers a second slot (top-4: a decode step in 2 passes instead of 4 there, and fewer
    misses) predicts a faster decode than the budget with the same even count and nothing left over (priced on the
    even count alone, the two were equal).  With per-layer curves the advice (layer_slots) is the split and then the
    extras by the same curves, as the attach runs them with the split file: on prior curves it is priced as the plan,
    on skewed ones the extras go to the layers that gain most."""
    from test_planning import COST, REQ, SHAPE
    MIB, L, n, k = 1 << 20, REQ["n_managed_layers"], REQ["n_expert"], REQ["n_expert_used"]
    conf = {b: native.configure(REQ | dict(budget=b * MIB), **SHAPE, n_ubatch=512, n_ubatch_min=512, cost=COST)
            for b in (234, 240)}
    whole, extra = conf[234], conf[240]
    assert whole["plan"]["n_slots"] == extra["plan"]["n_slots"] == 1
    assert whole["plan"]["extra_slots"] == 0 and extra["plan"]["extra_slots"] == 3
    assert extra["decode_tps"] > 1.3 * whole["decode_tps"]
    prior = np.array([k * (1 - s / n) for s in range(n + 1)], np.float32)
    c = native.configure(REQ | dict(budget=240 * MIB), **SHAPE, n_ubatch=512, n_ubatch_min=512, cost=COST,
                         miss_curve=np.stack([prior] * L))
    assert sorted(c["layer_slots"]) == [1, 2, 2, 2]
    assert c["layer_decode_tps"] == pytest.approx(c["decode_tps"], rel=1e-9)
    assert c["decode_tps"] == pytest.approx(extra["decode_tps"], rel=1e-9)
    flat = np.full(n + 1, 0.0, np.float32)
    flat[0] = flat[1] = flat[2] = k                        # a layer whose misses fall only from 3 slots on: no gain at 2
    skew = np.stack([flat, prior, prior, prior])
    c = native.configure(REQ | dict(budget=240 * MIB), **SHAPE, n_ubatch=512, n_ubatch_min=512, cost=COST,
                         miss_curve=skew)
    assert c["layer_slots"] == [1, 2, 2, 2]
    assert c["layer_slots"] == extra_slots([1] * L, 3, n, skew.astype(np.float64))
