#!/usr/bin/env python3
"""Benchmark the paging tiers against upstream under memory cgroups (docs/paging.md).

    .venv/bin/python scripts/bench_paging.py MODEL.gguf [--fractions 0.5 0.25 0.125 | --limits-mib 4096] [--out DIR]
        [--upstream-bin DIR] [-n 32] [--prompt-tokens 128] [--replay TRACE.csv]

For every budget (a fraction of the model file's bytes) it runs, from a cold page
cache (drop_caches before each run), inside a fresh memory cgroup with that hard
limit, in the same invocation:

  upstream          upstream llama-cli, default load (mmap + CPU weight repacking)
  upstream-nr       upstream llama-cli, mmap and --no-repack
  ours              our llama-cli, --moe-mem auto (tiers sized from the cgroup limit), --moe-trace

and reports prefill and decode tok/s, bytes read from storage per generated token
(getrusage inblock of the child), peak cgroup memory, whether the run finished, and
for ours the misses against Belady's optimum for the same capacity (pyvis.runtime.cachesim).
Needs root (cgroups, drop_caches).  Results: OUT/results.json and a markdown table.

--replay TRACE (a recorded routing trace, CSV; docs/benchmarks.md#replaying-recorded-routing) runs every
configuration, ours and the upstream path alike (our binary: no pristine --upstream-bin), with VIS_MOE_REPLAY=TRACE,
the model at the trace's top-k (--override-kv), no warmup, the chatml template, a prompt of exactly the trace's prompt
tokens and as many generated tokens as the trace holds (llama-cli, --ignore-eos): every run reads the experts the
recorded model read.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_WORDS = ("The expert cache keeps the experts a token needs resident and reads the others from the file; "
                "a memory budget splits into slabs, a host cache and the file itself. ")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Cgroup:
    def __init__(self, limit: int):
        self.name = f"vis-bench-{uuid.uuid4().hex[:8]}"
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text():
            self.dir = v2 / self.name
            self.dir.mkdir()
            (self.dir / "memory.max").write_text(str(limit))
            if (self.dir / "memory.swap.max").exists():
                (self.dir / "memory.swap.max").write_text("0")
            self.peak_file, self.events = self.dir / "memory.peak", self.dir / "memory.events"
        else:
            self.dir = v1 / self.name
            self.dir.mkdir()
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))
            self.peak_file, self.events = self.dir / "memory.max_usage_in_bytes", self.dir / "memory.oom_control"

    def wrap(self, cmd: list) -> list:
        return ["sh", "-c", f'echo $$ > {self.dir / "cgroup.procs"} && exec "$@"', "sh", *map(str, cmd)]

    def peak(self) -> int:
        return int(self.peak_file.read_text()) if self.peak_file.exists() else -1

    def oom_killed(self) -> bool:
        txt = self.events.read_text() if self.events.exists() else ""
        m = re.search(r"oom_kill (\d+)", txt)
        return bool(m and int(m.group(1)) > 0)

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def storage_bandwidth(path: Path, chunk: int, threads: int = 4, seconds: float = 4.0) -> float:
    """O_DIRECT random reads of `chunk` bytes (4 KiB-aligned) from `path` with `threads` threads, cold page cache:
    the bandwidth the expert reads can get at best (bytes/s)."""
    import mmap
    import random
    import threading
    drop_caches()
    size = path.stat().st_size
    chunk = (chunk + 4095) // 4096 * 4096
    total = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        buf = mmap.mmap(-1, chunk)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        n = 0
        try:
            while time.monotonic() < stop:
                n += os.preadv(fd, [buf], rng.randrange(0, (size - chunk) // 4096) * 4096)
        finally:
            os.close(fd)
        with lock:
            total[0] += n
    t0 = time.monotonic()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total[0] / (time.monotonic() - t0)


def run_one(name: str, cmd: list, limit: int, timeout: int, n_predict: int, log: Path | None = None,
            env: dict | None = None, parse=None) -> dict:
    """One run in a fresh cgroup from a cold page cache.  parse: a function of the run's output giving numbers of
    a tool that prints its own (the peer's CLI: bench_peer.peer_numbers); the run finished if it gave decode_tps."""
    drop_caches()
    cg = Cgroup(limit)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cg.wrap(cmd), capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL,
                           env={**os.environ, **(env or {})})
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    wall = time.monotonic() - t0
    if log is not None:
        log.write_text(out)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = dict(name=name, rc=rc, wall_s=round(wall, 1), peak_bytes=cg.peak(), oom_killed=cg.oom_killed(),
             load_avg=round(os.getloadavg()[1], 1),    # 5-minute load average at the end: a shared machine says so
             read_bytes=(after.ru_inblock - before.ru_inblock) * 512, cmd=" ".join(map(str, cmd)))
    cg.remove()
    m = re.search(r"\[ Prompt: ([\d.]+) t/s \| Generation: ([\d.]+) t/s \]", out)
    if m:   # llama-cli
        r["prefill_tps"], r["decode_tps"] = float(m.group(1)), float(m.group(2))
    else:   # llama-bench -o json: pp and tg tests
        try:
            tests = json.loads(out[out.index("["):out.rindex("]") + 1])
            r["prefill_tps"] = round(next(t["avg_ts"] for t in tests if t["n_gen"] == 0), 2)
            r["decode_tps"] = round(next(t["avg_ts"] for t in tests if t["n_prompt"] == 0), 2)
            m = True
        except (ValueError, StopIteration, KeyError):
            m = None
    r["finished"] = rc == 0 and m is not None and "Error:" not in out
    if parse is not None:
        r.update(parse(out))
        r["finished"] = rc == 0 and "decode_tps" in r
    r["read_bytes_per_token"] = r["read_bytes"] / max(n_predict, 1)
    # the stats of the last context (llama-bench makes one per test; the trace file holds the last one)
    for key, pat in (("slab_hits", r"slab hits (\d+)"), ("host_hits", r"host-cache hits (\d+)"),
                     ("file_reads", r"file reads (\d+)"), ("plan_budget_mib", r"memory plan: budget (\d+) MiB"),
                     ("rss_peak_mib", r"peak RSS (\d+)"), ("streamed", r"prefill streaming: (\d+) experts"),
                     ("lent", r"slab lending: (\d+) streamed ubatches"),
                     ("staged", r"staged streaming: (\d+) layers")):
        mm = re.findall(pat, out)
        if mm:
            r[key] = int(mm[-1])
    # the cache table's total row: routed, hits, misses, hit%, MiB loaded, stall ms
    mm = re.findall(r"vis-moe: total\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+%\s+[\d.]+\s+([\d.]+)", out)
    if mm:
        r["routed"], r["hits"], r["misses"] = map(int, mm[-1][:3])
        r["stall_ms"] = float(mm[-1][3])
    # the prefetch table's total row: steps, recall%, prec%, issued, used, wasted, late, cancel, MiB read, MiB
    # waste, wait ms, saved ms, off, on
    mm = re.findall(r"vis-moe: total\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%((?:\s+-?[\d.]+){11})\s*$", out, re.M)
    if mm:
        c = mm[-1][3].split()
        r.update(pf_recall=float(mm[-1][1]), pf_prec=float(mm[-1][2]), pf_issued=int(c[0]), pf_used=int(c[1]),
                 pf_wasted=int(c[2]), pf_late=int(c[3]), pf_cancel=int(c[4]), pf_mib_read=float(c[5]),
                 pf_wait_ms=float(c[7]), pf_off=int(c[9]))
    # the substitution table's: tokens, missing, subst, dropped, 9 outcomes more, MiB saved, bg read, bg wait
    mm = re.findall(r"vis-moe: total((?:\s+[\d.]+){16})\s*$", out, re.M)
    if mm:
        c = mm[-1].split()
        r["sub_missing"], r["substituted"], r["dropped"], r["bg_reads"] = int(c[1]), int(c[2]), int(c[3]), int(c[14])
    slots = re.findall(r"vis-moe:\s+\d+\s+(\d+)\s+\d+\s+\d+\s+\d+\s+[\d.]+%", out)   # the cache table's layer rows
    if slots:
        r["slots"] = int(slots[-1])
    if not r["finished"]:
        r["tail"] = out[-1500:]
    print(f"  {name:12s} rc={rc} finished={r['finished']} decode={r.get('decode_tps')} prefill={r.get('prefill_tps')} "
          f"peak={r['peak_bytes'] / 2**20:.0f} MiB read={r['read_bytes'] / 2**20:.0f} MiB wall={wall:.0f}s "
          f"load={r['load_avg']}", flush=True)
    return r


