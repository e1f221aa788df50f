"""Lookahead prediction and prefetch (issue #16, docs/prediction.md).

Prefetch changes only *when* expert bytes arrive: logits are byte-identical with every predictor on or off (mlp
with a profile fitted in the test), at
every cache size down to one slot per layer, on every fixture architecture, with one sequence and with several
decoding in one batch.  The reads ahead really happen (counted), the stats agree with the --moe-stats table,
bad values are clear errors, and the store without a file tier says prefetch is off.
"""
from __future__ import annotations

import re
import contextlib
import sys

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from pyvis.runtime import native as _native
from pyvis.runtime.native import VisError
from pyvis.runtime.config import MoeConfig, applied
from conftest import LOGITS_KW, greedy_logits, run

ARCHS = ["qwen3moe", "deepseek2", "gptoss", "mixtral"]
PREDICTORS = ["next-router", "coact", "freq", "mlp", "random"]
PROMPT = "Reading experts ahead of need must not change a single bit of the output."
N_DECODE = 10
KW = LOGITS_KW


def _run(path, **moe_kw):
    return greedy_logits(path, PROMPT, N_DECODE, **moe_kw)


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _configs(spec, predictor):
    k = spec.n_expert_used
    out = [
        dict(slots=1),                                           # one slot per layer: k passes a step
        dict(slots=k, lookahead=2, io_threads=1),                # exactly top-k, two layers ahead
        dict(slots=min(k + 2, spec.n_expert - 1), host_mib=1, direct_io="off"),  # host tier, buffered reads
    ]
    if predictor == "random":                                    # mostly wrong: many reads ahead wasted
        out.append(dict(slots=max(1, k - 1), lookahead=3, prefetch_budget=spec.n_expert, prefetch_tune=False))
    return out


def mlp_profile(path, out):
    """A predictor profile with a lookahead MLP for the fixture at ``path``, fitted fast on a toy text (one chunk of
    128 tokens, 2 epochs): its predictions are poor, which is all the byte-identity tests need."""
    from pyvis.calibrate import mlp as M
    from pyvis.runtime import predict as pr
    from pyvis.runtime import profile as prof
    from pyvis.runtime.predict_profile import write_predictor_profile
    from test_substitution_profile import corpus_text
    if not out.exists():
        text = corpus_text(out.with_suffix(".txt"), 400)
        fp = prof.model_fingerprint(path)
        cap = M.capture(str(path), str(text), 128, 1, 2)
        c = pr.count(cap.routes(), fp["n_layer"], fp["n_expert"], 3)
        w = M.fit_mlp(cap, fp["n_layer"], fp["n_expert"], 3, hidden=8, epochs=2)
        write_predictor_profile(out, fp, c.freq(), c.tables(), cap.k, cap.n_tokens, "test", model_path=path, mlp=w)
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_prefetch_is_byte_identical(fixture_dir, name, tmp_path):
    spec = fx.FIXTURES[name]()
    path = fixture_dir / f"{name}.gguf"
    ref, _ = _run(path)
    for predictor in PREDICTORS:
        issued = 0
        extra = dict(predict_profile=str(mlp_profile(path, tmp_path / "mlp.gguf"))) if predictor == "mlp" else {}
        for cfg in _configs(spec, predictor):
            logits, llm = _run(path, predict=predictor, **cfg, **extra)
            assert _same(logits, ref), (predictor, cfg)
            st = moe.prefetch_stats(llm)
            issued += st["n_issued"]
            # every read ahead is accounted for once: used, wasted or cancelled before it started
            assert st["n_used"] + st["n_wasted"] + st["n_cancelled"] == st["n_issued"], (predictor, cfg, st)
            assert 0 <= st["n_pred_hits"] <= min(st["n_predicted"], st["n_routed"]), st
            del llm
        assert issued > 0, predictor   # the comparison is not vacuous: bytes did arrive ahead of need


