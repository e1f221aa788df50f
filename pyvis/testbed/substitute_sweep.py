"""Quality-vs-speed study of substitution on a miss (``pyvis substitute-sweep``; issue #13 item 5).

A *point* is a model at a top-k (``MODEL@K``: a testbed preset or a GGUF path); a *setting* is a point at a
cache size (``--moe-slots S``, S = round(fraction * n_expert)); a *configuration* is a substitution rule
(``off``, ``router``, ``buddy`` with gate options, see :func:`parse_config`).  For every setting:

1. **Exact reference.** ``llama-perplexity --kl-divergence-base`` of the exact run (``--moe-substitute off``)
   at that k and slot count, in the decode regime (``-ub 1 -b CTX``: every ubatch one token, which is what
   the runtime calls a decode ubatch).  Cached under :func:`pyvis.testbed.quality.kld_dir` like
   ``pyvis quality``'s.  Store: ``--quality-store file`` (default).  ``--moe-store model`` gives the same bits
   as the file in exact mode, but with substitution on it has no background reads (a substituted-away expert
   is never loaded until a blocked pair needs it), so its quality is not the file store's; ``--stage
   /dev/shm`` instead copies the model to a tmpfs, where file-store reads are memory copies.
2. **Quality.** Each configuration runs ``--kl-divergence`` against it: perplexity, PPL ratio against the
   exact run's perplexity, mean KLD, same-top-token share; ``--moe-stats`` gives the misses and the
   substitution outcomes.  The ``off`` row is the reference itself (KLD 0) unless ``--verify-off`` runs it.
3. **Speed.** A shorter plain perplexity pass with the default file store (``--moe-store file``: expert reads
   from the GGUF with O_DIRECT): decode tokens/s = tokens evaluated / time from the first chunk to the
   final estimate (llama.cpp log timestamps; the process wall time is kept too), and from ``--moe-stats``
   the bytes loaded, the stall, the file reads and the time spent waiting for them.

``buddy`` and ``tae=pN`` need a buddy profile of the model at that k: made once per (model, k) from a
``--moe-trace`` run over the calibration text (never the held-out text), with ``pyvis calibrate buddies
--trace``, cached under ``models/testbed/profiles/``.

Output (``-o DIR``): ``NAME.json`` (every run, written after each one; ``--resume`` reuses its runs),
``NAME.md`` (the table) and ``NAME.png`` (Pareto: decode tok/s against PPL cost, one panel per setting;
``NAME-avoided.png``: share of misses that got a stand-in against PPL cost; ``NAME-kld.png``: tok/s against
mean KLD).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import quality
from .quality import QualityError
from .sweep_parse import (CACHE_FIELDS, SUB_FIELDS, SUB_HEADINGS, SweepError, parse_eval_seconds,  # noqa: F401
                          parse_stats, parse_tiers)
from .sweep_report import format_table, merge, plot, recommend, table_rows, write_outputs  # noqa: F401
from .sweep_grid import (CONFIG_KEYS, DEFAULT_CONFIGS, DEFAULT_FRACTIONS, DEFAULT_POINTS, MODES,  # noqa: F401
                         Point, Setting, SubConfig, _cmdline, _overrides, check_scored, expand, n_expert_of,
                         parse_config, parse_point, resolve_model, run_args, slots_for)
from .sweep_profiles import ensure_profile, profile_dir, profile_summary  # noqa: F401


# --------------------------------------------------------------------------
# runs
# --------------------------------------------------------------------------
_BUILD_LIBS = ("libllama.so", "libggml-base.so", "libggml-cpu.so", "libllama-common.so", "libllama-perplexity-impl.so")
_build_ids: dict = {}


def build_id() -> str:
    """sha256 (16 hex digits) of the native libraries llama-perplexity runs with: a rebuild with other numerics
    must not reuse a cached reference."""
    from .. import _paths
    d = _paths.lib_dir()
    files = [d / n for n in _BUILD_LIBS if (d / n).is_file()]
    sig = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if sig not in _build_ids:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            h.update(f.resolve().read_bytes())
        _build_ids[sig] = h.hexdigest()[:16]
    return _build_ids[sig]


def _ref_key(setting: Setting, ctx: int, chunks: int | None, text_sha: str) -> str:
    p = Path(setting.point.model)
    st = p.stat()
    return hashlib.sha256(json.dumps([str(p.resolve()), st.st_size, int(st.st_mtime), "sweep-ref", setting.slots,
                                      setting.point.k, ctx, chunks, text_sha, build_id()]).encode()).hexdigest()[:16]


def reference(setting: Setting, text: str, ctx: int, chunks: int | None, threads: int | None,
              timeout: float | None, progress=None, store: str = "file") -> tuple[Path, dict, bool]:
    """The exact run's log-probabilities (cached); returns (file, its result, whether it was cached)."""
    f, sha = quality._text_file(text)
    key = _ref_key(setting, ctx, chunks, sha + store)
    d = quality.kld_dir()
    d.mkdir(parents=True, exist_ok=True)
    stem = f"{Path(setting.point.model).stem}-k{setting.point.k}-S{setting.slots}-ub1-{key}"
    base, meta = d / f"{stem}.kld", d / f"{stem}.json"
    if base.is_file() and meta.is_file():
        return base, json.loads(meta.read_text()), True
    a = run_args(setting, parse_config("off"), ctx, threads, store)
    a += ["-f", str(f), "--kl-divergence-base", str(base) + ".part"]
    if chunks:
        a += ["--chunks", str(chunks)]
    out, dt = quality._run(a, timeout)
    r = quality.parse_ppl(out)
    r.update(seconds=dt, eval_seconds=parse_eval_seconds(out, dt), text_sha256=sha, ctx=ctx, command=_cmdline(a))
    r.update(parse_stats(out))
    os.replace(str(base) + ".part", base)
    meta.write_text(json.dumps(r) + "\n")
    return base, r, False


