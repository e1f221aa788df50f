"""VIS_MOE_REPLAY: a recorded routing trace (the shared CSV format) replayed in place of the routers
(src/features/vis-moe-replay.h, docs/benchmarks.md#replaying-recorded-routing).

The routing the runtime records with --moe-trace (what the passes and upstream's mul_mat_id read) must be the CSV's,
token by token, with the cache off (the upstream-path baseline) and on; the replayed weights must be what the experts'
outputs are weighted by (a replay of the model's own routing gives its logits bit for bit, other weights do not);
a mismatched or malformed trace (also a top-k other than the model's) is a clear error naming the file; llama-server refuses the knob; without the knob
nothing changes.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run
from pyvis import moe
from pyvis.runtime import native as _native, trace as vtrace

HEADER = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"
PROMPT = b"replay the routing of a real model"
N_DECODE = 3
KW = dict(n_ctx=128, n_batch=512, n_ubatch=512, n_threads=2, verbose=False, seed=1)


def write_csv(path, ids, weights, n_prompt, n_expert, missing=(), n_layer=None, k=None, extra_rows=()):
    """The shared CSV format (../shared/traces/README.md) for ids/weights [positions, layers, k]; (pos, layer) pairs in
    `missing` get no rows (a recording's last layer of non-output prompt tokens)."""
    P, L, K = ids.shape
    lines = ["# route_trace v1",
             f"# model=test.gguf arch=qwen3moe n_layer={n_layer or L} n_expert={n_expert} n_expert_used={k or K}"]
    lines += [f"# layer={il} expert_bytes=1000 dense_bytes=10" for il in range(L)]
    lines.append(HEADER)
    for p in range(P):
        for il in range(L):
            if (p, il) in missing:
                continue
            for s in range(K):
                lines.append(f"0,{int(p >= n_prompt)},{p},{il},{s},{ids[p, il, s]},{weights[p, il, s]:.9g},0,1000")
    lines += list(extra_rows)
    path.write_text("\n".join(lines) + "\n")
    return path


def random_routing(P, L, E, K, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(P)]).astype(np.int32)
    w = rng.uniform(0.05, 1.0, (P, L, K)).astype(np.float32)
    return ids, (w / w.sum(axis=2, keepdims=True)).astype(np.float32)


def greedy(model, n_decode=N_DECODE, **moe_kw):
    """Logits of PROMPT (one ubatch, every row an output) and n_decode greedy steps; the Llama."""
    llm = moe.load(model, moe.MoeConfig(**moe_kw), logits_all=True, **KW)
    llm.eval(llm.tokenize(PROMPT, add_bos=True))
    for _ in range(n_decode):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return np.array(llm.scores[: llm.n_tokens], copy=True), llm


def routing_of(trace_path, n_layer):
    """ids/weights [positions, layers, k] from a --moe-trace file (one sequence, every row an output)."""
    t = vtrace.read(trace_path)
    P = int(t.pos.max()) + 1
    ids = np.full((P, n_layer, t.k), -1, np.int32)
    w = np.zeros((P, n_layer, t.k), np.float32)
    ids[t.pos, t.layer] = t.ids
    w[t.pos, t.layer] = t.weights
    return ids, w


CACHE = {"cache off": {}, "cache on": dict(slots=4)}   # 4 slots < top-8: the managed layers run in passes


@pytest.fixture(scope="module")
def model(fixture_dir):
    return fixture_dir / "qwen3moe.gguf"   # 3 MoE layers x 32 experts, top-8


@pytest.fixture(scope="module")
def own(model, tmp_path_factory):
    """The model's own routing and logits, recorded without replay."""
    path = tmp_path_factory.mktemp("own") / "own.trace"
    logits, llm = greedy(model, trace=str(path))
    n_prompt = len(llm.tokenize(PROMPT, add_bos=True))
    del llm
    ids, w = routing_of(path, 3)
    assert (ids >= 0).all()
    return logits, ids, w, n_prompt