@pytest.mark.parametrize("extra_slots", [0, 1])
def test_reads_ahead_save_demand_misses(fixture_dir, extra_slots):
    """What a read ahead is for: next-router (the next layer's router on this layer's input) reads experts the next
    layer then routes (used > 0), so the layers miss fewer experts at need than with prediction off, on the same
    cache and the same tokens (the logits are identical).  On gpt-oss (8 experts, top-4) its guesses are good enough
    to win at top-k slots and one more (measured: 74 -> 60 and 62 -> 45 misses over 16 steps); on qwen3moe (32,
    top-8) its wasted reads evict more hits than its used ones save, which is what self-tuning is for."""
    spec = fx.FIXTURES["gptoss"]()
    path = fixture_dir / "gptoss.gguf"
    slots = spec.n_expert_used + extra_slots
    ref, llm = _run(path, slots=slots)
    misses_off = moe.stats(llm).n_misses
    del llm
    logits, llm = _run(path, slots=slots, predict="next-router", prefetch_tune=False)
    st, misses_on = moe.prefetch_stats(llm), moe.stats(llm).n_misses
    assert _same(logits, ref)
    assert st["n_used"] > 0, st
    assert misses_on < misses_off, (misses_on, misses_off, st)


def test_prediction_off_reads_nothing_ahead(fixture_dir):
    spec = fx.FIXTURES["qwen3moe"]()
    _, llm = _run(fixture_dir / "qwen3moe.gguf", slots=spec.n_expert_used)
    st = moe.prefetch_stats(llm)
    assert st["n_issued"] == 0 and st["n_steps"] == 0


# ---------------------------------------------------------------------------
# several sequences decoding in one batch: concurrent demand reads and reads ahead, random predictions
# ---------------------------------------------------------------------------
SEQ_PROMPTS = [b"The first sequence talks about caches", b"A second one, about disks and pages",
               b"Third: routers, experts and slots of memory"]