def median_cell(rs: list[dict], key: str, fmt: str = "%.1f") -> str:
    """a table cell: the median of key over the runs that have it, formatted, or '-'"""
    v = [x[key] for x in rs if x.get(key) is not None]
    return fmt % statistics.median(v) if v else "-"


def belady_ratio(trace_path: Path, slots: int, misses: int, lent: bool = False) -> dict:
    """Our misses against Belady's optimum for the same slots, from our own routing trace; and the misses of the
    decode steps alone (single-token ubatches), from the LRU simulation that reproduces the runtime's policy.
    lent: the run lent its slabs to streamed ubatches (both simulations empty the cache there, as the runtime did)."""
    import numpy as np
    from pyvis.runtime import trace as vtrace
    from pyvis.runtime.cachesim import belady_misses, layer_requests, lru_misses, stream_flags, ubatch_tokens
    t = vtrace.read(trace_path)
    opt = lru = dec_lru = dec_opt = n_dec = 0
    for il in t.layers().tolist():
        req = layer_requests(t, il)
        rows = ubatch_tokens(t, il)
        per_lru: list[int] = []
        per_opt: list[int] = []
        streamed = stream_flags(t, il, slots)
        opt += belady_misses(req, slots, per_opt, streamed, lent)
        lru += lru_misses(req, slots, per_lru, streamed, lent)
        dec = rows == 1
        dec_lru += int(np.asarray(per_lru)[dec].sum())
        dec_opt += int(np.asarray(per_opt)[dec].sum())
        n_dec = max(n_dec, int(dec.sum()))
    return dict(belady_misses=opt, lru_sim_misses=lru, ours_misses=misses, ratio=misses / opt if opt else None,
                decode_steps=n_dec, decode_misses=dec_lru, decode_belady=dec_opt)


