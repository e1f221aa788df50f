"""The precision policy (issue #14 item 2, docs/precision.md): misses served from shadow experts.

- a shadow pass computes what upstream's mul_mat_id computes on the shadow tensor: with --moe-precision all and no
  refetch every managed expert runs from its shadow, and the logits equal, bit for bit, upstream's on the *hybrid*
  model (the model with the shadow's expert tensors in place, plain layout), on four architectures, with one and
  several shadow passes per ubatch; an image prompt through libmtmd gives the hybrid's routing trace and text;
- everything off, and --moe-precision vision on text-only prompts: byte-identical to no precision at all;
- vision on an image prompt: image ubatches are vision-dominated, misses run from shadows, stats add up;
- gate: only decode steps, and the served count follows the threshold;
- auto: the controller moves the share (target 1: the share halves to 0, switches counted);
- no sidecar, bad values, a failing shadow read: clear errors.
"""
from __future__ import annotations

import contextlib
import sys
import re

import numpy as np
import pytest

import pyvis  # noqa: F401
import pyvis.fixtures as fx
from pyvis import moe
from pyvis.runtime import shadow as sh
from pyvis.runtime import trace as vtrace
from pyvis.runtime.native import VisError
from pyvis.runtime.config import MoeConfig, applied
from pyvis.runtime.settings import MoeParams, PrecisionParams
from conftest import run

PROMPT = b"Shadow experts stand in for the missing ones while the full weights are read"
N_DECODE = 6
# architecture -> shadow type (the rows of each fixture divide into its blocks)
ARCH_TYPE = {"qwen3moe": "Q4_0", "deepseek2": "Q5_0", "gptoss": "Q5_1", "mixtral": "Q4_1"}


@pytest.fixture(scope="module")
def shadows(fixture_dir, tmp_path_factory):
    """name -> (model, shadow, hybrid model)"""
    d = tmp_path_factory.mktemp("precision")
    out = {}
    for name, typ in ARCH_TYPE.items():
        model = fixture_dir / f"{name}.gguf"
        s = d / f"{name}.shadow-{typ}.gguf"
        sh.write_shadow(model, typ, s, threads=2)
        out[name] = (model, s, sh.write_hybrid(model, s, d / f"{name}.hybrid.gguf"))
    return out