def _parallel_logits(path, steps=16, moe_kw=None, pred_kw=None):
    """Prefill three sequences, then decode them together (one token each per batch); the logits of every step."""
    import llama_cpp as L
    cm = applied(MoeConfig(**moe_kw.get("moe", {}), **moe_kw.get("tier", {}), **(pred_kw or {}))) if moe_kw \
        else contextlib.nullcontext()
    with cm:
        mp = L.llama_model_default_params()
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch, cp.n_seq_max = 512, 2, 2, len(SEQ_PROMPTS)
        ctx = L.llama_init_from_model(model, cp)
    assert model and ctx
    vocab = L.llama_model_get_vocab(model)
    nv = L.llama_vocab_n_tokens(vocab)
    b = L.llama_batch_init(256, 0, len(SEQ_PROMPTS))
    out, pos, last = [], [], []
    try:
        for s, p in enumerate(SEQ_PROMPTS):
            toks = (L.llama_token * 64)()
            n = L.llama_tokenize(vocab, p, len(p), toks, 64, True, False)
            for i in range(n):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = toks[i], i, 1, int(i == n - 1)
                b.seq_id[i][0] = s
            b.n_tokens = n
            assert L.llama_decode(ctx, b) == 0
            pos.append(n)
            last.append(int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), (nv,)))))
        for _ in range(steps):
            for s in range(len(SEQ_PROMPTS)):
                b.token[s], b.pos[s], b.n_seq_id[s], b.logits[s] = last[s], pos[s], 1, 1
                b.seq_id[s][0] = s
                pos[s] += 1
            b.n_tokens = len(SEQ_PROMPTS)
            assert L.llama_decode(ctx, b) == 0
            rows = np.array([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, s), (nv,)).copy()
                             for s in range(len(SEQ_PROMPTS))])
            out.append(rows)
            last = [int(np.argmax(r)) for r in rows]
        st = _native.prefetch_stats(ctx) if moe_kw else None
        return np.array(out), st
    finally:
        L.llama_batch_free(b)
        L.llama_free(ctx)
        L.llama_model_free(model)


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2"])
def test_parallel_sequences_with_random_predictions(fixture_dir, name, tmp_path):
    """A stress test: three sequences per decode step, random predictions with a large budget, tiny caches, every
    distance up to 4 layers ahead.  No deadlock (the suite's timeout), no use-after-evict (bit-identical logits)."""
    spec = fx.FIXTURES[name]()
    path = fixture_dir / f"{name}.gguf"
    ref, _ = _parallel_logits(path)
    k = spec.n_expert_used
    issued = steps = 0
    # one slot: 3 tokens x k experts need more passes than --moe-stream-passes, so layers stream while reads
    # ahead are held in their slots
    for slots, la, tier in ((1, 4, {}), (max(1, k // 2), 4, {}), (k, 2, {"host_mib": 1}),
                            (k + 1, 3, {"io_threads": 1, "direct_io": "off"})):
        got, st = _parallel_logits(path, moe_kw={"moe": {"slots": slots}, "tier": tier},
                                   pred_kw=dict(predict="random", lookahead=la, prefetch_budget=spec.n_expert,
                                                prefetch_tune=False))
        assert _same(got, ref), (slots, la, tier)
        issued, steps = issued + st["n_issued"], steps + st["n_steps"]
    assert issued > 0 and steps > 0
    # the MLP on three tokens per step (its sigmoids summed over the ubatch)
    got, st = _parallel_logits(path, moe_kw={"moe": {"slots": k}, "tier": {}},
                               pred_kw=dict(predict="mlp", lookahead=2, prefetch_tune=False,
                                            predict_profile=str(mlp_profile(path, tmp_path / "mlp.gguf"))))
    assert _same(got, ref) and st["n_steps"] > 0


# ---------------------------------------------------------------------------
# self-tuning, stats table, errors
# ---------------------------------------------------------------------------
def _cli(bindir, model, *extra, n=16):
    r = run([bindir / "llama-cli", "-m", model, "-p", PROMPT, "-n", str(n), "-st", "--temp", "0", "-c", "256",
             "-t", "2", "--no-warmup", "-lv", "4", *extra], timeout=180)   # -lv 4: the info lines
    return r, r.stdout + r.stderr


def _prefetch_rows(out: str) -> dict[str, list[float]]:
    """The --moe-stats prefetch table: label -> its numbers (steps, recall%, prec%, issued, used, wasted, late,
    cancel, MiB read, MiB waste, wait ms, saved ms, off, on)."""
    lines = out.splitlines()
    i = next(j for j, ln in enumerate(lines) if "vis-moe: prefetch (--moe-predict" in ln)
    rows = {}
    for ln in lines[i + 2:]:
        f = ln.split()
        if len(f) != 16 or f[0] != "vis-moe:":
            break
        rows[f[1]] = [float(x.rstrip("%")) for x in f[2:]]
    return rows


def test_self_tuning_switches_wasteful_layers_off(bindir, fixture_dir):
    """Random predictions with a budget of every expert waste far more than they use: with tuning on, layers
    pause (off steps > 0) and read less than with tuning off; the output stays the same."""
    spec = fx.FIXTURES["qwen3moe"]()
    model = fixture_dir / "qwen3moe.gguf"
    base = ["--moe-slots", str(spec.n_expert_used + 2), "--moe-stats", "--moe-predict", "random",
            "--moe-prefetch-budget", str(spec.n_expert)]
    r_on, on = _cli(bindir, model, *base, n=40)
    r_off, off = _cli(bindir, model, *base, "--moe-prefetch-tune", "off", n=40)
    assert r_on.returncode == 0 and r_off.returncode == 0, on[-2000:] + off[-2000:]
    t_on, t_off = _prefetch_rows(on)["total"], _prefetch_rows(off)["total"]
    assert t_on[12] > 0, t_on          # off steps
    assert t_off[12] == 0, t_off
    assert t_on[3] < t_off[3], (t_on, t_off)  # fewer reads ahead issued
    gen = lambda o: o[o.find("> " + PROMPT[:20]):o.find("[ Prompt:")]
    assert gen(on) == gen(off) and len(gen(on)) > len(PROMPT)


def test_self_tuning_decides_per_layer(fixture_dir):
    """The per-layer rule itself, step by step through the API: a layer is switched off right after a window of
    TUNE_WINDOW (16) judged reads ahead in which it wasted more than it used, and never otherwise; while it is off it
    issues nothing and counts its off steps; after TUNE_OFF (32) off steps it is on again."""
    spec = fx.FIXTURES["qwen3moe"]()
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=spec.n_expert_used + 2, predict="random",
                                                                prefetch_budget=spec.n_expert), **KW)
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    layers = list(range(1, spec.n_layer))                 # the layers read ahead for (layer 0 has none before it)
    win = {il: [0, 0] for il in layers}                   # used, wasted since the layer's last judgement
    switched_off = switched_on = 0
    prev = {il: moe.prefetch_stats(llm, il) for il in layers}
    for _ in range(64):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        for il in layers:
            a, b = prev[il], moe.prefetch_stats(llm, il)
            if not a["enabled"]:                          # off during this step: no read ahead, one off step more
                assert b["n_issued"] == a["n_issued"] and b["n_off_steps"] == a["n_off_steps"] + 1, (il, a, b)
                switched_on += b["enabled"]
                assert b["enabled"] == (b["n_off_steps"] % 32 == 0), (il, b)
                prev[il] = b
                continue
            win[il][0] += b["n_used"] - a["n_used"]
            win[il][1] += b["n_wasted"] - a["n_wasted"]
            if sum(win[il]) >= 16:                        # judged: off exactly when it wasted more than it used
                assert b["enabled"] == (win[il][1] <= win[il][0]), (il, win[il], b)
                switched_off += 1 - b["enabled"]
                win[il] = [0, 0]
            else:
                assert b["enabled"], (il, win[il], b)
            prev[il] = b
    assert switched_off > 0 and switched_on > 0, (switched_off, switched_on)


