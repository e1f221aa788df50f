"""Cache-aware dropping (--moe-substitute drop) and the one switch --moe-mode exact|fast (docs/mode.md,
docs/substitution.md#cache-aware-dropping), through pyvis and llama-cli on the fixtures:

- a drop is what the layer computes: logits bit for bit those of the same cache without it up to the first decode
  step whose trace shows a dropped pair, different at that step; only missing pairs below the share are dropped;
- a dropped expert is read in the background: the layer's next step that routes it finds it resident;
- --moe-mode exact is byte-identical to no flag; fast prints one line, is labelled lossy and is, bit for bit, the
  model at --moe-topk ceil(2k/3) (with or without the cache; nothing on a model of k <= 2);
- an unknown mode is an error naming the flag (or variable, or keyword); a --moe-topk given with fast wins.
The decision rule itself is checked on hand-computed cases in tests/test-vis-substitute.cpp (test_drop).
"""
from __future__ import annotations

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from pyvis.runtime import settings
from pyvis.runtime import trace as vtrace
from conftest import greedy_logits, later_hits
from test_substitution import PROMPT, _cli, _generated

DROPPED = vtrace.SUB_OUTCOMES.index("dropped")
FAST_LINE = "vis-moe: --moe-mode fast (LOSSY: outputs differ from the model's): turned on --moe-topk"


def _shares(t: vtrace.Trace) -> np.ndarray:
    w = t.weights.astype(np.float64)
    return w / w.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("name,renorm", [("qwen3moe", False), ("qwen3moe", True), ("gptoss", False)])
def test_drops_are_what_the_layer_computes(fixture_dir, tmp_path, name, renorm):
    """The same cache with and without drop: equal logits (bit for bit) up to the first decode step with a dropped
    pair in the trace, different at it; every dropped pair is below half an even split, ran no expert of its own
    and was not resident (resident pairs keep outcome 0 whatever their share)."""
    spec = fx.FIXTURES[name]()
    path = fixture_dir / f"{name}.gguf"
    n, slots = 12, spec.n_expert_used
    off, llm = greedy_logits(path, PROMPT, n, slots=slots)
    del llm
    tr = tmp_path / "drop.trace"
    got, llm = greedy_logits(path, PROMPT, n, slots=slots, substitute="drop", sub_renorm=renorm, trace=str(tr))
    st = moe.sub_stats(llm)
    del llm                                                  # closes the trace
    t = vtrace.read(tr)
    drop = t.outcome == DROPPED
    assert drop.any(), "nothing was dropped: the test could not check anything"
    assert st["outcomes"]["dropped"] == int(drop.sum())      # the counter counts what the trace shows
    k = t.ids.shape[1]
    share = _shares(t)
    assert (share[drop] < 0.5 / k).all()
    # a dropped pair runs (with weight 0) an expert its token already runs
    for i, r in zip(*np.nonzero(drop)):
        assert t.exec_ids[i, r] in np.delete(t.ids[i], r)
    # missing pairs at or above the share were not dropped; low-share pairs with outcome 0 were resident and ran
    assert not drop[share >= 0.5 / k].any()
    low_res = (share < 0.5 / k) & (t.outcome == 0)
    assert (t.exec_ids[low_res] == t.ids[low_res]).all()
    # the logits: bit for bit until the first step with a drop, different there
    ubs = np.unique(t.ubatch)
    n_prompt = len(off) - n
    assert len(ubs) == n + 1
    step = int(np.searchsorted(ubs, np.unique(t.ubatch[drop.any(axis=1)])[0]))
    assert step >= 1                                         # prefill never drops (no --moe-sub-prefill)
    row = n_prompt + step - 1
    assert np.array_equal(off[:row].view(np.uint32), got[:row].view(np.uint32)), name
    assert not np.array_equal(off[row], got[row]), name


def test_renorm_changes_the_weights(fixture_dir):
    """renorm on and off drop the same pairs at the first dropped step and give different logits there"""
    path = fixture_dir / "qwen3moe.gguf"
    a, llm = greedy_logits(path, PROMPT, 6, slots=8, substitute="drop")
    del llm
    b, llm = greedy_logits(path, PROMPT, 6, slots=8, substitute="drop", sub_renorm=True)
    del llm
    assert not np.array_equal(a, b)