def _greedy(path, extra_bufts=True, moe=None, prec=None, prompt=PROMPT, n_decode=N_DECODE, prompt2=None):
    """Logits of a prompt (one batch) and n_decode greedy steps through the low-level API (llama_cpp.Llama takes no
    use_extra_bufts), then, with prompt2, that text (one batch) and n_decode more steps; and the precision stats of
    the context (None without a cache)."""
    import llama_cpp as L
    from pyvis.runtime import native
    cm = applied(MoeConfig.of(moe, prec)) if moe else contextlib.nullcontext()
    with cm:
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        assert model, native.last_error()
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = 256, 2, 2
        ctx = L.llama_init_from_model(model, cp)
    assert ctx, native.last_error()
    vocab = L.llama_model_get_vocab(model)
    nv = L.llama_vocab_n_tokens(vocab)
    toks = (L.llama_token * 128)()
    n = L.llama_tokenize(vocab, prompt, len(prompt), toks, 128, True, False)
    rows = []
    b = L.llama_batch_init(128, 0, 1)
    try:
        def decode(tokens, pos0):
            for i, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, 1
                b.seq_id[i][0] = 0
            b.n_tokens = len(tokens)
            assert L.llama_decode(ctx, b) == 0, native.last_error()
            for i in range(len(tokens)):
                rows.append(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (nv,)).copy())
        decode([toks[i] for i in range(n)], 0)
        for s in range(n_decode):
            decode([int(np.argmax(rows[-1]))], n + s)
        if prompt2:
            pos = n + n_decode
            n2 = L.llama_tokenize(vocab, prompt2, len(prompt2), toks, 128, False, False)
            decode([toks[i] for i in range(n2)], pos)
            for s in range(n_decode):
                decode([int(np.argmax(rows[-1]))], pos + n2 + s)
        stats = native.prec_stats(ctx, -1) if moe else None
        return np.array(rows), stats
    finally:
        L.llama_batch_free(b)
        L.llama_free(ctx)
        L.llama_model_free(model)


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("stream", ["staged", "lent"])
def test_a_streamed_prompt_forgets_the_shadow_slots(fixture_dir, tmp_path, monkeypatch, stream):
    """A streamed ubatch lends the slab memory, or stages layers in it, the shadow slabs included (their pages go
    back as zeros, or hold another layer's experts): every shadow slot must be forgotten.  A Q8_0 shadow of the Q8_0
    fixture is the model's bytes, so every mix of full and shadow passes computes upstream's logits bit for bit: a
    shadow slot still thought to hold its expert after the second prompt streamed would show.  10 slots per layer
    (and 10 shadow slots) cannot stage a layer's 32 experts in the slabs alone: staging spans both."""
    model = fixture_dir / "qwen3moe.gguf"
    shadow = tmp_path / "qwen3moe.shadow-Q8_0.gguf"
    sh.write_shadow(model, "Q8_0", shadow, threads=2)
    import gguf
    same = {t.name: bytes(np.asarray(t.data).view(np.uint8)) for t in gguf.GGUFReader(model).tensors}
    assert all(bytes(np.asarray(t.data).view(np.uint8)) == same[t.name] for t in gguf.GGUFReader(shadow).tensors
               if t.name != sh.T_SUMS)
    second = b" and a second prompt long enough to stream through every managed layer of the model once more"
    ref, _ = _greedy(model, extra_bufts=False, prompt2=second)
    monkeypatch.setenv("VIS_MOE_STREAM_PASSES", "1")  # every prompt streams; decode steps run in passes
    monkeypatch.setenv("VIS_MOE_STREAM_STAGE", "on" if stream == "staged" else "off")
    monkeypatch.setenv("VIS_MOE_STREAM_LEND", "off" if stream == "staged" else "on")
    got, st = _greedy(model, extra_bufts=False, moe=MoeParams(slots=10), prompt2=second,
                      prec=PrecisionParams(str(shadow), "all", prec_refetch=False))
    assert _same(got, ref), stream
    assert st["n_shadow_hits"] > 0 and st["n_shadow_reads"] > 30  # decode re-read what the streamed prompt dropped


@pytest.mark.parametrize("name", list(ARCH_TYPE))
def test_all_from_shadows_is_upstream_on_the_hybrid_model(shadows, name, monkeypatch):
    model, shadow, hybrid = shadows[name]
    monkeypatch.setenv("VIS_MOE_STREAM_PASSES", "0")  # the prompt in passes, not streamed (see the staged test below)
    ref, _ = _greedy(hybrid, extra_bufts=False)       # managed layers compute on the plain layout
    base, _ = _greedy(model, extra_bufts=False)
    assert not _same(ref, base)                        # the shadow changes the output: the check below is not vacuous
    for slots, shadow_slots in ((2, 2), (4, "auto"), (2, 64)):
        got, st = _greedy(model, moe=MoeParams(slots=slots),
                          prec=PrecisionParams(str(shadow), "all", prec_refetch=False, shadow_slots=shadow_slots))
        assert _same(got, ref), (name, slots, shadow_slots)
        assert st["n_shadow"] == st["n_eligible"] > 0 and st["n_shadow_pairs"] > 0 and st["n_refetch"] == 0
        assert st["n_shadow_reads"] + st["n_shadow_hits"] == st["n_shadow"]


