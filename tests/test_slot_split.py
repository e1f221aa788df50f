"""Per-layer slot counts at run time (VIS_MOE_SLOT_SPLIT=FILE, src/core/vis-moe-split.cpp, docs/planning.md
#per-layer-slot-counts; issue #24 item 4, issue #26 item 3):

- one rule: llama_vis_moe_split_slots (C: the attach and the configurator) and cachesim_split.split_slots (Python:
  the simulator) give the same split on the same curves, and the configurator's per-layer advice is that split;
- exact: with an uneven split, logits equal upstream's bit for bit on three fixture architectures (one with a
  layer that gets every expert: upstream's graph for that layer);
- runtime = simulator: the runtime's misses per layer with the split equal the simulator's replay of its own trace
  with the same per-layer capacities; they differ from the equal split's, and the slab bytes do not exceed them;
- a split file for another model, or a trace named instead of a split file, is an error naming the file.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from pyvis.runtime import native, policies, slot_split
from pyvis.runtime.cachesim import layer_requests, policy_misses
from pyvis.runtime.cachesim_split import extra_slots, split_slots
from pyvis.runtime.trace import read

from conftest import greedy_logits, run
from test_policy import run_workload

PROMPT = "Per-layer slot counts move slots to the layers that miss most; the output must not change."
N_DECODE = 5


def _skewed(name: str) -> slot_split.SplitFile:
    """Curves under which the rule moves every slot it may to MoE layer 0: its misses fall steeply with every slot,
    the other layers' do not fall at all."""
    spec = fx.FIXTURES[name]()
    n, L = spec.n_expert, len(_moe_layers(spec))
    curves = np.zeros((L, n + 1))
    curves[0] = np.arange(n, -1, -1, dtype=float)
    return slot_split.SplitFile(n, spec.n_expert_used, _moe_layers(spec), curves)


def _moe_layers(spec) -> list[int]:
    return list(range(getattr(spec, "n_dense_lead", 0), spec.n_layer))