def test_stats_table_matches_the_api(fixture_dir, bindir):
    spec = fx.FIXTURES["deepseek2"]()
    model = fixture_dir / "deepseek2.gguf"
    r, out = _cli(bindir, model, "--moe-slots", str(spec.n_expert_used), "--moe-stats", "--moe-predict", "coact")
    assert r.returncode == 0, out[-2000:]
    rows = _prefetch_rows(out)
    assert "total" in rows and len(rows) >= 2
    per_layer = [v for k, v in rows.items() if k != "total"]
    for col in (0, 3, 4, 5, 6, 7):   # steps, issued, used, wasted, late, cancel add up to the total
        assert sum(v[col] for v in per_layer) == rows["total"][col], col
    t = rows["total"]
    assert t[3] == t[4] + t[5] + t[7], t      # issued = used + wasted + cancelled
    assert "prefetch (exact): --moe-predict coact, lookahead 1" in out
    _, llm = _run(model, slots=spec.n_expert_used, predict="coact")
    api = moe.prefetch_stats(llm)
    assert api["n_steps"] > 0 and api["n_predicted"] == api["n_steps"] * spec.n_expert_used


def test_model_store_and_auto_say_prefetch_is_off(bindir, fixture_dir):
    model = fixture_dir / "qwen3moe.gguf"
    r, out = _cli(bindir, model, "--moe-slots", "8", "--moe-store", "model", "--moe-predict", "next-router", n=2)
    assert r.returncode == 0 and "--moe-predict next-router: off, the experts are not read from the file" in out
    r, out = _cli(bindir, model, "--moe-slots", "8", "--moe-predict", "auto", n=2)
    assert r.returncode == 0 and "--moe-predict auto: off" in out


