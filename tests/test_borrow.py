"""Borrowed slots (VIS_MOE_BORROW, on by default since stop 43; src/features/vis-moe-borrow.h,
docs/planning.md#borrowed-slots): the slabs are made for the slots the --moe-mem plan gives at the compute estimate
of a 16-token ubatch; a decode step runs all of them, a larger ubatch runs the asked ubatch's slots plus what
upstream's real compute buffer leaves of its estimate.  `pyvis plan` names the borrowed slabs the runtime holds.

- outputs: on the medium fixture (Q8_0: upstream's own logits differ between ubatch sizes) every logit of a prompt,
  greedy steps, a second prompt chunk (the limit falls again) and more greedy steps equals upstream's at the same
  ubatch, bit for bit; and the feature is not a no-op: at the same budget it holds more slots and its greedy steps
  read fewer bytes than the plan without it;
- the measured backstop: a process holding more than the plan says gives up slots (reads more, same logits);
- residency: the load makes every slot of the slabs resident (faulted later, at a cgroup's limit, they would be
  scattered pages that reads into are slower);
- memory: llama-cli with it inside a memory cgroup of the budget finishes with its peak inside the limit and prints
  upstream's greedy text (-nr, as the managed layers compute) at -ub 512, a prompt of several ubatches;
- where it cannot run it says why and runs the plan without it;
- the configurator prices it: with it, every candidate ubatch decodes on the 16-token plan's slots.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyvis import moe
from pyvis.runtime import native

from conftest import MEDIUM, run
from test_paging import memory_cgroup

MIB = 1 << 20
TESTS = Path(__file__).resolve().parent
BUDGET = 194  # MiB: the medium fixture at -c 256 gets 2 slots + 1 in 3 layers at -ub 256 (below top-4), far more at -ub 16
KW = dict(n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, n_threads=2, verbose=False, seed=1)
WORDS = "the expert cache keeps some experts of every layer resident and reads the others from the file".split()
CHUNK1 = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(40))
CHUNK2 = " ".join(WORDS[(i * 7 + 3) % len(WORDS)] for i in range(30))
LINE = re.compile(r"borrowed slots: the plan at -ub (\d+) gives (\d+) per layer, the slabs hold (\d+); (\d+) ubatches of "
                  r"<= 16 tokens ran ([\d.]+) on average \(the compute buffer's pages dropped (\d+)x.*?\), (\d+) larger ones "
                  r"([\d.]+)")


def _run(path, **moe_kw):
    """Logits of CHUNK1, 8 greedy steps, CHUNK2, 8 greedy steps; the slots of the managed layers and the bytes the
    greedy steps read (the chunks stream)."""
    llm = moe.load(path, moe.MoeConfig(**moe_kw), **KW) if moe_kw else native.llama_cpp.Llama(str(path), **KW)
    read = 0
    for chunk in (CHUNK1, CHUNK2):
        llm.eval(llm.tokenize((" " + chunk).encode(), add_bos=chunk is CHUNK1))
        before = moe.io_stats(llm)["bytes_read"] if moe_kw else 0
        for _ in range(8):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        read += (moe.io_stats(llm)["bytes_read"] if moe_kw else 0) - before
    logits = np.array(llm.scores[: llm.n_tokens], copy=True)
    slots = [moe.layer_stats(llm, il).n_slots for il in range(MEDIUM.n_layer)
             if moe.layer_stats(llm, il) and moe.layer_stats(llm, il).managed] if moe_kw else []
    del llm
    return logits, slots, read


def test_borrowed_slots_compute_upstreams_logits_and_read_less(medium_model, monkeypatch):
    ref, _, _ = _run(medium_model)
    assert ref.shape[0] > 2 * 16 + 16                          # two chunks longer than a small ubatch
    got = {}
    for arm in ("off", "on", None):                            # None: unset, the default (auto)
        if arm is None:
            monkeypatch.delenv("VIS_MOE_BORROW", raising=False)
        else:
            monkeypatch.setenv("VIS_MOE_BORROW", arm)
        got[arm] = _run(medium_model, mem=BUDGET)
        assert np.array_equal(got[arm][0].view(np.uint32), ref.view(np.uint32)), arm
    (_, s_off, r_off), (_, s_on, r_on), (_, s_auto, r_auto) = got["off"], got["on"], got[None]
    assert s_off and s_on and min(s_on) > max(s_off), (s_off, s_on)  # the slabs hold more slots ...
    assert max(s_off) < MEDIUM.n_expert
    assert r_on < r_off, (r_on, r_off)                         # ... and the decode steps read less
    assert s_auto == s_on and r_auto == r_on                   # on by default


def test_pyvis_plan_names_the_slots_the_runtime_borrows(medium_model, monkeypatch):
    """`pyvis plan` prints the borrowed slabs (the plan at a 16-token ubatch) where they apply, and the runtime's slabs
    hold exactly those per-layer counts; VIS_MOE_BORROW=off: none, and the runtime holds the plan's."""
    from pyvis.runtime import plan as vplan
    from pyvis.runtime import slot_split
    shape = vplan.read_shape(medium_model)
    held = {}
    for arm in ("auto", "off"):
        monkeypatch.setenv("VIS_MOE_BORROW", arm)
        p = vplan.make_plan(shape, budget_mib=BUDGET, n_ctx=KW["n_ctx"], n_ubatch=KW["n_ubatch"], gpu=False)
        q = p["borrow"] if arm == "auto" else p
        assert (p["borrow"] is None) == (arm == "off"), p["borrow"]
        want = list(slot_split.for_plan(shape, q, None).values()) or [q["n_slots"]] * q["managed_layers"]
        llm = moe.load(medium_model, moe.MoeConfig(mem=BUDGET), **KW)
        got = [moe.layer_stats(llm, il).n_slots for il in range(MEDIUM.n_layer)
               if moe.layer_stats(llm, il) and moe.layer_stats(llm, il).managed]
        del llm
        assert got == want, (arm, got, want)
        held[arm] = got
    assert min(held["auto"]) > max(held["off"]), held


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_the_borrowed_slots_are_faulted_at_load(medium_model, monkeypatch):
    """Faulted later, at a memory cgroup's limit, they are scattered pages the disk reads into slower
    (docs/planning.md#stop-42-the-borrowed-slots-pages-were-physically-scattered-found-and-fixed): so the load makes them
    resident, before any ubatch.  Fails if only the base slots were resident after the load."""
    from pyvis.runtime import plan as vplan
    expert = max(vplan.read_shape(medium_model).expert_bytes.values())
    grew, slots = {}, {}
    for arm in ("off", "on"):
        monkeypatch.setenv("VIS_MOE_BORROW", arm)
        before = _rss()
        llm = moe.load(medium_model, moe.MoeConfig(mem=BUDGET), **KW)
        grew[arm] = _rss() - before
        slots[arm] = sum(moe.layer_stats(llm, il).n_slots for il in range(MEDIUM.n_layer)
                         if moe.layer_stats(llm, il) and moe.layer_stats(llm, il).managed)
        del llm
    more = (slots["on"] - slots["off"]) * expert           # the slabs' slots beyond the plan's, all resident
    assert more > 8 * MIB, slots
    assert grew["on"] - grew["off"] > more // 2, (grew, slots, more)


