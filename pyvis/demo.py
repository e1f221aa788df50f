"""`python -m pyvis.demo` (what `make run` shows): a real MoE answering under a memory budget.

1. Builds the real-weights testbed MoE once (``pyvis moefy --preset shared+16``: SmolLM2-135M-Instruct
   turned into a 29-layer x 16-expert ``deepseek`` MoE, see docs/testbed.md) and caches it in
   models/testbed/.  A stamp beside the GGUF records its inputs (builder version and spec, the source
   GGUF's sha256, the calibration text's sha256); the model is rebuilt only when one of them changes.
2. Plans a memory budget that keeps only part of the routed experts in memory (``--expert-share``);
   the rest stay in the GGUF file and are read on demand (docs/paging.md).
3. Answers a chat prompt greedily under that budget, streaming the text, then answers it again with
   every expert resident and checks that the two texts are byte-identical (the cache is exact).
4. Ends with the tier split and the hit/miss statistics.

    python -m pyvis.demo                          # shared+16 at top-12, budget for 37.5 % of the experts
    python -m pyvis.demo -p "Why is the sky blue?" -n 128 --expert-share 0.5
    python -m pyvis.demo --budget 420 --no-compare
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .assets import sha256_file

MIB = 1 << 20
DEFAULT_PRESET = "shared+16"
DEFAULT_PROMPT = "Why is the sky blue? Explain in two sentences."
# the testbed's own default is top-8 (PPL 22.2 against 15.7 dense, docs/testbed.md): its chat answers ramble.
# top-12 of 16 answers like SmolLM2 itself and still leaves a quarter of each layer's experts unused per token
DEFAULT_TOP_K = 12
STAMP_SUFFIX = ".stamp"


class DemoError(RuntimeError):
    """A user-facing failure with the fix in its message."""


# --------------------------------------------------------------------------
# the cached testbed model
# --------------------------------------------------------------------------
def testbed_inputs(preset: str, source: Path, calib_sha256: str) -> dict:
    """Everything the built GGUF depends on (the builder's version is inside its spec key)."""
    from .testbed import moefy
    spec = moefy.preset(preset)
    return {"preset": preset, "builder_version": moefy.BUILDER_VERSION, "spec_key": spec.key(),
            "source_sha256": sha256_file(source), "calibration_sha256": calib_sha256}


def stamp_path(model: Path) -> Path:
    return model.with_name(model.name + STAMP_SUFFIX)


def write_stamp(model: Path, inputs: dict) -> None:
    st = model.stat()
    d = dict(inputs, gguf_size=st.st_size, gguf_mtime_ns=st.st_mtime_ns)
    stamp_path(model).write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")


def stale_reason(model: Path, inputs: dict) -> str | None:
    """None when `model` is a finished build of exactly `inputs`; otherwise why it must be (re)built."""
    if not model.is_file():
        return "not built yet"
    try:
        have = json.loads(stamp_path(model).read_text())
    except (OSError, ValueError):
        return f"no valid stamp {stamp_path(model).name}"
    st = model.stat()
    if have.get("gguf_size") != st.st_size or have.get("gguf_mtime_ns") != st.st_mtime_ns:
        return "the GGUF was modified after it was built"
    changed = sorted(k for k in inputs if have.get(k) != inputs[k])
    if changed:
        return "its inputs changed: " + ", ".join(changed)
    return None


def ensure_testbed(preset: str, out_dir: Path, threads: int, rebuild: bool = False) -> Path:
    """Path of the testbed GGUF, building it (a few minutes on 2 cores, with progress) when stale."""
    from .assets import smollm2_gguf
    from .testbed import corpus
    model = out_dir / f"{preset}.gguf"
    source = smollm2_gguf()
    calib = corpus.calibration()
    inputs = testbed_inputs(preset, source, calib.sha256)
    why = "--rebuild" if rebuild else stale_reason(model, inputs)
    if why is None:
        say(f"testbed  {model} (cached; inputs unchanged)")
        return model
    say(f"testbed  building {model} ({why}): once, about 2 minutes on 2 idle cores, more when they are busy")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path(model).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pyvis.cli", "moefy", "--preset", preset, "-o", str(model), "-t", str(threads)]
    t0 = time.monotonic()
    r = subprocess.run(cmd)  # the builder prints its progress ([moefy] lines) on stderr
    if r.returncode != 0 or not model.is_file():
        raise DemoError(f"building the testbed failed (exit {r.returncode}): {' '.join(cmd)}")
    write_stamp(model, inputs)
    say(f"testbed  built in {time.monotonic() - t0:.0f} s")
    return model


# --------------------------------------------------------------------------
# the budget
# --------------------------------------------------------------------------
def budget_for_share(shape, share: float, n_ctx: int, n_ubatch: int, pinned: int) -> int:
    """A budget in MiB whose expert tiers (slabs + host cache) hold about `share` of the managed experts."""
    from .runtime.plan import make_plan
    p = make_plan(shape, budget_mib=1 << 20, n_ctx=n_ctx, n_ubatch=n_ubatch, pinned=pinned)
    fixed = p["fixed_bytes"]
    return -(-int(fixed + share * p["managed_bytes"]) // MIB)


# --------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------
def answer(llm, prompt: str, n_predict: int, stream_to=None) -> dict:
    """Greedy chat answer; returns text and llama.cpp's own prefill/decode timings."""
    import llama_cpp
    llama_cpp.llama_perf_context_reset(llm.ctx)
    parts = []
    t0 = time.monotonic()
    for chunk in llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=n_predict,
                                            temperature=0.0, repeat_penalty=1.0, stream=True):
        piece = chunk["choices"][0]["delta"].get("content") or ""
        parts.append(piece)
        if stream_to is not None and piece:
            stream_to.write(piece)
            stream_to.flush()
    wall = time.monotonic() - t0
    if stream_to is not None:
        stream_to.write("\n")
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return {"text": "".join(parts), "wall_s": wall, "n_prompt": int(perf.n_p_eval), "n_gen": int(perf.n_eval),
            "prefill_s": perf.t_p_eval_ms / 1e3, "decode_s": perf.t_eval_ms / 1e3}


def run_paged(model: Path, prompt: str, n_predict: int, budget_mib: int, n_ctx: int, n_ubatch: int, threads: int,
              pinned: int, kv_overrides: dict | None, stream_to) -> dict:
    from . import moe
    llm = moe.load(str(model), moe.MoeConfig(mem=budget_mib, pinned_layers=pinned), n_ctx=n_ctx, n_batch=n_ubatch,
                   n_ubatch=n_ubatch, n_threads=threads, kv_overrides=kv_overrides, verbose=False)
    try:
        res = answer(llm, prompt, n_predict, stream_to)
        st = moe.stats(llm)
        res["io"] = moe.io_stats(llm) or {}
        res["cache"] = {"n_slots": st.n_slots, "n_routed": st.n_routed, "n_hits": st.n_hits,
                        "n_misses": st.n_misses, "n_passes": st.n_passes} if st else {}
        if st:  # each managed layer's slots: the plan's left-over bytes give some of them one more
            per, il = [], 0
            while (ls := moe.layer_stats(llm, il)) is not None:
                per += [ls.n_slots] if ls.managed else []
                il += 1
            res["cache"]["layer_slots"] = per
    finally:
        llm.close()
    return res


def run_resident(model: Path, prompt: str, n_predict: int, n_ctx: int, n_ubatch: int, threads: int,
                 kv_overrides: dict | None) -> dict:
    from . import moe
    llm = moe.load(str(model), moe.MoeConfig(slots=0, mem="off"), n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch,
                   n_threads=threads, kv_overrides=kv_overrides, verbose=False)
    try:
        return answer(llm, prompt, n_predict)
    finally:
        llm.close()


# --------------------------------------------------------------------------
# the summary (a pure function of one dict, so it is testable without a model)
# --------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / MIB:.1f} MiB"


def _rate(n: int, s: float) -> str:
    return f"{n / s:.1f} tok/s" if s > 0 and n > 0 else "n/a"


def summary_lines(d: dict) -> list[str]:
    """The closing block, from one dict (no model needed, so it is tested on its own):
    model: name, file_bytes, expert_bytes, n_moe_layers, n_expert, k; budget_mib;
    plan: llama_vis_moe_plan as pyvis plan returns it (n_slots, slab_bytes, host_bytes, file_only_bytes,
    managed_layers, managed_bytes, request: resident_bytes, kv_bytes, reserve_bytes);
    paged: an answer() dict plus io (llama_vis_moe_get_io_stats) and cache (llama_vis_moe_get_stats totals, and
    layer_slots: each managed layer's slots);
    resident: an answer() dict or None; identical: bool or None."""
    m, p, g = d["model"], d["plan"], d["paged"]
    io, c, rq = g.get("io") or {}, g.get("cache") or {}, p.get("request", {})
    slab, host = io.get("slab_bytes", p["slab_bytes"]), io.get("host_bytes", p["host_bytes"])
    managed = p.get("managed_bytes", m["expert_bytes"])
    lines = ["", "== summary"]

    def row(key: str, val: str) -> None:
        lines.append(f"  {key:<22s} {val}")

    row("model", f"{m['name']}: {_mib(m['file_bytes'])}; {m['n_moe_layers']} MoE layers x {m['n_expert']} experts, "
                 f"top-{m['k']}; routed experts {_mib(m['expert_bytes'])}")
    row("memory budget", f"{d['budget_mib']} MiB (--moe-mem {d['budget_mib']})")
    row("tier split", f"resident backbone {_mib(rq.get('resident_bytes', 0))} | KV cache {_mib(rq.get('kv_bytes', 0))}"
                      f" | compute {_mib(rq.get('reserve_bytes', 0))}")
    per = c.get("layer_slots") or []           # the runtime's, where it ran
    slots = min(per) if per else c.get("n_slots") or p["n_slots"]
    more = sum(1 for x in per if x > slots)
    row("", f"tier 1 slabs {_mib(slab)} ({slots} slots x {p.get('managed_layers', m['n_moe_layers'])} layers"
            f"{f' + 1 in {more}' if more else ''})"
            f" | tier 2 host cache {_mib(host)} | tier 3 file only {_mib(p['file_only_bytes'])}")
    if p.get("borrow") and slab > p["slab_bytes"]:
        # borrowed slots (VIS_MOE_BORROW): the slabs beyond the plan's live in the compute reserve's idle bytes
        row("", f"{_mib(slab - p['slab_bytes'])} of the slabs are borrowed slots: the compute reserve's bytes a "
                f"decode step leaves idle (docs/planning.md#borrowed-slots)")
    if managed:
        share = (slab + host) / managed
        row("", f"experts in memory: {_mib(slab + host)} of {_mib(managed)} ({100 * share:.0f} %); "
                f"the other {100 * (1 - share):.0f} % are read from the GGUF when routed")
    speed = (f"paged: prompt {g['n_prompt']} tokens at {_rate(g['n_prompt'], g['prefill_s'])}, "
             f"answer {g['n_gen']} tokens at {_rate(g['n_gen'], g['decode_s'])}")
    r = d.get("resident")
    if r:
        speed += f" | resident: {_rate(r['n_prompt'], r['prefill_s'])}, {_rate(r['n_gen'], r['decode_s'])}"
    row("speed", speed)
    routed = c.get("n_routed") or sum(io.get(k, 0) for k in ("slab_hits", "host_hits", "file_reads"))
    if routed and io:
        sh, hh, fr = io.get("slab_hits", 0), io.get("host_hits", 0), io.get("file_reads", 0)
        row("expert hits/misses", f"{routed} expert uses: slab hits {sh} ({100 * sh / routed:.1f} %), host-cache hits "
                                  f"{hh} ({100 * hh / routed:.1f} %), file reads {fr} ({100 * fr / routed:.1f} %)")
    elif routed:
        h, ms = c.get("n_hits", 0), c.get("n_misses", 0)
        row("expert hits/misses", f"{routed} expert uses: hits {h} ({100 * h / routed:.1f} %), "
                                  f"misses {ms} ({100 * ms / routed:.1f} %)")
    if io:
        mode = "O_DIRECT" if io.get("direct_io") else "buffered"
        row("read from the file", f"{_mib(io.get('bytes_read', 0))} ({mode}, {_mib(io.get('bytes_storage', 0))} from "
                                  f"storage), {io.get('read_us', 0) / 1e6:.2f} s waiting for reads")
        if io.get("bytes_streamed"):
            row("", f"prefill streamed {io.get('streamed', 0)} experts ({_mib(io['bytes_streamed'])}) through the mapping")
        if io.get("rss_peak"):
            row("peak RSS", f"{_mib(io['rss_peak'])} (this Python process, interpreter included)")
    ident = d.get("identical")
    if ident is not None:
        row("same text as resident", f"yes, byte-identical ({len(g['text'].encode())} bytes)" if ident
            else "NO: the texts differ (a bug: the cache must be exact)")
    return lines


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------
def say(msg: str) -> None:
    print(msg, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m pyvis.demo",
        description="Build (once) the real-weights testbed MoE, answer a prompt under a memory budget far below "
                    "its experts' size, compare with everything resident, print the tier split and hit/miss stats.")
    ap.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="the user message (chat template applied)")
    ap.add_argument("-n", "--n-predict", type=int, default=96, help="tokens to generate at most (default: 96)")
    ap.add_argument("-m", "--model", help="a MoE GGUF to use instead of the testbed (no build)")
    ap.add_argument("--preset", default=DEFAULT_PRESET, help=f"testbed preset (default: {DEFAULT_PRESET})")
    ap.add_argument("--testbed-dir", type=Path, help="where the testbed is cached (default: models/testbed)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the testbed even if it is cached")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--budget", type=int, metavar="MIB", help="memory budget in MiB (--moe-mem)")
    g.add_argument("--expert-share", type=float, default=0.375,
                   help="size the budget so that about this share of the routed experts fits in memory "
                        "(default: 0.375, i.e. 6 of 16 per layer)")
    ap.add_argument("-k", "--top-k", type=int, help=f"experts per token (default: {DEFAULT_TOP_K} for the testbed, "
                    "the model's own with -m)")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="context size (default: 1024)")
    ap.add_argument("-ub", "--ubatch-size", type=int, default=128, help="batch size (default: 128)")
    ap.add_argument("--pinned", type=int, default=0, help="MoE layers kept fully resident (default: 0)")
    ap.add_argument("-t", "--threads", type=int, default=min(os.cpu_count() or 2, 8), help="CPU threads")
    ap.add_argument("--no-compare", action="store_true", help="skip the fully resident run")
    a = ap.parse_args(argv)
    if a.expert_share is not None and not 0 < a.expert_share <= 1:
        ap.error("--expert-share must be in (0, 1]")
    if a.budget is not None and a.budget <= 0:
        ap.error("--budget must be a positive number of MiB")
    if a.n_predict < 1:
        ap.error("-n must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        return _main(a)
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cli_equivalent(model: Path, a: argparse.Namespace, budget: int, k: int | None, arch: str = "deepseek") -> str:
    """The same paged run with upstream's llama-cli on our libllama (sampling there is llama-cli's own)."""
    ov = f" --override-kv {arch}.expert_used_count=int:{k}" if k else ""
    pin = f" --moe-pinned-layers {a.pinned}" if a.pinned else ""
    prompt = a.prompt.replace("'", "'\\''")
    return (f"build/bin/llama-cli -m {model} --moe-mem {budget}{pin}{ov} -c {a.ctx_size} -b {a.ubatch_size} "
            f"-ub {a.ubatch_size} --temp 0 -n {a.n_predict} --moe-stats -st -p '{prompt}'")


def _main(a: argparse.Namespace) -> int:
    from .runtime.plan import configure_plan, make_plan, read_shape
    say("== vis-moe demo: a Mixture-of-Experts model answering with most of its experts left in the file")
    if a.model:
        model = Path(a.model)
        if not model.is_file():
            raise DemoError(f"{model}: no such file")
    else:
        from .testbed.moefy import default_out_dir   # $VIS_TESTBED_DIR, else models/testbed/ (ignored by git)
        model = ensure_testbed(a.preset, a.testbed_dir or default_out_dir(), a.threads, a.rebuild)
    try:
        model = model.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    shape = read_shape(model)
    if not shape.expert_bytes:
        raise DemoError(f"{model} has no routed experts; pass a MoE GGUF")
    k = a.top_k
    if k is None and not a.model:
        k = DEFAULT_TOP_K
    kv = None
    if k:
        if not 1 <= k <= shape.n_expert:
            raise DemoError(f"-k {k}: the model has {shape.n_expert} experts per layer")
        kv = {f"{shape.arch}.expert_used_count": k}
        shape.n_expert_used = k
    budget = a.budget or budget_for_share(shape, a.expert_share, a.ctx_size, a.ubatch_size, a.pinned)
    plan = make_plan(shape, budget_mib=budget, n_ctx=a.ctx_size, n_ubatch=a.ubatch_size, pinned=a.pinned)
    if not plan["ok"]:
        raise DemoError(f"a budget of {budget} MiB does not fit: {plan.get('error')}")
    # what --moe-mem runs: the configurator may lower -ub where its compute buffer buys slots (all-F32 weights)
    conf = configure_plan(shape, n_ubatch=a.ubatch_size, n_threads=a.threads, budget_mib=budget, n_ctx=a.ctx_size,
                          pinned=a.pinned)
    if conf["configuration"]["applied"] and conf["plan"]["ok"]:
        plan = conf["plan"]
    experts = sum(b * shape.n_expert for b in shape.expert_bytes.values())
    rq = plan["request"]
    info = {"name": model.name, "file_bytes": shape.file_bytes, "expert_bytes": experts,
            "n_moe_layers": len(shape.moe_layers), "n_expert": shape.n_expert, "k": shape.n_expert_used}
    in_mem = plan["slab_bytes"] + plan["host_bytes"]
    say(f"model    {model}: {_mib(shape.file_bytes)}, {len(shape.moe_layers)} MoE layers x {shape.n_expert} experts, "
        f"top-{shape.n_expert_used}")
    say(f"         routed experts {_mib(experts)}; the rest (embeddings, attention, shared neurons, dense layers) "
        f"{_mib(rq['resident_bytes'])} stays resident")
    say(f"budget   {budget} MiB = resident {rq['resident_bytes'] / MIB:.0f} + KV {rq['kv_bytes'] / MIB:.0f} + compute "
        f"{rq['reserve_bytes'] / MIB:.0f} + experts {in_mem / MIB:.0f} MiB ({plan['n_slots']} of {shape.n_expert} "
        f"per layer{f', + 1 in {x} layers' if (x := plan.get('extra_slots', 0)) else ''}, {100 * in_mem / max(plan['managed_bytes'], 1):.0f} % of the experts)")
    if b := plan.get("borrow"):
        say(f"         decode steps borrow the compute reserve's idle bytes: {b['n_slots']} slots per layer"
            f"{f' + 1 in {x} layers' if (x := b.get('extra_slots', 0)) else ''} (VIS_MOE_BORROW=off: the plan's alone)")
    say(f"CLI      {cli_equivalent(model, a, budget, k, shape.arch)}")
    say("         (the same paged run with upstream's llama-cli; it formats the chat a little differently)")
    say(f"\n== {a.prompt}")
    paged = run_paged(model, a.prompt, a.n_predict, budget, a.ctx_size, a.ubatch_size, a.threads, a.pinned, kv,
                      sys.stdout)
    resident, identical = None, None
    if not a.no_compare:
        say("\n== the same prompt again with every expert resident (no cache, no budget) ...")
        resident = run_resident(model, a.prompt, a.n_predict, a.ctx_size, a.ubatch_size, a.threads, kv)
        identical = resident["text"] == paged["text"]
        say("   same text, byte for byte" if identical else f"   DIFFERENT text:\n{resident['text']}")
    for line in summary_lines({"model": info, "budget_mib": budget, "plan": plan, "paged": paged,
                               "resident": resident, "identical": identical}):
        say(line)
    return 0 if identical is not False else 2


if __name__ == "__main__":
    sys.exit(main())