def test_no_drop_when_the_experts_are_resident(fixture_dir, tmp_path):
    """With slots for every expert the cache is never short: drop gives the exact logits and drops nothing;
    with the trace on, no outcome is 'dropped'."""
    spec = fx.FIXTURES["qwen3moe"]()
    path = fixture_dir / "qwen3moe.gguf"
    exact, llm = greedy_logits(path, PROMPT, 8, slots=spec.n_expert_used)
    del llm
    # pinned layers 0 .. n-2 resident, the last managed with a tiny cache: drops happen in that layer only
    tr = tmp_path / "pin.trace"
    got, llm = greedy_logits(path, PROMPT, 8, slots=spec.n_expert_used, pinned_layers=spec.n_layer - 1,
                             substitute="drop", trace=str(tr))
    del llm
    t = vtrace.read(tr)
    assert (t.outcome[t.layer < spec.n_layer - 1] == 0).all()      # resident layers: nothing missing, nothing dropped
    assert (t.outcome[t.layer == spec.n_layer - 1] == DROPPED).any()
    # everything resident (slots = n_expert: no managed layer): exact, bit for bit
    full, llm = greedy_logits(path, PROMPT, 8, slots=spec.n_expert, substitute="drop")
    del llm
    ref, llm = greedy_logits(path, PROMPT, 8, slots=spec.n_expert)
    del llm
    assert np.array_equal(full.view(np.uint32), ref.view(np.uint32))
    assert not np.array_equal(got, exact)                    # the same drop run with misses is lossy


def test_a_dropped_expert_is_read_in_the_background(bindir, fixture_dir, tmp_path):
    """with room beside the running pass, a dropped expert is read in the background (bg reads > 0) and the layer's
    next step that routes it finds it resident, although no step between routed it"""
    model = fixture_dir / "qwen3moe.gguf"
    tr = tmp_path / "bg.trace"
    r, out = _cli(bindir, model, "--moe-slots", "16", "--moe-substitute", "drop", "--moe-sub-drop-share", "1",
                  "--moe-stats", "--moe-trace", tr, n=24)
    assert r.returncode == 0, out[-3000:]
    total = [ln for ln in out.splitlines() if ln.startswith("vis-moe: total") and len(ln.split()) > 12][-1].split()
    assert int(total[5]) > 0 and int(total[-2]) > 0          # dropped, background reads
    hits, misses = later_hits(vtrace.read(tr), DROPPED)
    assert hits > 0 and hits >= misses, (hits, misses)
    # --moe-sub-drop-read off: the same drops, nothing read behind them
    r, out = _cli(bindir, model, "--moe-slots", "16", "--moe-substitute", "drop", "--moe-sub-drop-share", "1",
                  "--moe-stats", n=24, env={"VIS_MOE_SUB_DROP_READ": "off"})
    assert r.returncode == 0, out[-3000:]
    total = [ln for ln in out.splitlines() if ln.startswith("vis-moe: total") and len(ln.split()) > 12][-1].split()
    assert int(total[5]) > 0 and int(total[-2]) == 0


def test_mode_exact_is_byte_identical_and_fast_is_lossy(bindir, fixture_dir):
    """On the fixture whose greedy text varies: exact = no flag (text and logits, bit for bit, and no mode line);
    fast prints its one line, generates other text, and is the model at --moe-topk ceil(2k/3) bit for bit."""
    spec = fx.FIXTURES["qwen3moe"]()
    n = -(-2 * spec.n_expert_used // 3)                     # k 8 -> 6
    model = fixture_dir / f"{fx.VARIED_TEXT['qwen3moe']}.gguf"
    slots = ["--moe-slots", str(spec.n_expert_used)]
    r0, out0 = _cli(bindir, model, *slots)
    r1, out1 = _cli(bindir, model, *slots, "--moe-mode", "exact")
    r2, out2 = _cli(bindir, model, *slots, env={"VIS_MOE_MODE": "exact"})
    assert r0.returncode == r1.returncode == r2.returncode == 0, out1[-2000:]
    assert _generated(out0) == _generated(out1) == _generated(out2)
    assert "--moe-mode" not in out1 and "LOSSY" not in out1
    r3, out3 = _cli(bindir, model, *slots, "--moe-mode", "fast", "--moe-stats")
    assert r3.returncode == 0, out3[-2000:]
    lines = [ln for ln in out3.splitlines() if FAST_LINE in ln]
    assert len(lines) == 1 and f"--moe-topk {n} (each token runs its {n} highest-weighted of the model's " \
        f"{spec.n_expert_used} experts)" in lines[0], out3[-3000:]
    assert _generated(out3) != _generated(out0)
    r4, out4 = _cli(bindir, model, *slots, "--moe-topk", str(n))
    assert r4.returncode == 0 and _generated(out4) == _generated(out3)
    # logits through pyvis: exact = no keyword, bit for bit; fast differs, and is --moe-topk n bit for bit
    a, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used)
    del llm
    b, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used, mode="exact")
    del llm
    c, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used, mode="fast")
    del llm
    d, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used, topk=n)
    del llm
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert not np.array_equal(a, c)
    assert np.array_equal(c.view(np.uint32), d.view(np.uint32))