@pytest.mark.parametrize("name", list(ARCH_TYPE))
def test_all_staged_from_shadows_is_upstream_on_the_hybrid_model(shadows, name, monkeypatch):
    """A prompt that streams, staged (vis-moe-stage.h), under --moe-precision all reads the layers' *shadows* into
    the staging buffers: upstream's mul_mat_id on the shadow type, so the prompt and the decode steps after it (from
    shadow slots) equal the hybrid model's logits bit for bit; the stats count every routed expert as served."""
    model, shadow, hybrid = shadows[name]
    spec = fx.FIXTURES[name]()
    slots = min(spec.n_expert - 1, -(-2 * spec.n_expert // (spec.n_layer - spec.n_dense_lead)) + 1)
    ref, _ = _greedy(hybrid, extra_bufts=False)
    monkeypatch.setenv("VIS_MOE_STREAM_PASSES", "1")  # every prompt streams
    monkeypatch.setenv("VIS_MOE_STREAM_STAGE", "on")
    got, st = _greedy(model, extra_bufts=False, moe=MoeParams(slots=slots),
                      prec=PrecisionParams(str(shadow), "all", prec_refetch=False))
    assert _same(got, ref), name
    assert st["n_shadow"] == st["n_eligible"] > 0 and st["n_shadow_pairs"] > 0
    monkeypatch.setenv("VIS_MOE_PREC_VISION", "1")  # vision on a text prompt: staged in full precision, as upstream
    got, st = _greedy(model, extra_bufts=False, moe=MoeParams(slots=slots),
                      prec=PrecisionParams(str(shadow), "vision", prec_refetch=False))
    assert _same(got, _greedy(model, extra_bufts=False)[0]) and st["n_shadow"] == 0


def test_staging_shadows_of_a_deep_model(tmp_path, monkeypatch):
    """Sixteen layers: the staging context holds every layer's expert tensors and their shadows' stand-ins (it
    once held only the former, and a 16-layer model aborted at load); staged from shadows, still the hybrid."""
    import dataclasses
    spec = dataclasses.replace(fx.FIXTURES["qwen3moe"](), name="qwen3moe-16L", n_layer=16)
    model = tmp_path / "deep.gguf"
    fx.write_model(spec, model)
    shadow = sh.write_shadow(model, "Q4_0", tmp_path / "deep.shadow.gguf", threads=2)["path"]
    ref, _ = _greedy(sh.write_hybrid(model, shadow, tmp_path / "deep.hybrid.gguf"), extra_bufts=False, n_decode=2)
    monkeypatch.setenv("VIS_MOE_STREAM_PASSES", "1")
    got, st = _greedy(model, extra_bufts=False, moe=MoeParams(slots=8), n_decode=2,
                      prec=PrecisionParams(str(shadow), "all", prec_refetch=False))
    assert _same(got, ref) and st["n_shadow_reads"] > 0


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2"])
def test_off_and_vision_on_text_are_byte_identical(shadows, name):
    model, shadow, _ = shadows[name]
    for slots in (2, 6):
        plain, _ = _greedy(model, moe=MoeParams(slots=slots))
        for prec in (PrecisionParams(str(shadow)), PrecisionParams(str(shadow), "vision", prec_vision=0.0),
                     PrecisionParams(str(shadow), "gate", prec_gate=0.0)):
            got, st = _greedy(model, moe=MoeParams(slots=slots), prec=prec)
            assert _same(got, plain), (slots, prec)
            assert st["n_shadow"] == 0 and st["n_shadow_pairs"] == 0 and st["n_vision_ubatches"] == 0


def test_gate_rule_serves_decode_misses_only(shadows):
    model, shadow, _ = shadows["qwen3moe"]
    plain, _ = _greedy(model, moe=MoeParams(slots=2))
    got, st = _greedy(model, moe=MoeParams(slots=2), prec=PrecisionParams(str(shadow), "gate", prec_gate=1.0))
    n_prompt = got.shape[0] - N_DECODE
    # the prompt ran in full precision: its logits are the exact ones; decode steps then differ
    assert _same(got[:n_prompt], plain[:n_prompt]) and not _same(got, plain)
    assert 0 < st["n_shadow"] == st["n_eligible"] and st["n_shadow_pairs"] <= N_DECODE * 8 * 3
    # a lower threshold serves fewer
    _, st2 = _greedy(model, moe=MoeParams(slots=2), prec=PrecisionParams(str(shadow), "gate", prec_gate=0.12))
    assert st2["n_shadow"] < st["n_shadow"]


def test_auto_controller_backs_off_when_reads_keep_up(shadows):
    """auto with --moe-prec-target 1: no stall share is above it, so every ubatch with eligible misses halves the
    share until it is 0; the first ubatches still serve from shadows."""
    model, shadow, _ = shadows["qwen3moe"]
    _, st = _greedy(model, moe=MoeParams(slots=2), n_decode=16,
                    prec=PrecisionParams(str(shadow), "auto", prec_gate=1.0, prec_target=1.0))
    assert st["share_pct"] == 0 and st["n_switches"] >= 7
    assert 0 < st["n_shadow"] < st["n_eligible"]
    # target 0: the controller never moves, every eligible miss runs from its shadow
    _, st0 = _greedy(model, moe=MoeParams(slots=2), n_decode=16,
                     prec=PrecisionParams(str(shadow), "auto", prec_gate=1.0, prec_target=0.0))
    assert st0["share_pct"] == 100 and st0["n_switches"] == 0 and st0["n_shadow"] == st0["n_eligible"] > 0


def test_refetch_reads_the_full_expert_in_the_background(shadows):
    model, shadow, _ = shadows["qwen3moe"]
    _, st = _greedy(model, moe=MoeParams(slots=6), prec=PrecisionParams(str(shadow), "gate", prec_gate=1.0))
    assert st["n_refetch"] > 0
    _, off = _greedy(model, moe=MoeParams(slots=6),
                     prec=PrecisionParams(str(shadow), "gate", prec_gate=1.0, prec_refetch=False))
    assert off["n_refetch"] == 0 and off["n_shadow"] > st["n_shadow"]  # nothing refilled: more misses stay misses


# ---- images (libmtmd) ---------------------------------------------------------------------------------------------
def _mtmd(bindir, fixture_dir, model, *extra, env=None):
    return run([bindir / "llama-mtmd-cli", "-m", model, "--mmproj", fixture_dir / "qwen3vlmoe-mmproj.gguf",
                "--image", fixture_dir / "test-image.png", "-p", "Describe the image.", "-n", "6", "--temp", "0",
                "-c", "512", "-t", "2", *extra], timeout=240, extra_env=env)


@pytest.fixture(scope="module")
def vlm_shadow(fixture_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("vlm-precision")
    model = fixture_dir / "qwen3vlmoe.gguf"
    s = sh.write_shadow(model, "Q4_0", d / "vl.shadow.gguf", threads=2)["path"]
    return model, s, sh.write_hybrid(model, s, d / "vl.hybrid.gguf")


def _prec_table(text):
    """The total row of the --moe-stats precision table: eligible, shadow, pairs, hits, reads, ..., vision."""
    m = re.search(r"vis-moe:\s+total\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+(\d+)",
                  text[text.find("precision (--moe-precision"):])
    assert m, text[-3000:]
    g = m.groups()
    return dict(eligible=int(g[0]), shadow=int(g[1]), pairs=int(g[2]), hits=int(g[3]), reads=int(g[4]),
                refetch=int(g[7]), vision=int(g[9]))


@pytest.mark.parametrize("stream", ["passes", "staged"])
def test_image_prompt_all_from_shadows_is_the_hybrid(bindir, fixture_dir, vlm_shadow, tmp_path, stream):
    """passes: every ubatch in passes from shadow slots; staged: every prompt ubatch (the image's too) streams,
    staged from the layers' shadows (12 slots of 16 and as many shadow slots: the slabs hold two layers)."""
    model, shadow, hybrid = vlm_shadow
    env = {"VIS_MOE_STREAM_PASSES": "0"} if stream == "passes" else {"VIS_MOE_STREAM_PASSES": "1"}
    slots = "4" if stream == "passes" else "12"
    ref = _mtmd(bindir, fixture_dir, hybrid, "-nr", "--moe-trace", tmp_path / "ref.trace")
    got = _mtmd(bindir, fixture_dir, model, "--moe-slots", slots, "--moe-shadow", shadow, "--moe-precision", "all",
                "--moe-prec-refetch", "off", "--moe-stats", "--moe-trace", tmp_path / "got.trace", env=env)
    assert ref.returncode == 0 and got.returncode == 0, got.stderr[-3000:]
    a, b = vtrace.read(tmp_path / "ref.trace"), vtrace.read(tmp_path / "got.trace")
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights.view(np.uint32), b.weights.view(np.uint32))
    assert got.stdout == ref.stdout
    assert ("vis-moe: staged streaming:" in got.stderr) == (stream == "staged"), got.stderr[-3000:]


def test_vision_policy_serves_image_misses(bindir, fixture_dir, vlm_shadow):
    model, shadow, _ = vlm_shadow
    common = ["--moe-slots", "4", "--moe-shadow", shadow, "--moe-stats"]
    r = _mtmd(bindir, fixture_dir, model, *common, "--moe-precision", "vision")
    assert r.returncode == 0, r.stderr[-3000:]
    t = _prec_table(r.stderr)
    assert t["vision"] > 0 and t["shadow"] > 0 and t["pairs"] >= t["shadow"] and t["hits"] + t["reads"] == t["shadow"]
    # libmtmd decodes an image in ubatches of their own: all image tokens, so even a threshold of 1 is met
    r1 = _mtmd(bindir, fixture_dir, model, *common, "--moe-precision", "vision", "--moe-prec-vision", "1")
    assert r1.returncode == 0 and _prec_table(r1.stderr)["vision"] == t["vision"]
    # an image ubatch that streams is staged from the shadows: every routed expert of a layer is a served miss
    env = {"VIS_MOE_STREAM_PASSES": "1"}
    r2 = _mtmd(bindir, fixture_dir, model, *common[2:], "--moe-slots", "12", "--moe-precision", "vision", env=env)
    assert r2.returncode == 0 and "vis-moe: staged streaming:" in r2.stderr, r2.stderr[-3000:]
    t2 = _prec_table(r2.stderr)
    assert t2["vision"] > 0 and t2["shadow"] == t2["eligible"] == t2["reads"] > 0 and t2["pairs"] > t2["shadow"]
    # at the default --moe-stream-passes 8 an image ubatch that would stage its shadows streams from its second
    # pass on (2 here), where exact runs it in passes
    r5 = _mtmd(bindir, fixture_dir, model, *common[2:], "--moe-slots", "12", "--moe-precision", "vision")
    ex = _mtmd(bindir, fixture_dir, model, *common[2:], "--moe-slots", "12")
    assert r5.returncode == 0 and ex.returncode == 0, r5.stderr[-3000:]
    assert "vis-moe: staged streaming:" in r5.stderr and "staged streaming:" not in ex.stderr, r5.stderr[-3000:]
    assert _prec_table(r5.stderr)["shadow"] > 0


# ---- errors -------------------------------------------------------------------------------------------------------
def _cli(bindir, model, *extra, env=None):
    r = run([bindir / "llama-cli", "-m", model, "-p", "Hi", "-n", "2", "-st", "--temp", "0", "-c", "128", "-t", "2",
             "--no-warmup", "--moe-slots", "2", *extra], timeout=180, extra_env=env)
    return r, r.stdout + r.stderr


@pytest.mark.parametrize("extra, says", [
    (["--moe-precision", "vision"], "add --moe-shadow FILE (make one with: pyvis shadow MODEL"),
    (["--moe-precision", "sometimes"], "--moe-precision: expected off, vision, gate, all or auto, got 'sometimes'"),
    (["--moe-prec-gate", "1.5"], "--moe-prec-gate: expected a number in 0..1"),
    (["--moe-prec-vision", "x"], "--moe-prec-vision: expected a number in 0..1"),
    (["--moe-prec-target", "-1"], "--moe-prec-target: expected a number in 0..1"),
    (["--moe-shadow-slots", "0"], "--moe-shadow-slots: expected an integer in 1..65536 (or auto), got '0'"),
    (["--moe-prec-refetch", "sometimes"], "--moe-prec-refetch: expected on or off"),
])
def test_bad_settings_are_clear_errors(bindir, fixture_dir, extra, says):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", *extra)
    assert r.returncode != 0 and says in out, out[-2000:]


def test_bad_settings_through_python(fixture_dir):
    with pytest.raises(VisError, match="add --moe-shadow FILE"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=2, precision="gate"), n_ctx=128, verbose=False)
    with pytest.raises(VisError, match="--moe-prec-gate"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=2, precision="gate", prec_gate=2.0),
                 n_ctx=128, verbose=False)