_stage_lock = __import__("threading").Lock()


def stage_model(model: str, stage_dir: str | Path) -> str:
    """A copy of the model in stage_dir (a tmpfs such as /dev/shm): file-store reads from it are memory
    copies, with the file store's semantics (background reads of substituted-away experts). Reused while
    its size and mtime match."""
    import shutil
    src = Path(model)
    dst = Path(stage_dir) / src.name
    st = src.stat()
    with _stage_lock:      # the quality pool's threads stage the same model at once
        if dst.is_file():
            dt = dst.stat()
            if dt.st_size == st.st_size and int(dt.st_mtime) == int(st.st_mtime):
                return str(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    return str(dst)


def quality_run(setting: Setting, cfg: SubConfig, base: Path, ctx: int, threads: int | None,
                profile: str | None, timeout: float | None, store: str = "file") -> dict:
    a = run_args(setting, cfg, ctx, threads, store, profile)
    a += ["--kl-divergence-base", str(base), "--kl-divergence"]
    out, dt = quality._run(a, timeout)
    r = quality.parse_kld(out)
    r.update(seconds=dt, eval_seconds=parse_eval_seconds(out, dt), command=_cmdline(a))
    r.update(parse_stats(out))
    return r


def speed_run(setting: Setting, cfg: SubConfig, text: str, ctx: int, chunks: int, threads: int | None,
              profile: str | None, timeout: float | None) -> dict:
    f, _ = quality._text_file(text)
    a = run_args(setting, cfg, ctx, threads, "file", profile) + ["-f", str(f), "--chunks", str(chunks)]
    out, dt = quality._run(a, timeout)
    r = quality.parse_ppl(out)
    ev = parse_eval_seconds(out, dt)
    n_tok = r.get("chunks", chunks) * ctx
    r.update(tokens=n_tok, seconds=dt, eval_seconds=ev, tok_s=n_tok / (ev or dt), command=_cmdline(a),
             loadavg_1min=os.getloadavg()[0])   # other jobs on the cores or the disk skew tok/s
    r.update(parse_stats(out))
    for what in ("io", "cpu"):
        r[f"{what}_pressure_avg10"] = _pressure(what)
    return r


def _pressure(what: str) -> float | None:
    """'some avg10' of /proc/pressure/WHAT (Linux PSI): the share of the last 10 s some task waited for it."""
    try:
        m = re.search(r"some avg10=([0-9.]+)", Path(f"/proc/pressure/{what}").read_text())
        return float(m.group(1)) if m else None
    except OSError:
        return None


# --------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------
@dataclass
class Options:
    text: str = "heldout"
    ctx: int = 256
    chunks: int | None = 16
    speed_ctx: int | None = None
    speed_chunks: int = 1
    threads: int | None = None
    calib_text: str = "calibration"
    calib_ctx: int = 512
    calib_chunks: int = 16
    quality: bool = True
    speed: bool = True
    quality_store: str = "file"
    stage: str | None = None
    jobs: int = 1
    speed_threads: int | None = None
    verify_off: bool = False
    timeout: float | None = None


def _row_key(setting: Setting, cfg: SubConfig, kind: str, o: Options) -> str:
    if kind == "speed":
        return f"{setting.key()}|{cfg.spec}|speed|c{o.speed_ctx or o.ctx}x{o.speed_chunks}|t{o.speed_threads or o.threads}"
    return f"{setting.key()}|{cfg.spec}|quality|c{o.ctx}x{o.chunks}|{o.text}"


def _progress(msg: str) -> None:
    sys.stderr.write(f"[sweep] {msg}\n")
    sys.stderr.flush()


def sweep(settings: list[Setting], configs: list[SubConfig], o: Options, out_json: Path | None = None,
          previous: dict | None = None, progress=_progress) -> dict:
    """Run the grid: the buddy profiles, then the exact references and quality runs (``o.jobs`` at a time,
    ``o.threads`` threads each), then the speed runs one at a time (``o.speed_threads``), so that no other run
    of ours shares the cores with a timed one.  Results are written to out_json after every run; runs found in
    ``previous`` (same key, same native build) are reused."""
    import dataclasses
    import threading
    from concurrent.futures import ThreadPoolExecutor
    res = {"options": {k: v for k, v in o.__dict__.items()}, "configs": [c.spec for c in configs],
           "settings": [], "runs": {}, "profiles": {}, "references": {}, "build": build_id()}
    if o.quality:
        check_scored(o.ctx, o.chunks)
    # runs of an earlier invocation with this build are kept (also those this one does not ask for, so that a
    # --no-quality or --no-speed pass over the same grid adds to the file instead of dropping the other kind)
    old = {k: v for k, v in (previous or {}).get("runs", {}).items()
           if "error" not in v and v.get("build") == res["build"]}
    res["runs"].update(old)
    res["references"].update((previous or {}).get("references", {}))
    kinds = (["quality"] if o.quality else []) + (["speed"] if o.speed else [])
    n_runs = len(settings) * len(configs) * len(kinds)
    count = [0]
    lock = threading.Lock()
    t_start = time.monotonic()

    def say(msg):
        if progress:
            progress(msg)

    def save():
        if out_json:
            out_json.parent.mkdir(parents=True, exist_ok=True)
            tmp = out_json.with_suffix(".json.part")
            tmp.write_text(json.dumps(res, indent=1) + "\n")
            os.replace(tmp, out_json)

    def done(key, r, what, t0):
        with lock:
            count[0] += 1
            res["runs"][key] = r
            save()
            say(f"{count[0]}/{n_runs} {what} ({time.monotonic() - t0:.1f} s; {time.monotonic() - t_start:.0f} s total)")

    def reuse(key) -> bool:
        if key in old:
            with lock:
                count[0] += 1
            return True
        return False

    # 0. buddy profiles, one per (model, k)
    profiles: dict[str, str | None] = {}
    for s in settings:
        res["settings"].append({"key": s.key(), "label": s.label, "model": s.point.model, "k": s.point.k,
                                "n_expert": s.n_expert, "fraction": s.fraction, "slots": s.slots})
        pk = f"{s.point.model}@{s.point.k}"
        if pk in profiles or not any(c.needs_profile() for c in configs):
            continue
        t0 = time.monotonic()
        try:
            pf, info = ensure_profile(s.point, o.calib_text, o.calib_ctx, o.calib_chunks, o.speed_threads or o.threads,
                                      o.timeout, progress)
            res["profiles"][pk] = info
            profiles[pk] = str(pf)
            say(f"profile of {s.point.label}: {pf} ({time.monotonic() - t0:.1f} s)")
        except (SweepError, QualityError) as e:
            res["profiles"][pk] = {"error": str(e).splitlines()[0]}
            profiles[pk] = None
            say(f"no profile for {s.point.label}: {str(e).splitlines()[0]}")

    def profile_of(s: Setting):
        return profiles.get(f"{s.point.model}@{s.point.k}")

    def staged(s: Setting) -> Setting:
        if not o.stage:
            return s
        return dataclasses.replace(s, point=dataclasses.replace(s.point, model=stage_model(s.point.model, o.stage)))

    # 1. exact references and quality runs
    def do_ref(s: Setting):
        t0 = time.monotonic()
        try:
            base, ref, cached = reference(staged(s), o.text, o.ctx, o.chunks, o.threads, o.timeout, progress,
                                          o.quality_store)
        except (SweepError, QualityError, OSError) as e:
            with lock:
                res["references"][s.key()] = {"error": str(e).splitlines()[0]}
            say(f"exact reference {s.label} failed: {str(e).splitlines()[0]}")
            return None, {"error": str(e).splitlines()[0]}
        with lock:
            res["references"][s.key()] = dict(ref, file=str(base))
        say(f"exact reference {s.label}: PPL {ref['ppl']:.4f}"
            + (" (cached)" if cached else f" ({time.monotonic() - t0:.1f} s)"))
        return base, ref

    def do_quality(s: Setting, c: SubConfig, ref_future):
        key = _row_key(s, c, "quality", o)
        if reuse(key):
            return
        base, ref = ref_future.result()
        t0 = time.monotonic()
        r: dict = {"setting": s.key(), "config": c.spec, "kind": "quality", "build": res["build"]}
        try:
            if c.needs_profile() and not profile_of(s):
                raise SweepError(f"{c.spec}: no buddy profile for {s.point.label}")
            if base is None:
                raise SweepError("no exact reference: " + ref.get("error", "?"))
            if c.mode == "off" and not o.verify_off:
                r.update(ppl=ref["ppl"], ppl_err=ref["ppl_err"], kld=0.0, ppl_ratio=1.0, same_top=1.0,
                         from_reference=True, seconds=0.0, cache=ref.get("cache"), sub=ref.get("sub"))
            else:
                r.update(quality_run(staged(s), c, base, o.ctx, o.threads, profile_of(s), o.timeout,
                                     o.quality_store))
            r["ppl_exact"] = ref["ppl"]
            r["cost_pct"] = 100.0 * (r["ppl"] / ref["ppl"] - 1.0)
            what = f"{s.label} {c.spec} quality: PPL {r['ppl']:.4f} ({r['cost_pct']:+.2f} %), KLD {r['kld']:.5f}"
        except (SweepError, QualityError, OSError) as e:
            r["error"] = str(e).splitlines()[0]
            what = f"{s.label} {c.spec} quality FAILED: {r['error'][:200]}"
        done(key, r, what, t0)

    if o.quality:
        todo = [(s, c) for s in settings for c in configs]
        need = {s.key() for s, c in todo if _row_key(s, c, "quality", o) not in old}
        with ThreadPoolExecutor(max_workers=max(1, o.jobs)) as ex:
            # references first: the pool is FIFO, so a quality run never waits on a reference still queued
            refs = {s.key(): ex.submit(do_ref, s) for s in settings if s.key() in need}
            futs = [ex.submit(do_quality, s, c, refs[s.key()]) if s.key() in refs else None for s, c in todo]
            for (s, c), f in zip(todo, futs):
                if f is None:
                    reuse(_row_key(s, c, "quality", o))
                else:
                    f.result()

    # 2. speed runs, one at a time
    if o.speed:
        for s in settings:
            for c in configs:
                key = _row_key(s, c, "speed", o)
                if reuse(key):
                    continue
                t0 = time.monotonic()
                r = {"setting": s.key(), "config": c.spec, "kind": "speed", "build": res["build"]}
                try:
                    if c.needs_profile() and not profile_of(s):
                        raise SweepError(f"{c.spec}: no buddy profile for {s.point.label}")
                    r.update(speed_run(s, c, o.text, o.speed_ctx or o.ctx, o.speed_chunks,
                                       o.speed_threads or o.threads, profile_of(s), o.timeout))
                    what = (f"{s.label} {c.spec} speed: {r['tok_s']:.1f} tok/s, "
                            f"{r['cache']['mib_loaded']:.0f} MiB loaded, stall {r['cache']['stall_ms']:.0f} ms")
                except (SweepError, QualityError) as e:
                    r["error"] = str(e).splitlines()[0]
                    what = f"{s.label} {c.spec} speed FAILED: {r['error'][:200]}"
                done(key, r, what, t0)
    res["seconds"] = time.monotonic() - t_start
    res["table"] = table_rows(res)
    res["recommendation"] = recommend(res)
    save()
    return res


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _cmd_sweep(args) -> int:
    from . import corpus
    from .._paths import BuildNotFound
    try:
        out_dir = Path(args.output)
        out_json = out_dir / f"{args.name}.json"
        if args.replot:
            if not out_json.is_file():
                raise SweepError(f"--replot: {out_json} does not exist")
            res = json.loads(out_json.read_text())
            res["table"] = table_rows(res)
            res["recommendation"] = recommend(res)
            paths = write_outputs(res, out_dir, args.name)
            print(format_table(res))
            print("\n" + "\n".join(f"{k}: {v}" for k, v in paths.items()))
            return 0
        points = [parse_point(p) for p in args.point]
        configs = [parse_config(c) for c in args.config]
        if len({c.spec for c in configs}) != len(configs):
            raise SweepError("a configuration is given twice")
        if "off" not in [c.spec for c in configs]:
            configs.insert(0, parse_config("off"))     # the exact row every other one is measured against
        settings = expand(points, args.fraction)
        check_scored(args.ctx_size, args.chunks)
        o = Options(text=args.file, ctx=args.ctx_size, chunks=args.chunks, speed_ctx=args.speed_ctx,
                    speed_chunks=args.speed_chunks, threads=args.threads, calib_text=args.calib_text,
                    calib_ctx=args.calib_ctx, calib_chunks=args.calib_chunks, quality=not args.no_quality,
                    speed=not args.no_speed, verify_off=args.verify_off, timeout=args.timeout,
                    quality_store=args.quality_store, stage=args.stage, jobs=args.jobs,
                    speed_threads=args.speed_threads)
        previous = None
        if args.resume and out_json.is_file():
            previous = json.loads(out_json.read_text())
        _progress(f"{len(settings)} settings x {len(configs)} configurations: "
                  + ", ".join(s.label for s in settings))
        res = sweep(settings, configs, o, out_json, previous)
    except (SweepError, QualityError, corpus.CorpusError, BuildNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    paths = write_outputs(res, out_dir, args.name)
    print(format_table(res))
    print("\n" + "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 1 if any("error" in r for r in res["runs"].values()) else 0


def register(sub) -> None:
    s = sub.add_parser(
        "substitute-sweep", help="quality vs speed of substitution on a miss (--moe-substitute) on the testbed",
        description="For each MODEL@K x cache fraction x substitution configuration: perplexity, PPL cost and "
        "mean KL divergence against the exact run of the same model at the same k and slot count (decode "
        "regime: llama-perplexity -ub 1 -b CTX, file store; --stage /dev/shm copies the model to a tmpfs first), "
        "and decode speed from a shorter pass, run alone, reading experts from the original GGUF with O_DIRECT, "
        "with its --moe-stats. Writes NAME.json, NAME.md and the plots NAME.png (PPL cost vs tok/s), "
        "NAME-avoided.png and NAME-kld.png. See docs/substitution.md. Example: pyvis substitute-sweep "
        "--point shared+16@4 --fraction 0.5 0.75 --config off router router:tae=p90 buddy -c 256 --chunks 16 "
        "-t 1 -j 2 --stage /dev/shm/vis-sweep",
        formatter_class=lambda prog: __import__("argparse").HelpFormatter(prog, max_help_position=32))
    s.add_argument("--point", nargs="+", default=DEFAULT_POINTS, metavar="MODEL@K",
                   help="models and top-k: a testbed preset (models/testbed/PRESET.gguf) or a GGUF path, @ the k "
                   f"(default: {' '.join(DEFAULT_POINTS)})")
    s.add_argument("--fraction", type=float, nargs="+", default=DEFAULT_FRACTIONS, metavar="F",
                   help="cache sizes as fractions of the experts: --moe-slots round(F * n_expert) "
                   f"(default: {' '.join(map(str, DEFAULT_FRACTIONS))})")
    s.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS, metavar="SPEC",
                   help="substitution configurations MODE[:KEY=VALUE,...]; MODE off|router|buddy|auto; keys tae "
                   "(off|TAU|pN), margin, beta, budget, rank, weight (--moe-sub-weight), wrel (--moe-sub-weight = "
                   "wrel/k); "
                   "off is always added (default: " + " ".join(DEFAULT_CONFIGS) + ")")
    s.add_argument("-f", "--file", default="heldout", metavar="TEXT",
                   help="evaluation text: heldout (default), vim-all, or a file")
    s.add_argument("-c", "--ctx-size", type=int, default=256, metavar="N", help="context of the quality runs (default: 256)")
    s.add_argument("--chunks", type=int, default=16, metavar="N", help="chunks of the quality runs (default: 16)")
    s.add_argument("--speed-ctx", type=int, metavar="N", help="context of the speed runs (default: -c)")
    s.add_argument("--speed-chunks", type=int, default=1, metavar="N", help="chunks of the speed runs (default: 1)")
    s.add_argument("-t", "--threads", type=int, metavar="N",
                   help="CPU threads of each reference / quality run (default: min(cores, 8))")
    s.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                   help="reference / quality runs at a time (default: 1); e.g. -j 2 -t 1 on 2 cores, which also "
                   "keeps ggml's spinning thread barriers from stalling when other jobs take a core")
    s.add_argument("--speed-threads", type=int, metavar="N",
                   help="CPU threads of the speed runs, which always run alone (default: -t)")
    s.add_argument("--calib-text", default="calibration", metavar="TEXT",
                   help="text the buddy profiles are calibrated on (default: calibration; never the held-out text)")
    s.add_argument("--calib-ctx", type=int, default=512, metavar="N", help="context of the calibration trace (default: 512)")
    s.add_argument("--calib-chunks", type=int, default=16, metavar="N",
                   help="chunks of the calibration trace (default: 16)")
    s.add_argument("--quality-store", choices=["file", "model"], default="file",
                   help="--moe-store of the exact reference and the quality runs (default: file). model copies "
                   "experts from llama.cpp's mapping and never reads a substituted-away expert in the background, "
                   "so with substitution on its results differ from the file store's")
    s.add_argument("--stage", metavar="DIR",
                   help="copy each model into DIR (a tmpfs such as /dev/shm) for the reference and quality runs: "
                   "file-store semantics at memory speed; the speed runs always read the original file. The "
                   "copies are left there for the next run: delete them after")
    s.add_argument("--verify-off", action="store_true",
                   help="also run off with --kl-divergence (otherwise its row is the exact reference: KLD 0)")
    s.add_argument("--no-quality", action="store_true", help="skip the quality runs")
    s.add_argument("--no-speed", action="store_true", help="skip the speed runs")
    s.add_argument("--timeout", type=float, metavar="S", help="time limit of one llama-perplexity run in seconds")
    s.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="output directory (default: models/testbed/results)")
    s.add_argument("--name", default="substitute-sweep", help="file name stem of the outputs (default: substitute-sweep)")
    s.add_argument("--resume", action="store_true", help="reuse the runs of an earlier NAME.json with the same keys "
                   "(and the same native build)")
    s.add_argument("--replot", action="store_true", help="run nothing: rebuild the table, recommendation and plots "
                   "from NAME.json")
    s.set_defaults(fn=_cmd_sweep_default_out)


def _cmd_sweep_default_out(args) -> int:
    if args.output is None:
        from .moefy import default_out_dir
        args.output = str(default_out_dir() / "results")
    return _cmd_sweep(args)