def test_fast_without_the_cache_runs_fewer_experts(bindir, fixture_dir):
    """fast does not need the cache: without it, the same fewer experts (upstream with expert_used_count =
    ceil(2k/3), bit for bit); on a model of k = 2 it keeps them all and says the output is exact."""
    model = fixture_dir / f"{fx.VARIED_TEXT['qwen3moe']}.gguf"
    r, out = _cli(bindir, model, "--moe-mode", "fast")
    assert r.returncode == 0 and sum(FAST_LINE in ln for ln in out.splitlines()) == 1, out[-2000:]
    r1, out1 = _cli(bindir, model, "--override-kv", "qwen3moe.expert_used_count=int:6")
    r0, out0 = _cli(bindir, model)
    assert r1.returncode == r0.returncode == 0
    assert _generated(out) == _generated(out1) != _generated(out0)
    mixtral = fixture_dir / f"{fx.VARIED_TEXT['mixtral']}.gguf"
    assert fx.FIXTURES["mixtral"]().n_expert_used == 2
    r, out = _cli(bindir, mixtral, "--moe-mode", "fast", "--moe-slots", "2")
    r0, out0 = _cli(bindir, mixtral, "--moe-slots", "2")
    assert r.returncode == r0.returncode == 0, out[-2000:]
    assert "--moe-mode fast: nothing turned on: the model runs 2 experts per token" in out and "LOSSY" not in out
    assert _generated(out) == _generated(out0)


def test_unknown_mode_is_refused(bindir, fixture_dir):
    model = fixture_dir / "qwen3moe.gguf"
    r, out = _cli(bindir, model, "--moe-slots", "8", "--moe-mode", "turbo", n=1)
    assert r.returncode != 0 and "--moe-mode: expected exact or fast, got 'turbo'" in out, out[-1500:]
    r, out = _cli(bindir, model, "--moe-slots", "8", n=1, env={"VIS_MOE_MODE": "Fast"})
    assert r.returncode != 0 and "VIS_MOE_MODE: expected exact or fast, got 'Fast'" in out, out[-1500:]
    with pytest.raises(moe.VisError, match="--moe-mode: expected exact or fast, got 'turbo'"):
        moe.load(model, moe.MoeConfig(slots=8, mode="turbo"), n_ctx=64, verbose=False)
    with pytest.raises(settings.VisTypeError, match=r"mode \(--moe-mode\) must be a string"):
        moe.load(model, moe.MoeConfig(slots=8, mode=1), n_ctx=64, verbose=False)


def test_a_knob_given_with_fast_wins(bindir, fixture_dir, tmp_path):
    """--moe-topk 7 with fast: the model at 7, bit for bit, and the line says fast turned nothing on; --moe-topk 8
    (= k) with fast: exact.  Drop's own knob: VIS_MOE_SUB_DROP_SHARE=0 with --moe-substitute drop drops nothing."""
    spec = fx.FIXTURES["qwen3moe"]()
    model = fixture_dir / "qwen3moe.gguf"
    slots = ["--moe-slots", str(spec.n_expert_used)]
    r, out = _cli(bindir, model, *slots, "--moe-mode", "fast", "--moe-topk", "7")
    assert r.returncode == 0, out[-2000:]
    assert "--moe-mode fast: nothing turned on: --moe-topk 7 was given and replaces its own (the output is lossy)" in out
    a, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used, mode="fast", topk=7)
    del llm
    b, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used, topk=7)
    del llm
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    c, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used, mode="fast", topk=spec.n_expert_used)
    del llm
    d, llm = greedy_logits(model, PROMPT, 8, slots=spec.n_expert_used)
    del llm
    assert np.array_equal(c.view(np.uint32), d.view(np.uint32))
    counts = []
    for env in ({}, {"VIS_MOE_SUB_DROP_SHARE": "0"}):
        tr = tmp_path / f"s{len(counts)}.trace"
        r, out = _cli(bindir, model, *slots, "--moe-substitute", "drop", "--moe-trace", tr, env=env)
        assert r.returncode == 0, out[-2000:]
        counts.append(int((vtrace.read(tr).outcome == DROPPED).sum()))
    assert counts[0] > 0 and counts[1] == 0, counts


