"""Expert residency: exactness against the feature-off path, stats, errors, trace.

The trust contract: with the cache on, greedy output and logits are
byte-identical to the feature-off path for every cache size and pinned prefix,
in prefill and decode, on every fixture architecture.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyvis import moe
from pyvis.runtime import native as _native, trace as vtrace
from pyvis.runtime.config import MoeConfig, applied
from pyvis.runtime.settings import MoeParams
from pyvis import fixtures as fx
from conftest import run

llama_cpp = _native.llama_cpp
ARCHS = ["qwen3moe", "deepseek2", "gptoss", "mixtral", "qwen3vlmoe"]
PROMPT = ("Mixture-of-experts layers route every token to a few experts; a cache keeps the hot ones "
          "resident and loads the rest on demand.")
N_DECODE = 6


def _slot_configs(spec) -> list[int]:
    k, n = spec.n_expert_used, spec.n_expert
    # below top-k too: a decode step then runs in ceil(k / slots) passes per layer
    return sorted({1, max(1, k // 2), k, 2 * k, max(k, n // 2), n})


def _pinned_configs(spec) -> list[int]:
    return [0, 1, -1]


def _run(path, params: MoeParams | None, n_ubatch: int = 512):
    """Prefill PROMPT, then greedy-decode N_DECODE tokens; return (all logits, tokens, stats, llm)."""
    kw = dict(n_ctx=256, n_batch=512, n_ubatch=n_ubatch, logits_all=True, n_threads=2, verbose=False, seed=1)
    llm = moe.load(path, moe.MoeConfig(slots=params.slots, cache_mib=params.cache_mib,
                                       pinned_layers=params.pinned_layers) if params else None, **kw)
    toks = llm.tokenize(PROMPT.encode(), add_bos=True)
    llm.eval(toks)
    out = []
    for _ in range(N_DECODE):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    logits = np.array(llm.scores[: llm.n_tokens], copy=True)
    return logits, out, moe.stats(llm), llm


@pytest.fixture(scope="module")
def reference(fixture_dir):
    """Feature-off logits per fixture (and per ubatch size)."""
    cache = {}

    def get(name, n_ubatch=512):
        key = (name, n_ubatch)
        if key not in cache:
            logits, toks, st, llm = _run(fixture_dir / f"{name}.gguf", None, n_ubatch)
            assert st is None  # no cache object when the feature is off
            cache[key] = (logits, toks)
            del llm
        return cache[key]
    return get


@pytest.mark.parametrize("name", ARCHS)
def test_byte_identical_for_every_cache_size_and_prefix(fixture_dir, reference, name):
    spec = fx.FIXTURES[name]()
    ref_logits, ref_toks = reference(name)
    n_moe = spec.n_layer - spec.n_dense_lead
    checked = 0
    for slots in _slot_configs(spec):
        for pinned in _pinned_configs(spec):
            logits, toks, st, llm = _run(fixture_dir / f"{name}.gguf", MoeParams(slots=slots, pinned_layers=pinned))
            where = f"{name} slots={slots} pinned={pinned}"
            assert toks == ref_toks, where
            assert logits.shape == ref_logits.shape, where
            assert np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32)), \
                f"{where}: max |diff| {np.abs(logits - ref_logits).max()}"
            managed_expected = 0 if (slots >= spec.n_expert or pinned == -1) else n_moe - min(pinned, n_moe)
            assert _native.moe_n_managed(llm) == managed_expected, where
            if managed_expected:
                assert st is not None and st.n_routed > 0 and st.n_misses > 0, where
            checked += 1
            del llm
    assert checked == len(_slot_configs(spec)) * 3


def test_overflowing_prefill_uses_passes_and_stays_exact(fixture_dir, reference):
    """qwen3moe: 8 slots of 32 experts, top-8: the prompt routes to far more experts than slots."""
    logits, toks, st, llm = _run(fixture_dir / "qwen3moe.gguf", MoeParams(slots=8))
    ref_logits, ref_toks = reference("qwen3moe")
    assert np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32))
    assert st.n_passes > st.n_calls  # at least one layer needed several passes
    # a small ubatch changes the reference too, but must also match its own feature-off run
    ref16, _ = reference("qwen3moe", n_ubatch=16)
    l16, _, _, _ = _run(fixture_dir / "qwen3moe.gguf", MoeParams(slots=8), n_ubatch=16)
    assert np.array_equal(l16.view(np.uint32), ref16.view(np.uint32))


def test_stats_add_up(fixture_dir):
    spec = fx.FIXTURES["qwen3moe"]()
    k = spec.n_expert_used
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=12),
                   n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    info = _native.moe_info(llm)
    llm.eval(llm.tokenize(b"stats must add up", add_bos=True))
    before = [moe.layer_stats(llm, il) for il in range(spec.n_layer)]
    for step in range(4):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    after = [moe.layer_stats(llm, il) for il in range(spec.n_layer)]
    tot = moe.stats(llm)
    assert tot.n_hits + tot.n_misses == tot.n_routed
    assert tot.bytes_loaded == tot.n_misses * info.expert_bytes
    for b, a in zip(before, after):
        assert a.managed and a.n_slots == 12
        assert a.n_hits + a.n_misses == a.n_routed
        assert a.bytes_loaded == a.n_misses * info.expert_bytes
        assert a.n_routed - b.n_routed == 4 * k        # a decode step looks up exactly top-k experts
        assert a.n_calls - b.n_calls == 4
    moe.reset_stats(llm)
    z = moe.stats(llm)
    assert (z.n_routed, z.n_hits, z.n_misses, z.bytes_loaded) == (0, 0, 0, 0)


def _decode_two_sequences(path, slots):
    """One batch holding two sequences (as parallel server slots do); logits of each last token."""
    with applied(MoeConfig(slots=slots)):
        mp = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 256, 128, 128, 2, 2, 2
        ctx = llama_cpp.llama_init_from_model(model, cp)
    assert ctx, _native.last_error()
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    seqs = [[1, 504, 1029, 6734, 314, 12010, 8613], [1, 339, 1645, 28, 1880, 6226, 2640, 260, 1159, 8613]]
    batch = llama_cpp.llama_batch_init(sum(map(len, seqs)), 0, 1)
    try:
        i, last = 0, []
        for seq, toks in enumerate(seqs):
            for p, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = p == len(toks) - 1
                i += 1
            last.append(i - 1)
        batch.n_tokens = i
        assert llama_cpp.llama_decode(ctx, batch) == 0
        stats = _native.moe_stats(ctx)
        out = np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).copy()
                        for j in last])
        return out, stats
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def test_two_sequences_share_the_cache_exactly(fixture_dir):
    path = fixture_dir / "deepseek2.gguf"
    ref, st0 = _decode_two_sequences(path, 0)
    got, st = _decode_two_sequences(path, 4)
    assert st0 is None and st is not None and st.n_passes > st.n_calls  # one shared cache, several passes
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("kw, needle", [
    (dict(pinned_layers=7, slots=8), "--moe-pinned-layers 7 exceeds the model's 3 MoE layers"),
    (dict(cache_mib=0, slots=-2), "MoeConfig slots: --moe-slots: expected an integer in 0..65536"),
])
def test_bad_configuration_is_a_clear_error(fixture_dir, kw, needle):
    with pytest.raises(_native.VisError) as e:
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(**kw), n_ctx=64, verbose=False)
    assert needle in str(e.value)


def test_budget_too_small_is_a_clear_error(tmp_path):
    """--moe-cache-mib below one slot per managed layer fails (CPU: no staging slot); at the bound it works."""
    spec = fx.ModelSpec(name="budget", arch="qwen3moe", n_layer=1, n_embd=512, n_head=4, n_head_kv=2, head_dim=64,
                        n_ff_exp=768, n_expert=8, n_expert_used=2)
    path = fx.write_model(spec, tmp_path / "budget.gguf")
    eb = sum(fx._byte_size(t) for t in fx.tensor_plan(spec) if t.name.endswith("_exps.weight")) // spec.n_expert
    need_mib = -(-eb // (1 << 20))    # one slot, rounded up to MiB
    assert need_mib >= 2
    with pytest.raises(_native.VisError, match=r"--moe-cache-mib 1 is too small: the 1 managed layers need at least"):
        moe.load(path, moe.MoeConfig(cache_mib=1), n_ctx=64, verbose=False)
    llm = moe.load(path, moe.MoeConfig(cache_mib=need_mib), n_ctx=64, verbose=False)
    st = moe.stats(llm)
    assert st is not None and st.n_slots == min(need_mib * (1 << 20) // eb, spec.n_expert)


def test_cli_flags_and_errors(bindir, fixture_dir):
    r = run([bindir / "llama-cli", "--help"])
    for flag in ("--moe-slots", "--moe-pinned-layers", "--moe-stats", "--moe-trace"):
        assert flag in r.stdout
    # fewer slots than top-k run (exact, in passes) and say what that costs
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-slots", "2", "-p", "hi", "-n", "2",
             "-st", "-c", "128", "--moe-stats"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 slots per layer, below the model's top-k (8): each decode step runs 4 passes" in r.stdout + r.stderr
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-slots", "-4", "-p", "hi", "-n", "2",
             "-st"], timeout=60)
    assert r.returncode != 0 and "--moe-slots" in r.stderr + r.stdout


def test_cli_stats_at_exit(bindir, fixture_dir):
    r = run([bindir / "llama-cli", "-m", fixture_dir / "mixtral.gguf", "--moe-slots", "4", "--moe-stats", "-p",
             "Experts", "-n", "4", "-st", "-c", "128", "-t", "2", "--temp", "0"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "vis-moe: expert cache stats (2 managed layers)" in out
    total = [l for l in out.splitlines() if l.startswith("vis-moe: total")]
    assert total, out[-2000:]
    routed, hits, misses = map(int, total[-1].split()[2:5])
    assert routed == hits + misses and misses > 0


def test_routing_trace(fixture_dir, tmp_path):
    spec = fx.FIXTURES["deepseek2"]()
    path = tmp_path / "route.trace"
    llm = moe.load(fixture_dir / "deepseek2.gguf", moe.MoeConfig(slots=8, trace=str(path)),
                   n_ctx=128, n_threads=2, verbose=False)
    toks = llm.tokenize(b"trace every routing decision", add_bos=True)
    llm.eval(toks)
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    del llm
    t = vtrace.read(path)
    assert (t.n_expert, t.n_expert_used) == (spec.n_expert, spec.n_expert_used)
    moe_layers = list(range(spec.n_dense_lead, spec.n_layer))
    assert sorted(t.layers().tolist()) == moe_layers
    for il in moe_layers:
        lt = t.for_layer(il)
        if il < spec.n_layer - 1:
            assert len(lt) == len(toks) + 1                 # prefill tokens + one decode token
            assert lt.pos.tolist() == list(range(len(toks) + 1))
        else:  # upstream computes the last layer for the output rows only (one per ubatch here)
            assert lt.pos.tolist() == [len(toks) - 1, len(toks)]
        assert lt.ubatch.tolist() == sorted(lt.ubatch.tolist())
        assert np.all((lt.ids >= 0) & (lt.ids < spec.n_expert))
        assert all(len(set(r)) == spec.n_expert_used for r in lt.ids.tolist())  # top-k ids are distinct
        assert np.all(lt.weights > 0)
        assert np.all(lt.modality == 0)


def test_trace_also_works_without_cache(fixture_dir, tmp_path):
    """Tracing alone (no slots) records every MoE layer, and output is unchanged."""
    path = tmp_path / "t.trace"
    ref = llama_cpp.Llama(str(fixture_dir / "mixtral.gguf"), n_ctx=128, verbose=False, logits_all=True, n_threads=2)
    toks = ref.tokenize(b"no cache, only a trace", add_bos=True)
    ref.eval(toks)
    llm = moe.load(fixture_dir / "mixtral.gguf", moe.MoeConfig(trace=str(path)),
                   n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    llm.eval(toks)
    assert np.array_equal(np.asarray(ref.scores[: len(toks)]), np.asarray(llm.scores[: len(toks)]))
    del llm
    t = vtrace.read(path)
    assert sorted(t.layers().tolist()) == [0, 1]
    assert len(t.for_layer(0)) == len(toks) and len(t.for_layer(1)) == len(toks)  # logits_all: every row is an output


def test_bad_trace_file_is_rejected(tmp_path):
    p = tmp_path / "x.trace"
    p.write_bytes(b"garbage!" + bytes(40))
    with pytest.raises(vtrace.TraceError, match="not a vis-moe routing trace"):
        vtrace.read(p)


def test_native_trace_feeds_the_routing_report(fixture_dir, tmp_path):
    """A --moe-trace file is accepted by `pyvis report` (same numbers as its own collector's format)."""
    from pyvis.testbed import routing_report
    path = tmp_path / "r.trace"
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(trace=str(path)), n_ctx=128, n_threads=2, verbose=False)
    llm.eval(llm.tokenize(b"a routing trace for the report, long enough to reuse experts", add_bos=True))
    del llm
    t = vtrace.load(path)
    ids, layers = t.routes()
    assert t.n_expert == 32 and t.k == 8 and list(layers) == [0, 1]  # last layer (output rows only) left out
    assert np.array_equal(ids[0], t.for_layer(0).ids)
    r = routing_report.analyse(t)
    assert r is not None