def test_c_and_python_give_the_same_split():
    """Random non-increasing curves (equal and unequal slot bytes), and a curve set with ties: the C rule and the
    Python rule agree everywhere; the splits are uneven in most cases and keep the total (and, with unequal slot
    bytes, never use more bytes than the equal split)."""
    rng = np.random.default_rng(3)
    uneven = 0
    for i in range(300):
        L, n = int(rng.integers(2, 9)), int(rng.integers(4, 40))
        k, s = int(rng.integers(1, n + 1)), int(rng.integers(1, n + 1))
        c = np.sort(rng.random((L, n + 1)) * 10, axis=1)[:, ::-1].copy()
        if i % 3 == 0:
            c = np.round(c)                                   # ties
        rb = rng.choice([100, 120, 150], L) if i % 2 else None
        got = native.split_slots(c, k, s, rb)
        assert got == split_slots(c, k, s, rb), i
        assert sum(got) <= L * s and all(min(k, s) <= x <= min(n, 2 * s) for x in got)
        if rb is None:
            assert sum(got) == L * s
        else:
            assert sum(x * b for x, b in zip(got, rb)) <= s * sum(rb)
        uneven += len(set(got)) > 1
    assert uneven > 100
    # curves of counts (misses over decode steps), scaled (another top-k) and rounded to float as the configurator
    # passes them: the same split
    for i in range(100):
        L, n, steps = int(rng.integers(2, 30)), int(rng.integers(8, 129)), int(rng.integers(16, 2048))
        c = np.sort(rng.integers(0, steps * 6, (L, n + 1)), axis=1)[:, ::-1] / steps
        k, s = int(rng.integers(1, n // 2)), int(rng.integers(n // 4, n // 2 + 1))
        want = split_slots(c, k, s)
        assert native.split_slots((c * 4 / 3).astype(np.float32), k, s) == want, i


def test_the_configurators_split_is_the_runtimes_rule():
    """#24 item 4: the configurator's per-layer advice (llama_vis_moe_configure's layer_slots) is the split the
    runtime applies and the simulator replays, on the same curves, at the configurator's slot count."""
    from test_planning import COST, REQ, SHAPE
    n, k = REQ["n_expert"], REQ["n_expert_used"]
    rng = np.random.default_rng(5)
    for _ in range(5):
        c = np.sort(rng.random((REQ["n_managed_layers"], n + 1)) * k, axis=1)[:, ::-1].astype(np.float32)
        conf = native.configure(REQ, **SHAPE, n_ubatch=512, cost=COST, miss_curve=c)
        s = conf["plan"]["n_slots"]
        assert 1 <= s < n
        split = split_slots(c.astype(np.float64), k, s)
        assert split == native.split_slots(c, k, s)
        # then the bytes left after whole rows, by the same curves (the attach's order with a split file)
        assert conf["layer_slots"] == extra_slots(split, conf["plan"]["extra_slots"], n, c.astype(np.float64))


def _write(tmp_path, sf: slot_split.SplitFile, name="split.txt"):
    p = tmp_path / name
    slot_split.write(sf, p)
    return p


@pytest.mark.parametrize("name,slots", [("qwen3moe", 10), ("deepseek2", 6), ("gptoss", 5)])
def test_an_uneven_split_is_byte_identical(fixture_dir, tmp_path, monkeypatch, name, slots):
    """Logits with the skewed split equal upstream's bit for bit; the layers run the split's slot counts (gptoss:
    layer 0 gets all 8 experts and runs upstream's graph) and still miss."""
    spec = fx.FIXTURES[name]()
    ref = greedy_logits(fixture_dir / f"{name}.gguf", PROMPT, N_DECODE)[0]
    sf = _skewed(name)
    want = sf.split(slots)
    assert len(set(want)) > 1
    monkeypatch.setenv("VIS_MOE_SLOT_SPLIT", str(_write(tmp_path, sf)))
    logits, llm = greedy_logits(fixture_dir / f"{name}.gguf", PROMPT, N_DECODE, slots=slots)
    got = [moe.layer_stats(llm, il).n_slots for il in sf.layers]
    misses = sum(moe.layer_stats(llm, il).n_misses for il in sf.layers)
    del llm
    assert got == [0 if w >= spec.n_expert else w for w in want]     # 0: not managed (all experts resident)
    assert misses > 0
    assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32)), name


def _run(fixture_dir, path, slots):
    """test_policy's workload on qwen3moe: per layer (slots, misses), and the slab bytes."""
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=slots, trace=str(path)),
                   n_ctx=160, n_threads=2, verbose=False)
    run_workload(llm)
    spec = fx.FIXTURES["qwen3moe"]()
    per = {il: (moe.layer_stats(llm, il).n_slots, moe.layer_stats(llm, il).n_misses) for il in range(spec.n_layer)}
    slab = moe.io_stats(llm)["slab_bytes"]
    del llm
    return per, slab