@pytest.mark.parametrize("cache", list(CACHE))
def test_replay_runs_the_traced_experts_and_weights(model, own, tmp_path, monkeypatch, cache):
    """A random routing replayed: the recorded routing is the CSV's token by token (ids and weights), and the logits
    change; the model's own routing replayed: its logits bit for bit (the weights are the ones the outputs use)."""
    ref, own_ids, own_w, n_prompt = own
    P = n_prompt + N_DECODE
    ids, w = random_routing(P, 3, 32, 8)
    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "rand.csv", ids, w, n_prompt, 32)))
    logits, llm = greedy(model, trace=str(tmp_path / "rand.trace"), **CACHE[cache])
    del llm
    got_ids, got_w = routing_of(tmp_path / "rand.trace", 3)
    assert got_ids.shape == ids.shape
    assert np.array_equal(got_ids, ids)
    assert np.array_equal(got_w, w)
    assert not np.array_equal(logits[:n_prompt], ref[:n_prompt])

    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "own.csv", own_ids[:P], own_w[:P], n_prompt, 32)))
    logits, llm = greedy(model, **CACHE[cache])
    del llm
    assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32))

    # the same experts at other weights: the outputs are weighted by the replayed weights
    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "flat.csv", own_ids[:P],
                                                         np.full_like(own_w[:P], 1 / 8), n_prompt, 32)))
    logits, llm = greedy(model, trace=str(tmp_path / "flat.trace"), **CACHE[cache])
    del llm
    assert not np.array_equal(logits[:n_prompt], ref[:n_prompt])
    assert np.array_equal(routing_of(tmp_path / "flat.trace", 3)[0], own_ids[:P])


def test_prompt_rows_the_recording_lacks_run_the_router(model, own, tmp_path, monkeypatch):
    """A recording has the last layer for its last prompt token only; a run that computes it for every prompt row
    (all logits) replays every other row and runs the router's own choice on those (with the layers before it
    replaying the model's own routing, that is the model's own choice)."""
    _, own_ids, own_w, n_prompt = own
    P = n_prompt + N_DECODE
    ids, w = random_routing(P, 3, 32, 8, seed=5)
    ids[:n_prompt, :2], w[:n_prompt, :2] = own_ids[:n_prompt, :2], own_w[:n_prompt, :2]
    lacking = {(p, 2) for p in range(n_prompt - 1)}
    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "last.csv", ids, w, n_prompt, 32, missing=lacking)))
    _, llm = greedy(model, n_decode=0, trace=str(tmp_path / "last.trace"))
    del llm
    got, _ = routing_of(tmp_path / "last.trace", 3)
    assert np.array_equal(got[: n_prompt, :2], ids[: n_prompt, :2])
    assert np.array_equal(got[n_prompt - 1, 2], ids[n_prompt - 1, 2])
    assert np.array_equal(got[: n_prompt - 1, 2], own_ids[: n_prompt - 1, 2])   # the router's choice
    assert not np.array_equal(ids[: n_prompt - 1, 2], own_ids[: n_prompt - 1, 2])


def test_without_the_knob_routing_is_the_models_own(model, own, tmp_path, monkeypatch):
    """Replay never reaches a default path: unset (or empty), the recorded routing and logits are the model's own."""
    ref, own_ids, _, _ = own
    monkeypatch.setenv("VIS_MOE_REPLAY", "")
    logits, llm = greedy(model, trace=str(tmp_path / "plain.trace"), slots=4)
    del llm
    assert np.array_equal(routing_of(tmp_path / "plain.trace", 3)[0], own_ids)
    assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32))
    assert _native.capi.llama_vis_moe_replay_trace() is None


def test_a_smaller_trace_top_k_runs_under_moe_topk(model, own, tmp_path, monkeypatch):
    """A top-6 trace on the top-8 model: --moe-topk 6 (the alternative to --override-kv) runs exactly its experts."""
    _, _, _, n_prompt = own
    ids, w = random_routing(n_prompt + N_DECODE, 3, 32, 6, seed=7)
    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "k6.csv", ids, w, n_prompt, 32)))
    _, llm = greedy(model, trace=str(tmp_path / "k6.trace"), topk=6)
    del llm
    got_ids, got_w = routing_of(tmp_path / "k6.trace", 3)
    assert np.array_equal(got_ids, ids) and np.array_equal(got_w, w)


def test_moe_topk_below_the_traces_top_k_replays_its_highest_weighted_experts(model, own, tmp_path, monkeypatch):
    """A trace at the model's top-8 under --moe-topk 5 (how `--moe-mode fast`-style fewer experts are benchmarked on
    a recorded trace): each row runs its 5 highest-weighted recorded experts in weight order, their weights
    renormalised to the row's total, as a router's top-5 would."""
    _, _, _, n_prompt = own
    ids, w = random_routing(n_prompt + N_DECODE, 3, 32, 8, seed=11)
    monkeypatch.setenv("VIS_MOE_REPLAY", str(write_csv(tmp_path / "k8.csv", ids, w, n_prompt, 32)))
    _, llm = greedy(model, trace=str(tmp_path / "k5.trace"), topk=5, slots=4)
    del llm
    got_ids, got_w = routing_of(tmp_path / "k5.trace", 3)
    order = np.argsort(-w, axis=2, kind="stable")[:, :, :5]
    want_w = np.take_along_axis(w, order, 2)
    want_w = want_w * (w.sum(axis=2, keepdims=True) / want_w.sum(axis=2, keepdims=True))
    assert np.array_equal(got_ids, np.take_along_axis(ids, order, 2))
    assert np.allclose(got_w, want_w, rtol=1e-5, atol=0)
    assert not np.array_equal(got_ids, ids[:, :, :5])   # weight order is not the CSV's slot order here