BACKSTOP = """
import os, sys
import numpy as np
sys.path.insert(0, {tests!r})
from pyvis import moe
ballast = np.ones({ballast} << 20, dtype=np.uint8)      # memory of the process's own, touched: not in the plan
llm = moe.load({model!r}, moe.MoeConfig(mem={budget}), n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True,
               n_threads=2, verbose=False, seed=1)
llm.eval(llm.tokenize(b" " + {prompt!r}.encode(), add_bos=True))
before = moe.io_stats(llm)["bytes_read"]
for _ in range(32):
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
np.save({out!r}, np.array(llm.scores[: llm.n_tokens]))
print("READ", moe.io_stats(llm)["bytes_read"] - before, flush=True)
"""


def test_the_measured_backstop_gives_up_slots_when_the_process_holds_more(medium_model, tmp_path):
    """Before each ubatch the process's RSS is measured; where it is over the budget less the kernel's headroom (here:
    300 MiB of the process's own), the top slot of the layers goes: the decode steps read more than the same run
    without that memory, compute the same logits, and the stats line says why.  Fails if the backstop were a no-op
    (the reads would be equal)."""
    got = {}
    for ballast in (0, 300):
        out = tmp_path / f"logits-{ballast}.npy"
        code = BACKSTOP.format(tests=str(TESTS), ballast=ballast, model=str(medium_model), budget=BUDGET,
                               prompt="the expert cache keeps some experts of every layer resident", out=str(out))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "VIS_MOE_BORROW": "on", "VIS_MOE_STATS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        got[ballast] = (int(re.search(r"READ (\d+)", r.stdout)[1]), np.load(out), r.stderr)
    (r0, l0, e0), (r1, l1, e1) = got[0], got[300]
    assert "hold one slot fewer" not in e0, e0[-1500:]
    assert re.search(r"borrowed slots: \d+ layers hold one slot fewer", e1), e1[-1500:]
    assert r1 > r0, (r0, r1)
    assert np.array_equal(l0.view(np.uint32), l1.view(np.uint32))