def test_runtime_equals_the_simulator_with_a_split(fixture_dir, tmp_path, monkeypatch):
    """The split from the runtime's own profile (pyvis plan --profile TRACE --write-split FILE): per layer, the
    runtime's misses with VIS_MOE_SLOT_SPLIT equal the simulator's replay of its own trace at the same per-layer
    capacities (which `pyvis cachesim --split-file` reports too); misses per layer differ from the equal split's,
    and the slabs are no larger."""
    slots, policy = 10, policies.DEFAULT
    even, even_slab = _run(fixture_dir, tmp_path / "even.trace", slots)
    model = fixture_dir / "qwen3moe.gguf"
    split = tmp_path / "q.split"
    r = run([*_pyvis(), "plan", model, "--budget", "4000", "--slots", str(slots), "-c", "256", "--profile",
             tmp_path / "even.trace", "--write-split", split])
    assert r.returncode == 0, r.stderr
    sf = slot_split.read(split)
    want = sf.split(slots)
    forced = len(set(want)) == 1
    if forced:                                                 # the profile asks for no move: force one
        sf = _skewed("qwen3moe")
        slot_split.write(sf, split)
        want = sf.split(slots)
    monkeypatch.setenv("VIS_MOE_SLOT_SPLIT", str(split))
    got, slab = _run(fixture_dir, tmp_path / "split.trace", slots)
    assert [got[il][0] for il in sorted(got)] == want
    assert slab <= even_slab
    t = read(tmp_path / "split.trace")
    for il, (cap, misses) in got.items():
        assert policy_misses(layer_requests(t, il), cap, policies.make(policy, cap)) == misses, il
    assert any(got[il][1] != even[il][1] for il in got)
    r = run([*_pyvis(), "cachesim", tmp_path / "split.trace", "--slots", str(slots), "--split-file", split, "--json"])
    assert r.returncode == 0, r.stderr
    assert [x["slots"] for x in json.loads(r.stdout)["layers"]] == want
    # pyvis plan shows what the runtime runs; with the profile the file came from, the configurator advises the same
    r = run([*_pyvis(), "plan", model, "--budget", "4000", "--slots", str(slots), "-c", "256", "--json"],
            extra_env={"VIS_MOE_SLOT_SPLIT": str(split)})
    assert list(json.loads(r.stdout)["plan"]["layer_slots"].values()) == want
    if not forced:
        r = run([*_pyvis(), "plan", model, "--budget", "4000", "--slots", str(slots), "-c", "256", "--json",
                 "--profile", tmp_path / "even.trace"], extra_env={"VIS_MOE_SLOT_SPLIT": str(split)})
        assert json.loads(r.stdout)["configuration"]["layer_slots"] == want


def _pyvis():
    import sys
    return [sys.executable, "-m", "pyvis"]


def test_a_split_file_for_another_model_is_a_clear_error(fixture_dir, tmp_path, monkeypatch, bindir):
    q = _write(tmp_path, _skewed("qwen3moe"))
    monkeypatch.setenv("VIS_MOE_SLOT_SPLIT", str(q))
    with pytest.raises(moe.VisError, match=rf"VIS_MOE_SLOT_SPLIT {q}: it was made for a model with 3 MoE layers x 32 "
                                           r"experts, this model has 2 x 16; make one for this model with: pyvis plan"):
        moe.load(fixture_dir / "deepseek2.gguf", moe.MoeConfig(slots=6), n_ctx=64, verbose=False)
    # a routing trace is not a split file
    tr = tmp_path / "t.trace"
    monkeypatch.delenv("VIS_MOE_SLOT_SPLIT")
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "Hi", "-n", "2", "-st", "-c", "64",
             "-t", "2", "--moe-slots", "10", "--moe-trace", tr, "--no-warmup"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "Hi", "-n", "2", "-st", "-c", "64",
             "-t", "2", "--moe-slots", "10", "--no-warmup"], extra_env={"VIS_MOE_SLOT_SPLIT": str(tr)}, timeout=120)
    assert r.returncode != 0 and f"VIS_MOE_SLOT_SPLIT {tr}: this is a routing trace, not a split file" in r.stdout + r.stderr
    # the simulator and the planner refuse the same files
    r = run([*_pyvis(), "cachesim", tr, "--slots", "10", "--split-file", tr])
    assert r.returncode != 0 and "not a split file" in r.stderr
    r = run([*_pyvis(), "plan", fixture_dir / "deepseek2.gguf", "--budget", "4000", "--slots", "6", "-c", "64"],
            extra_env={"VIS_MOE_SLOT_SPLIT": str(q)})
    assert r.returncode != 0 and "made for a model with 3 MoE layers x 32 experts, this model has 2 x 16" in r.stderr
    r = run([*_pyvis(), "plan", fixture_dir / "deepseek2.gguf", "--budget", "4000", "-c", "64", "--profile", tr,
             "--write-split", tmp_path / "x.split"])
    assert r.returncode != 0 and f"--profile {tr}: the trace has " in r.stderr and "32 experts" in r.stderr
    assert not (tmp_path / "x.split").exists()