def _bad_csvs(tmp_path):
    ids, w = random_routing(4, 3, 32, 8)
    ok = dict(ids=ids, weights=w, n_prompt=2, n_expert=32)
    ids4, w4 = random_routing(4, 4, 32, 8)
    yield "layers", write_csv(tmp_path / "l4.csv", ids4, w4, 2, 32), "the MoE layer counts differ"
    yield "experts", write_csv(tmp_path / "e64.csv", **{**ok, "n_expert": 64}), "the expert counts differ"
    ids9, w9 = random_routing(4, 3, 32, 9)
    yield "top-k", write_csv(tmp_path / "k9.csv", ids9, w9, 2, 32), \
        "top-9 is above the model's; run the model at the trace's top-k: --override-kv qwen3moe.expert_used_count=int:9"
    ids6, w6 = random_routing(4, 3, 32, 6)
    yield "top-k below", write_csv(tmp_path / "k6.csv", ids6, w6, 2, 32), \
        "top-6 is below the model's; run the model at the trace's top-k: --override-kv qwen3moe.expert_used_count=int:6"
    yield "malformed", write_csv(tmp_path / "bad.csv", **ok, extra_rows=["0,1,4,0,0,x7,0.5,0,1000"]), \
        "expert must be an integer in 0..31, got 'x7'"
    yield "short row", write_csv(tmp_path / "short.csv", **ok, extra_rows=["0,1,4,0,0"]), "expected 9 comma-separated"
    yield "gap", write_csv(tmp_path / "gap.csv", **ok, missing={(2, 1)}), \
        "step 2 has no rows for layer 1: only prompt steps before the last may lack layers"
    yield "missing", tmp_path / "nope.csv", "cannot open the routing trace"


def test_mismatched_or_malformed_trace_is_a_clear_error(model, tmp_path, monkeypatch):
    for what, path, needle in _bad_csvs(tmp_path):
        monkeypatch.setenv("VIS_MOE_REPLAY", str(path))
        with pytest.raises(_native.VisError) as e:
            moe.load(model, **KW)
        assert str(path) in str(e.value) and needle in str(e.value), what


def test_cli_past_the_end_stops_with_an_error_and_says_replay_is_on(bindir, model, tmp_path):
    """llama-cli: the loud line; a prompt plus generation longer than the trace fails at the first position past its
    end (never wraps), after the positions the trace holds ran."""
    ids, w = random_routing(40, 3, 32, 8)
    csv = write_csv(tmp_path / "t.csv", ids, w, 30, 32, missing={(p, 2) for p in range(29)})
    args = [bindir / "llama-cli", "-m", model, "-p", "hi", "-n", "64", "-st", "-c", "256", "-t", "2", "--ignore-eos",
            "--moe-trace", tmp_path / "cli.trace"]
    r = run(args, extra_env={"VIS_MOE_REPLAY": str(csv)}, timeout=180)
    out = r.stdout + r.stderr
    assert "OUTPUTS ARE MEANINGLESS" in out
    # llama-cli's 2-token context check has an output at position 1, where the recording lacks the last layer
    assert "has no routing for layer 2 (model layer 2) at prompt position 1" in out
    assert r.returncode != 0
    assert f"{csv} ends at position 39" in out and "position 40 is past it" in out
    t = vtrace.read(tmp_path / "cli.trace")
    assert int(t.pos.max()) >= 39


def test_server_refuses_replay(bindir, model, tmp_path):
    ids, w = random_routing(4, 3, 32, 8)
    csv = write_csv(tmp_path / "t.csv", ids, w, 2, 32)
    r = run([bindir / "llama-server", "-m", model, "--port", "0"], extra_env={"VIS_MOE_REPLAY": str(csv)}, timeout=60)
    assert r.returncode == 1
    assert "VIS_MOE_REPLAY" in r.stdout + r.stderr and "llama-server refuses it" in r.stdout + r.stderr