def test_a_borrowing_run_stays_inside_the_cgroup_with_upstreams_text(bindir, medium_model, tmp_path):
    """The medium fixture's greedy text repeats one token whatever its layers compute (tied embeddings), so the
    routing trace shows the computation is upstream's: every layer's expert ids and router weights, bit for bit."""
    from pyvis.runtime import trace as vtrace
    from test_paging import _same_routing
    prompt = " ".join([CHUNK1, CHUNK2] * 10)                   # ~700 tokens: two ubatches of 512
    cli = ["-p", prompt, "-n", "24", "-st", "-t", "2", "--temp", "0", "-c", "1024", "-ub", "512", "-nr"]
    trs = tmp_path / "ref.trace", tmp_path / "got.trace"
    ref = run([bindir / "llama-cli", "-m", medium_model, *cli, "--moe-trace", trs[0]], timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    limit = 260
    with memory_cgroup(limit * MIB) as (wrap, peak):
        r = run(wrap([bindir / "llama-cli", "-m", medium_model, *cli, "--moe-mem", "auto", "--moe-stats",
                      "--moe-trace", trs[1]]), timeout=300, extra_env={"VIS_MOE_CONFIGURE": "off"})
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-2500:]
        assert 0 < peak() <= limit * MIB
    m = LINE.search(out)
    assert m, out[-2500:]
    ub, base, full, n_small, small, dropped, n_large = (int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]),
                                                        int(m[6]), int(m[7]))
    # the decode steps ran every slot of the slabs, after the prompt's compute pages were dropped
    assert ub == 512 and full > base and n_small >= 20 and small == full and dropped >= 1 and n_large >= 2, m[0]
    assert _generated(r.stdout) == _generated(ref.stdout)
    _same_routing(vtrace.read(trs[0]), vtrace.read(trs[1]))


@pytest.mark.parametrize("extra,why", [(["--moe-slots", "3"], "--moe-slots fixes the slots"),
                                       (["-ub", "16"], "the ubatch is already small")])
def test_where_it_cannot_run_it_says_why(bindir, medium_model, extra, why):
    """on: the plan line says why it does not apply; auto (the default): it says nothing."""
    for arm in ("on", "auto"):
        r = run([bindir / "llama-cli", "-m", medium_model, "-p", CHUNK1, "-n", "2", "-st", "-t", "2", "--temp", "0",
                 "-c", "256", "--moe-mem", str(BUDGET), "-v", *extra], timeout=300, extra_env={"VIS_MOE_BORROW": arm})
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-2000:]
        assert (f"VIS_MOE_BORROW: off ({why})" in out) == (arm == "on"), out[-2000:]
        assert "borrowed slots:" not in out and "VIS_MOE_BORROW: slabs" not in out


def test_the_knob_is_parsed_strictly(bindir, medium_model):
    r = run([bindir / "llama-cli", "-m", medium_model, "-p", "x", "-n", "1", "-st", "--moe-mem", str(BUDGET)],
            timeout=120, extra_env={"VIS_MOE_BORROW": "maybe"})
    assert r.returncode != 0 and "VIS_MOE_BORROW" in r.stderr, r.stderr[-1500:]


def test_the_configurator_prices_the_borrowed_slots():
    """With borrowing, every candidate ubatch decodes on the slots of the 16-token plan, so the configurator no longer
    lowers -ub for decode slots (tests/test_planning.py's request, where without it -ub 512 leaves one slot per
    layer and a smaller ubatch wins); its predicted decode is the 16-token plan's."""
    from pyvis.runtime import native
    from test_planning import COST, REQ, SHAPE
    plain = native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST)
    borrowed = native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST, borrow=True)
    # the 16-token plan
    small = native.configure(REQ, **SHAPE, n_ubatch=16, n_ubatch_min=16, cost=COST)
    assert plain["ok"] and plain["n_ubatch"] < 512 and plain["asked_n_slots"] == 1
    assert borrowed["ok"] and borrowed["n_ubatch"] > plain["n_ubatch"]
    assert borrowed["decode_tps"] == pytest.approx(small["decode_tps"])
    assert borrowed["asked_decode_tps"] == pytest.approx(small["decode_tps"])
    assert borrowed["asked_decode_tps"] > plain["asked_decode_tps"]
    # the plan each runs is its own ubatch's (the runtime's slabs then grow to the 16-token plan's)
    assert borrowed["plan"]["n_slots"] < small["plan"]["n_slots"]


def _generated(stdout: str) -> str:
    """llama-cli's text after the echoed prompt, up to its speed line (the loading spinner differs run to run)."""
    m = re.search(r"\n> [^\n]*\n(.*?)\[ Prompt: ", stdout, re.S)
    assert m, stdout[-1500:]
    return m.group(1)