def analyse_ours(r: dict, out: Path, expert: int) -> str | None:
    """For a run of ours with a trace: misses against Belady, and decode time per token against reading its misses
    at the storage bandwidth measured in the same invocation.  Updates r; returns a line to print."""
    trace = out / f"ours-{r['fraction']}-{r.get('rep', 0)}.trace"
    if r["name"] != "ours" or r.get("misses") is None or not r.get("slots") or not trace.exists():
        return None
    # lent or staged: a streamed ubatch emptied the slots (vis-moe-lend.h, vis-moe-stage.h)
    r.update(belady_ratio(trace, r["slots"], r["misses"], bool(r.get("lent") or r.get("staged"))))
    line = (f"  ours misses {r['misses']} vs Belady {r['belady_misses']} (x{r['ratio']:.2f}); "
            f"LRU simulated {r['lru_sim_misses']}")
    if r.get("decode_tps") and r.get("decode_steps"):
        dec_bytes = r["decode_misses"] * expert / r["decode_steps"]
        r["decode_read_bytes_per_token"] = dec_bytes
        r["decode_io_bound_s"] = dec_bytes / r["storage_bw"]
        r["decode_vs_io_bound"] = (1 / r["decode_tps"]) / r["decode_io_bound_s"] if dec_bytes else None
        line = (f"  decode reads {dec_bytes / 2**20:.1f} MiB/token -> I/O bound {r['decode_io_bound_s'] * 1e3:.1f} "
                f"ms/token; ours {1e3 / r['decode_tps']:.1f} ms/token\n") + line
    return line


def replay_shape(path: Path) -> dict:
    """n_layer, n_expert, k, prompt and generated positions of a routing trace in the shared CSV format (this script's
    own small reader of the model line and the phase column; the runtime checks the file strictly,
    src/features/vis-moe-route-csv.cpp)."""
    shape: dict = {}
    phases: dict[int, int] = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                kv = dict(w.split("=", 1) for w in line[1:].split() if "=" in w)
                if "n_expert_used" in kv:
                    shape = dict(n_layer=int(kv["n_layer"]), n_expert=int(kv["n_expert"]), k=int(kv["n_expert_used"]))
            elif line[:1].isdigit():
                c = line.split(",", 3)
                phases[int(c[2])] = int(c[1])
    if not shape or not phases:
        raise SystemExit(f"--replay {path}: not a routing trace (no '# ... n_layer= n_expert= n_expert_used=' line, "
                         f"or no rows)")
    shape["n_prompt"] = sum(1 for p in phases.values() if p == 0)
    shape["n_gen"] = len(phases) - shape["n_prompt"]
    return shape


# llama-cli under replay: no warmup (it would read experts before the measurement), the plain chatml template (the
# fixtures' own template adds a 30-token system prompt, more than a recorded prompt may hold), as many tokens as asked
REPLAY_CLI_ARGS = ["--no-warmup", "--chat-template", "chatml", "--ignore-eos"]