def test_failed_shadow_read_fails_the_decode(bindir, shadows):
    model, shadow, _ = shadows["qwen3moe"]
    r, out = _cli(bindir, model, "--moe-shadow", shadow, "--moe-precision", "all", "--moe-prec-refetch", "off",
                  env={"VIS_MOE_FAULT_READ": "*", "VIS_MOE_STREAM_PASSES": "0"})
    assert r.returncode != 0 and "injected by VIS_MOE_FAULT_READ" in out and shadow.name in out, out[-2000:]


def test_shadow_slots_share_the_memory_plan(medium_model, tmp_path, monkeypatch):
    """Under --moe-mem the shadow slots share the budget: one per full slot (auto), or a fixed number taken off the
    top, so the runtime's plan gives fewer full slots in the same slab bytes; pyvis plan --shadow does the same.
    Against the plain plan: borrowed slots (on by default, off with shadow slots) would grow the plain run's slabs."""
    monkeypatch.setenv("VIS_MOE_BORROW", "off")
    from pyvis.runtime import plan as vplan
    shadow = sh.write_shadow(medium_model, "Q4_0", tmp_path / "m.shadow.gguf", threads=2)["path"]
    shape = vplan.read_shape(medium_model)
    e, b = max(shape.expert_bytes.values()), vplan.shadow_expert_bytes(shadow, medium_model)
    assert 0 < b < e
    budget, L = 332, 4

    def slots(**kw):
        llm = moe.load(medium_model, moe.MoeConfig(mem=budget, **kw),
                       n_ctx=256, n_ubatch=512, n_threads=2, verbose=False)
        n = moe.layer_stats(llm, 0).n_slots
        del llm
        return n
    plain = slots()
    paired = slots(shadow=str(shadow), precision="vision")
    fixed = slots(shadow=str(shadow), precision="vision", shadow_slots=20)
    room = (plain + 1) * e * L                       # the slab bytes the plain plan had (at most)
    assert paired * (e + b) * L <= room and (paired + 1) * (e + b) * L > plain * e * L, (plain, paired)
    assert fixed * e * L + 20 * b * L <= room and (fixed + 1) * e * L + 20 * b * L > plain * e * L, (plain, fixed)
    # with --moe-precision off the sidecar is only checked: the plan is the plain one
    assert slots(shadow=str(shadow)) == plain
    # pyvis plan: the same sharing
    p0 = vplan.make_plan(shape, budget_mib=budget, n_ctx=256)
    p1 = vplan.make_plan(shape, budget_mib=budget, n_ctx=256, shadow_expert=b)
    p2 = vplan.make_plan(shape, budget_mib=budget, n_ctx=256, shadow_expert=b, shadow_slots=20)
    assert p1["n_slots"] < p0["n_slots"] and p2["n_slots"] < p0["n_slots"]
    assert p1["shadow_slots"] == p1["n_slots"] and p2["shadow_slots"] == 20
    assert p1["slab_bytes"] + p1["shadow_bytes"] <= p0["slab_bytes"] + (e + b) * L
    r = run([sys.executable, "-m", "pyvis", "plan", medium_model, "--budget", str(budget), "-c", "256", "--shadow",
             shadow], timeout=60)
    assert r.returncode == 0 and f"shadow slabs: {p1['n_slots']} x 4 layers" in r.stdout, r.stdout + r.stderr
    r = run([sys.executable, "-m", "pyvis", "plan", medium_model, "--shadow", medium_model], timeout=60)
    assert r.returncode == 1 and "not a vis profile" in r.stderr
    # a budget at the plan's floor (resident weights left pageable) has no room for shadow slots: precision is off
    from pyvis import _paths
    floor = run([_paths.lib_dir() / "llama-cli", "-m", medium_model, "--moe-mem", "172", "--moe-shadow", shadow,
                 "--moe-precision", "vision", "-p", "hi", "-n", "1", "-st", "-c", "256", "-t", "2", "--no-warmup",
                 "-lv", "4"], timeout=120)
    out = floor.stdout + floor.stderr
    assert floor.returncode == 0 and "there is no room for shadow slots: precision is off" in out, out[-2000:]
    assert "precision (lossy)" not in out