def test_drop_under_replay_uses_the_traces_weights(fixture_dir, tmp_path, monkeypatch):
    """VIS_MOE_REPLAY (the benchmark's routing): the model's own experts replayed with flat decode weights drop
    nothing; the same with one tiny weight per decode (position, layer) drops only those pairs, some of them"""
    from test_replay import greedy as replay_greedy, routing_of, write_csv
    model = fixture_dir / "qwen3moe.gguf"
    own = tmp_path / "own.trace"
    _, llm = replay_greedy(model, trace=str(own))
    n_prompt = len(llm.tokenize(b"replay the routing of a real model", add_bos=True))
    del llm
    ids, w = routing_of(own, 3)
    flat = np.full_like(w, 1 / 8)
    tiny = flat.copy()
    tiny[n_prompt:, :, 3] = 0.01                              # rank 3 of every decode row: share 0.011 < 0.5 / 8
    drops = []
    for name, weights in (("flat", flat), ("tiny", tiny)):
        monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / f"{name}.csv", ids, weights, n_prompt, 32)))
        tr = tmp_path / f"{name}.trace"
        _, llm = replay_greedy(model, slots=12, substitute="drop", trace=str(tr))
        del llm
        t = vtrace.read(tr)
        drops.append(t.outcome == DROPPED)
        if name == "tiny":
            dec = t.pos >= n_prompt
            assert drops[-1].any() and not drops[-1][~dec].any()
            assert (np.nonzero(drops[-1])[1] == 3).all()     # only the tiny-weight rank
    assert not drops[0].any()


@pytest.mark.parametrize("renorm", [False, True])
def test_a_drop_is_the_model_with_that_gate_weight_zeroed(fixture_dir, tmp_path, monkeypatch, renorm):
    """Bit for bit: the logits of a run with drop equal those of the same routing replayed (VIS_MOE_REPLAY, cache
    off: upstream's graph) with the dropped pairs' gate weights set to 0 (and, with renorm, the token's other weights
    scaled back to their sum), i.e. the dropped experts contribute nothing and nothing else changes."""
    from test_replay import greedy as replay_greedy, routing_of, write_csv
    model = fixture_dir / "qwen3moe.gguf"
    tr = tmp_path / "drop.trace"
    got, llm = replay_greedy(model, n_decode=10, slots=8, substitute="drop", sub_drop_share=1.0, sub_renorm=renorm,
                             trace=str(tr))
    n_prompt = len(llm.tokenize(b"replay the routing of a real model", add_bos=True))
    del llm
    t = vtrace.read(tr)
    ids, w = routing_of(tr, 3)                               # the routed ids and weights, before the drop
    drop = np.zeros(w.shape, bool)
    drop[t.pos, t.layer] = t.outcome == DROPPED
    assert drop.any() and not drop[:n_prompt].any()
    w2 = w.copy()
    for p, il in zip(*np.nonzero(drop.any(axis=2))):
        row = [float(x) for x in w[p, il]]                   # the runtime's arithmetic: doubles, summed in order
        before = sum(row)
        kept = [0.0 if drop[p, il, r] else x for r, x in enumerate(row)]
        f = before / sum(kept) if renorm else 1.0
        w2[p, il] = np.array([x * f for x in kept], np.float64).astype(np.float32)
    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "zeroed.csv", ids, w2, n_prompt, 32)))
    ref, llm = replay_greedy(model, n_decode=10)
    del llm
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_drops_reach_the_csv_and_the_mode_column(fixture_dir, tmp_path):
    """Drops (--moe-substitute drop) are lossy events of the telemetry (docs/telemetry.md): the CSV's `dropped` column sums
    to the drops the substitution counted, and every row of the lossy run says so."""
    path = fixture_dir / "qwen3moe.gguf"
    out = tmp_path / "drop.csv"
    _, llm = greedy_logits(path, PROMPT, 12, slots=fx.FIXTURES["qwen3moe"]().n_expert_used, substitute="drop",
                           csv=str(out))
    dropped = moe.sub_stats(llm)["outcomes"]["dropped"]
    del llm
    import csv
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert dropped > 0, "nothing was dropped: the test could not check anything"
    assert sum(int(r["dropped"]) for r in rows) == dropped
    assert all(r["mode"].startswith("lossy") and "drop" in r["mode"] for r in rows), {r["mode"] for r in rows}