def replay_prompt(bindir: Path, n_tokens: int, out: Path) -> str:
    """A prompt that llama-cli -st turns into exactly n_tokens tokens (chat template included), found on the small
    qwen3moe fixture, whose tokenizer and template the --large models share (pyvis.fixtures).  The replayed runs
    check it again (a shorter prompt fails on the trace's missing last-layer rows, a longer one runs past the trace's
    end)."""
    from pyvis import fixtures as fx
    return calibrate_prompt(bindir, fx.ensure("qwen3moe"), n_tokens, out, [*REPLAY_CLI_ARGS, "-c", "512"],
                            exact=True, what="--replay")[0]


def calibrate_prompt(bindir: Path, model: Path, n_tokens: int, out: Path, cli_args: list, exact: bool,
                     what: str) -> tuple[str, int]:
    """(prompt, its tokens): a prompt of whole words (PROMPT_WORDS repeated) that llama-cli -st with cli_args turns into n_tokens tokens
    on `model` (its chat template included), or (exact False) the longest one not above n_tokens.  Counted by the
    model's own --moe-trace: the prompt's ubatch is the largest (llama-cli first decodes 2 tokens to check the
    context; cli_args must hold the prompt in one ubatch)."""
    import numpy as np
    from pyvis.runtime import trace as vtrace
    words = (PROMPT_WORDS * (n_tokens // 20 + 4)).split()

    def count(n_words: int) -> int:
        t = out / "prompt-calibration.trace"
        t.unlink(missing_ok=True)
        p = subprocess.run([bindir / "llama-cli", "-m", model, "-p", " ".join(words[:n_words]), "-n", "1", "-st",
                            *cli_args, "-t", "2", "--moe-trace", t], capture_output=True, text=True,
                           errors="replace", stdin=subprocess.DEVNULL, timeout=300)
        if p.returncode != 0 or not t.exists():
            raise SystemExit(f"{what}: calibrating the prompt with llama-cli failed:\n{(p.stdout + p.stderr)[-1500:]}")
        tr = vtrace.read(t)
        return int(np.bincount(tr.ubatch[tr.layer == tr.layers()[0]]).max())
    lo = 1
    c = count(lo)
    if c > n_tokens:
        raise SystemExit(f"{what}: llama-cli's chat template alone makes {c} prompt tokens, more than {n_tokens}")
    while c < n_tokens and lo < len(words):
        lo += max(1, (n_tokens - c) // 2)
        c = count(lo)
    while c > n_tokens and lo > 1:
        lo -= 1
        c = count(lo)
    if exact and c != n_tokens:
        raise SystemExit(f"{what}: no prompt of whole words makes exactly {n_tokens} tokens (closest: {c})")
    return " ".join(words[:lo]), c


def flags_env(flags: list[str]) -> dict:
    """--moe-* flags as the VIS_MOE_* variables of the settings table (llama-bench reads only those)"""
    from pyvis.runtime import native
    table = {f.name: f for f in native.flags()}
    env, i = {}, 0
    while i < len(flags):
        f = table.get(flags[i])
        if f is None:
            raise SystemExit(f"--variant: {flags[i]} is not a --moe-* flag of the settings table")
        if f.value_hint is None:
            env[f.env], i = "on", i + 1
        else:
            if i + 1 >= len(flags):
                raise SystemExit(f"--variant: {flags[i]} needs a value ({f.value_hint})")
            env[f.env], i = flags[i + 1], i + 2
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    ap.add_argument("--out", default="bench-paging")
    ap.add_argument("--bin", default=str(ROOT / "build/bin"), help="our build's bin dir")
    ap.add_argument("--upstream-bin", default=None, help="pristine upstream bin dir (default: ours with features off)")
    ap.add_argument("-n", "--n-predict", type=int, default=None,
                    help="tokens to generate (default 32; with --replay, all the trace's generated tokens)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    ap.add_argument("--temp", type=float, default=0.8,
                    help="sampling temperature (default 0.8, llama-cli's default: varied tokens, varied routing; "
                         "0 = greedy, which on random-weight models repeats a few tokens and keeps the cache hot)")
    ap.add_argument("--seed", type=int, default=1, help="sampling seed (the same for every run, so all see the same tokens)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration, interleaved (medians reported)")
    ap.add_argument("--only", nargs="+", default=["upstream", "upstream-nr", "ours"])
    ap.add_argument("--tool", choices=["cli", "bench"], default="cli",
                    help="cli: llama-cli, a prompt then -n sampled tokens (default); bench: llama-bench pp + tg, whose "
                         "decode feeds random tokens (varied routing: on random-weight models sampled text repeats one "
                         "token and keeps the expert cache hot)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="another configuration of ours, run after 'ours' with these --moe-* flags added, e.g. "
                         "--variant 'router=--moe-substitute router' (repeatable; llama-bench gets them as variables); "
                         "VIS_MOE_NAME=VALUE words set an engine knob in its environment instead, e.g. "
                         "--variant 'forced=VIS_MOE_CONFIGURE=on'")
    ap.add_argument("--limits-mib", type=int, nargs="+", default=None,
                    help="memory limits in MiB (instead of --fractions of the model file)")
    ap.add_argument("--replay", metavar="TRACE", default=None,
                    help="replay this recorded routing trace (CSV) in every run, ours and the upstream path "
                         "(VIS_MOE_REPLAY; docs/benchmarks.md#replaying-recorded-routing): prompt and generated tokens "
                         "come from the trace, llama-cli only")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="extra args for ours")
    a = ap.parse_args()
    variants = {}
    for v in a.variant:
        name, eq, flags = v.partition("=")
        if not eq or not name or name in ("upstream", "upstream-nr", "ours") or not flags.split():
            ap.error(f"--variant {v!r}: expected NAME=FLAGS with a new name and at least one flag")
        variants[name] = flags.split()
    # a variant's VIS_MOE_NAME=VALUE words are engine knobs set in its environment (a knob with no flag spelling,
    # e.g. 'forced=VIS_MOE_CONFIGURE=on'); the other words are flags
    knob = re.compile(r"VIS_MOE_[A-Z0-9_]+=\S*")
    variant_env = {n: dict(w.split("=", 1) for w in f if knob.fullmatch(w)) for n, f in variants.items()}
    variants = {n: [w for w in f if not knob.fullmatch(w)] for n, f in variants.items()}
    a.n_predict = a.n_predict if a.n_predict is not None or a.replay else 32
    names = list(a.only) + [n for n in variants if n not in a.only]
    model = Path(a.model).resolve()
    size = model.stat().st_size
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    up = Path(a.upstream_bin or a.bin)
    prompt = (PROMPT_WORDS * (a.prompt_tokens // 30 + 1))
    replay_env: dict = {}
    replay_args: list = []
    if a.replay:
        # every run, the upstream path included, replays the trace: our binary (a pristine upstream ignores the knob)
        if a.upstream_bin:
            ap.error("--replay runs the upstream path on our binary with every cache feature off (a pristine "
                     "upstream has no VIS_MOE_REPLAY and would run its own routing): drop --upstream-bin")
        if a.tool != "cli":
            ap.error("--replay needs --tool cli: llama-bench has no --override-kv to run the model at the trace's "
                     "top-k, and its generation test starts at position 0, replaying the trace's prompt as decode steps")
        from pyvis.runtime import plan as vplan
        rs = replay_shape(Path(a.replay))
        arch = vplan.read_shape(model).arch
        if a.n_predict is not None and not 1 <= a.n_predict <= rs["n_gen"]:
            ap.error(f"-n {a.n_predict}: the trace holds {rs['n_gen']} generated tokens (1..{rs['n_gen']})")
        a.n_predict, a.prompt_tokens = a.n_predict or rs["n_gen"], rs["n_prompt"]
        prompt = replay_prompt(Path(a.bin), rs["n_prompt"], out)
        replay_env = {"VIS_MOE_REPLAY": str(Path(a.replay).resolve())}
        replay_args = ["--override-kv", f"{arch}.expert_used_count=int:{rs['k']}", *REPLAY_CLI_ARGS]
        print(f"replay: {a.replay}: {rs['n_layer']} MoE layers x {rs['n_expert']} experts, top-{rs['k']}, "
              f"{rs['n_prompt']} prompt + {rs['n_gen']} generated tokens; prompt {prompt!r}", flush=True)
    base = ["-m", model, "-p", prompt, "-n", str(a.n_predict), "-st", "-c", "512", "-t", "2", "--temp", str(a.temp),
            "--seed", str(a.seed), *replay_args]
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else []
    from pyvis.runtime import plan as vplan
    shape = vplan.read_shape(model)
    expert = max(shape.expert_bytes.values())
    bw = storage_bandwidth(model, expert // 3)
    print(f"storage: {bw / 2**20:.0f} MiB/s O_DIRECT random reads of {expert // 3 / 2**20:.2f} MiB (one expert tensor), "
          f"4 threads", flush=True)
    limits = [m << 20 for m in a.limits_mib] if a.limits_mib else [int(size * f) for f in a.fractions]
    for limit in limits:
        frac = round(limit / size, 4)
        print(f"== budget {frac:.3f} x {size / 2**30:.2f} GiB = {limit / 2**20:.0f} MiB", flush=True)
        for rep in range(a.repeat):
            for name in names:
                vflags = variants.get(name, [])
                trace = out / f"{'ours' if name == 'ours' else name}-{frac}-{rep}.trace"
                env = None
                if a.tool == "bench":
                    bb = ["-m", model, "-p", str(a.prompt_tokens), "-n", str(a.n_predict), "-r", "1", "-t", "2", "-o", "json"]
                    if name == "upstream":
                        cmd = [up / "llama-bench", *bb]
                    elif name == "upstream-nr":
                        cmd = [up / "llama-bench", *bb, "--repack", "0"]
                    else:   # llama-bench has its own flags: the fork's settings come from the environment
                        cmd = [Path(a.bin) / "llama-bench", *bb, "--repack", "0", *a.extra]
                        env = dict(VIS_MOE_MEM="auto", VIS_MOE_STATS="1", VIS_MOE_TRACE=str(trace), **flags_env(vflags),
                                   **variant_env.get(name, {}))
                elif name == "upstream":
                    cmd = [up / "llama-cli", *base]
                elif name == "upstream-nr":
                    cmd = [up / "llama-cli", *base, "-nr"]
                else:
                    cmd = [Path(a.bin) / "llama-cli", *base, "-nr", "--moe-mem", "auto", "--moe-stats", "--moe-trace", trace,
                           *vflags, *a.extra]
                    env = variant_env.get(name) or None
                env = {**(env or {}), **replay_env} or None
                r = run_one(name, cmd, limit, a.timeout, a.n_predict, out / f"{name}-{frac}-{rep}.log", env)
                r["tool"] = a.tool
                if a.replay:
                    r["replay"] = str(a.replay)
                r.update(fraction=frac, limit_bytes=limit, model=str(model), model_bytes=size, rep=rep)
                r["storage_bw"] = bw
                summary = analyse_ours(r, out, expert)
                if summary:
                    print(summary, flush=True)
                results = [x for x in results
                           if not (x["name"] == name and x["fraction"] == frac and x.get("rep", 0) == rep)] + [r]
                (out / "results.json").write_text(json.dumps(results, indent=1))
    # again from the finished traces (a process of the run may still append when the run returns)
    for r in results:
        analyse_ours(r, out, expert)
    (out / "results.json").write_text(json.dumps(results, indent=1))

    def med(rs, key, fmt="%.1f"):
        return median_cell(rs, key, fmt)
    rows = ["| budget | run | finished | prefill t/s | decode t/s | read MiB/token | decode reads MiB/token | "
            "decode ms/token vs I/O bound | peak MiB | misses/Belady |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in results:
        groups.setdefault((r["fraction"], r["name"]), []).append(r)
    for (frac, name), rs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        fin = sum(1 for x in rs if x["finished"])
        why = "" if fin == len(rs) else (" (OOM-killed)" if any(x["oom_killed"] for x in rs) else f" (rc {rs[0]['rc']})")
        for x in rs:
            x["read_mib_per_token"] = x["read_bytes_per_token"] / 2**20
            if x.get("decode_read_bytes_per_token") is not None:
                x["decode_read_mib_per_token"] = x["decode_read_bytes_per_token"] / 2**20
            x["peak_mib"] = x["peak_bytes"] / 2**20
            if x.get("decode_tps") and x.get("decode_io_bound_s"):
                x["_vs"] = f"{1e3 / x['decode_tps']:.0f} / {x['decode_io_bound_s'] * 1e3:.0f}"
        vs = ", ".join(x["_vs"] for x in rs if "_vs" in x) or "-"
        rows.append(f"| {frac:.3f} ({rs[0]['limit_bytes'] / 2**20:.0f} MiB) | {name} | {fin}/{len(rs)}{why} | "
                    f"{med(rs, 'prefill_tps')} | {med(rs, 'decode_tps')} | {med(rs, 'read_mib_per_token')} | "
                    f"{med(rs, 'decode_read_mib_per_token')} | {vs} | {med(rs, 'peak_mib', '%.0f')} | "
                    f"{med(rs, 'ratio', '%.2f')} |")
    (out / "results.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