@pytest.mark.parametrize("flag,value,expect", [
    ("--moe-predict", "oracle", "expected off, next-router, coact, freq, mlp, random or auto"),
    ("--moe-lookahead", "0", "expected an integer in 1..4"),
    ("--moe-lookahead", "5", "expected an integer in 1..4"),
    ("--moe-prefetch-budget", "0", "expected an integer in 1..65536 (or auto)"),
    ("--moe-prefetch-budget", "8x", "expected an integer in 1..65536 (or auto)"),
    ("--moe-prefetch-tune", "maybe", "expected on or off"),
])
def test_bad_values_are_clear_errors(bindir, fixture_dir, flag, value, expect):
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", "8", flag, value, n=1)
    assert r.returncode != 0 and flag in out and expect in out, out[-1500:]


def test_bad_values_through_python(fixture_dir):
    with pytest.raises(VisError, match="--moe-lookahead"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=8, predict="coact", lookahead=9), **KW)
    with pytest.raises(VisError, match="--moe-predict"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=8, predict="psychic"), **KW)


def test_prefill_read_ahead_of_streamed_layers(bindir, fixture_dir):
    """A prompt that streams its layers (one slot: more passes than --moe-stream-passes) has each next managed layer
    read ahead while the one before computes; off, nothing is; the text is the same either way."""
    model = fixture_dir / "qwen3moe.gguf"
    outs = {}
    for mode in ("on", "off"):
        r, out = _cli(bindir, model, "--moe-slots", "1", "--moe-stats", "--moe-stream-ahead", mode, n=4)
        assert r.returncode == 0, out[-2000:]
        line = next(ln for ln in out.splitlines() if "vis-moe: prefill streaming:" in ln)
        outs[mode] = (int(line.split("; ")[1].split()[0]), out[out.find("> " + PROMPT[:20]):out.find("[ Prompt:")])
    assert outs["on"][0] > 0 and outs["off"][0] == 0, outs
    assert outs["on"][1] == outs["off"][1]


def test_stats_report_the_time_to_first_token(bindir, fixture_dir):
    """--moe-stats names the last prompt's time to first token: the compute time of the prompt ubatches since the
    last decode step (a tool's warmup ubatch included when no decode step came between)."""
    r, out = _cli(bindir, fixture_dir / "qwen3moe.gguf", "--moe-slots", "8", "--moe-stats", n=2)
    assert r.returncode == 0, out[-2000:]
    m = re.search(r"vis-moe: time to first token: ([\d.]+) ms \(the last prompt: (\d+) ubatch", out)
    assert m and float(m.group(1)) > 0 and int(m.group(2)) >= 1, out[-2000:]


def test_report_prefetch_reads_the_logs_and_plots(bindir, fixture_dir, tmp_path):
    from pyvis.testbed import prefetch_report as pr
    model = fixture_dir / "qwen3moe.gguf"
    logs = {}
    for name, extra in (("off", []), ("coact", ["--moe-predict", "coact"])):
        r, out = _cli(bindir, model, "--moe-slots", "8", "--moe-stats", *extra)
        assert r.returncode == 0, out[-2000:]
        logs[name] = tmp_path / f"{name}.log"
        logs[name].write_text(out)
    off, on = pr.parse_log(logs["off"].read_text()), pr.parse_log(logs["coact"].read_text())
    assert off["layers"] == on["layers"] == [0, 1, 2] and not off["prefetch"]
    assert sorted(on["prefetch"]) == on["layers"]
    tot = _prefetch_rows(logs["coact"].read_text())["total"]
    assert sum(v["issued"] for v in on["prefetch"].values()) == tot[3]
    png = tmp_path / "stall.png"
    r = run([sys.executable, "-m", "pyvis", "report-prefetch", f"off={logs['off']}", f"coact={logs['coact']}",
             "-o", png])
    assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr
    assert "coact: stall" in r.stdout and "reads ahead used" in r.stdout
    r = run([sys.executable, "-m", "pyvis", "report-prefetch", str(logs["off"]), "-o", logs["off"]])
    assert r.returncode == 1 and "is one of the input logs" in r.stderr
    bare = tmp_path / "bare.log"
    bare.write_text("no tables here\n")
    r = run([sys.executable, "-m", "pyvis", "report-prefetch", str(bare)])
    assert r.returncode == 1 and "run with --moe-stats" in r.stderr
