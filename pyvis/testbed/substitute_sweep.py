"""Quality-vs-speed study of substitution on a miss (``pyvis substitute-sweep``; issue #13 item 5).

A *point* is a model at a top-k (``MODEL@K``: a testbed preset or a GGUF path); a *setting* is a point at a
cache size (``--moe-slots S``, S = round(fraction * n_expert)); a *configuration* is a substitution rule
(``off``, ``router``, ``buddy`` with gate options, see :func:`parse_config`) or a precision rule
(``prec:all:type=Q4_0``, ``prec:gate=0.1:type=Q4_0``: a miss runs from a low-bit shadow of the expert,
:mod:`pyvis.testbed.sweep_precision`).  For every setting:

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
--trace``, cached under ``models/testbed/profiles/``.  A precision rule needs the shadow of the model in its type:
made once per (model, type) with ``pyvis shadow``'s writer, cached under ``models/testbed/shadows/``.

Output (``-o DIR``): ``NAME.json`` (every run, written after each one; ``--resume`` reuses its runs),
``NAME.md`` (the table) and ``NAME.png`` (Pareto: decode tok/s against PPL cost, one panel per setting;
``NAME-avoided.png``: share of misses that got a stand-in or ran from a shadow against PPL cost;
``NAME-kld.png``: tok/s against mean KLD).  The runs themselves: :mod:`pyvis.testbed.sweep_runs`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .quality import QualityError
from .sweep_parse import (CACHE_FIELDS, SUB_FIELDS, SUB_HEADINGS, SweepError, parse_eval_seconds,  # noqa: F401
                          parse_stats, parse_tiers)
from .sweep_report import format_table, merge, plot, recommend, table_rows, write_outputs  # noqa: F401
from .sweep_grid import (CONFIG_KEYS, DEFAULT_CONFIGS, DEFAULT_FRACTIONS, DEFAULT_POINTS, MODES,  # noqa: F401
                         Point, Setting, SubConfig, _cmdline, _overrides, check_scored, expand, n_expert_of,
                         parse_config, parse_point, resolve_model, run_args, slots_for)
from .sweep_profiles import ensure_profile, profile_dir, profile_summary  # noqa: F401
from .sweep_precision import PrecConfig, ensure_shadow, is_prec, parse_prec_config, shadow_dir  # noqa: F401
from .sweep_runs import build_id, quality_run, reference, speed_run, stage_model  # noqa: F401


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
    speed_repeats: int = 1
    verify_off: bool = False
    timeout: float | None = None


def _row_key(setting: Setting, cfg: SubConfig, kind: str, o: Options) -> str:
    if kind == "speed":
        return (f"{setting.key()}|{cfg.spec}|speed|c{o.speed_ctx or o.ctx}x{o.speed_chunks}|t{o.speed_threads or o.threads}"
                + (f"|r{o.speed_repeats}" if o.speed_repeats > 1 else ""))
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
    old = _kept_runs(previous, res["build"])
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

    # 0. the files the configurations need (SubConfig.side_key): buddy profiles, one per (model, k), and shadow
    #    sidecars of the precision rules, one per (model, type)
    res["shadows"] = dict((previous or {}).get("shadows", {}))
    sides: dict[tuple, str | None] = {}
    for s in settings:
        res["settings"].append({"key": s.key(), "label": s.label, "model": s.point.model, "k": s.point.k,
                                "n_expert": s.n_expert, "fraction": s.fraction, "slots": s.slots})
        for c in configs:
            sk = c.side_key(s.point)
            if sk is None or sk in sides:
                continue
            t0 = time.monotonic()
            kind, where = sk[0], (f"{s.point.model}@{s.point.k}" if sk[0] == "profile" else f"{sk[1]}|{sk[2]}")
            what = f"{kind} of {s.point.label}" if kind == "profile" else f"{sk[2]} shadow of {Path(sk[1]).name}"
            try:
                if kind == "profile":
                    f, info = ensure_profile(s.point, o.calib_text, o.calib_ctx, o.calib_chunks,
                                             o.speed_threads or o.threads, o.timeout, progress)
                else:
                    f, info = ensure_shadow(sk[1], sk[2], o.speed_threads or o.threads, progress)
                res["profiles" if kind == "profile" else "shadows"][where] = info
                sides[sk] = str(f)
                say(f"{what}: {f} ({time.monotonic() - t0:.1f} s)")
            except (SweepError, QualityError) as e:
                res["profiles" if kind == "profile" else "shadows"][where] = {"error": str(e).splitlines()[0]}
                sides[sk] = None
                say(f"no {what}: {str(e).splitlines()[0]}")

    def side_of(s: Setting, c: SubConfig, stage: bool = False):
        """The profile or shadow c needs at s (SweepError when it could not be made); staged with the model."""
        sk = c.side_key(s.point)
        if sk is None:
            return None
        if not sides.get(sk):
            raise SweepError(f"{c.spec}: no " + ("buddy profile" if sk[0] == "profile" else f"{sk[2]} shadow")
                             + f" for {s.point.label}")
        return stage_model(sides[sk], o.stage) if stage and o.stage and sk[0] == "shadow" else sides[sk]

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
            side = side_of(s, c, stage=True)
            if base is None:
                raise SweepError("no exact reference: " + ref.get("error", "?"))
            if c.mode == "off" and not o.verify_off:
                r.update(ppl=ref["ppl"], ppl_err=ref["ppl_err"], kld=0.0, ppl_ratio=1.0, same_top=1.0,
                         from_reference=True, seconds=0.0, cache=ref.get("cache"), sub=ref.get("sub"))
            else:
                r.update(quality_run(staged(s), c, base, o.ctx, o.threads, side, o.timeout, o.quality_store))
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

    # 2. speed runs, one at a time; with repeats, round-robin over the grid (a burst of other jobs' I/O then
    #    hits one try of many configurations, not every try of one), the median try kept
    if o.speed:
        todo = [(s, c) for s in settings for c in configs if not reuse(_row_key(s, c, "speed", o))]
        tries: dict[str, list[dict]] = {}
        n_rep = max(1, o.speed_repeats)
        for rep in range(n_rep):
            for s, c in todo:
                key = _row_key(s, c, "speed", o)
                t0 = time.monotonic()
                r = {"setting": s.key(), "config": c.spec, "kind": "speed", "build": res["build"]}
                try:
                    r.update(speed_run(s, c, o.text, o.speed_ctx or o.ctx, o.speed_chunks,
                                       o.speed_threads or o.threads, side_of(s, c), o.timeout))
                    what = (f"{s.label} {c.spec} speed: {r['tok_s']:.1f} tok/s, "
                            f"{r['cache']['mib_loaded']:.0f} MiB loaded, stall {r['cache']['stall_ms']:.0f} ms")
                except (SweepError, QualityError) as e:
                    r["error"] = str(e).splitlines()[0]
                    what = f"{s.label} {c.spec} speed FAILED: {r['error'][:200]}"
                tries.setdefault(key, []).append(r)
                if n_rep == 1:
                    done(key, r, what, t0)
                elif rep + 1 < n_rep:
                    with lock:      # saved as partial: a --resume after an interruption runs it again
                        res["runs"][key] = dict(_median_try(tries[key]), partial=True)
                        save()
                    say(f"try {rep + 1}/{n_rep}: {what}")
                else:
                    m = _median_try(tries[key])
                    done(key, m, f"{what} (median of {n_rep} tries: {m.get('tok_s', float('nan')):.1f} tok/s)", t0)
    res["seconds"] = time.monotonic() - t_start
    res["table"] = table_rows(res)
    res["recommendation"] = recommend(res)
    save()
    return res


def _kept_runs(previous: dict | None, build: str) -> dict:
    """The runs of an earlier invocation that --resume reuses: same native build, no error, not the partial
    median of an interrupted --speed-repeats pass."""
    return {k: v for k, v in (previous or {}).get("runs", {}).items()
            if "error" not in v and not v.get("partial") and v.get("build") == build}


def _median_try(tries: list[dict]) -> dict:
    """The try with the median tok/s (the upper one of an even count) of a speed run's tries, with every try's
    tok/s in ``tok_s_tries``; an error when no try succeeded, and the tries so far while some are to come."""
    ok = sorted((t for t in tries if "error" not in t), key=lambda t: t["tok_s"])
    if not ok:
        return dict(tries[-1], tries=len(tries))
    r = dict(ok[len(ok) // 2])
    r.update(tok_s_tries=[t["tok_s"] for t in tries if "error" not in t], tries=len(tries),
             failed_tries=len(tries) - len(ok))
    return r


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
        if args.speed_repeats < 1:
            raise SweepError(f"--speed-repeats {args.speed_repeats}: expected at least 1")
        o = Options(text=args.file, ctx=args.ctx_size, chunks=args.chunks, speed_ctx=args.speed_ctx,
                    speed_chunks=args.speed_chunks, threads=args.threads, calib_text=args.calib_text,
                    calib_ctx=args.calib_ctx, calib_chunks=args.calib_chunks, quality=not args.no_quality,
                    speed=not args.no_speed, verify_off=args.verify_off, timeout=args.timeout,
                    quality_store=args.quality_store, stage=args.stage, jobs=args.jobs,
                    speed_threads=args.speed_threads, speed_repeats=args.speed_repeats)
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
        "substitute-sweep", help="quality vs speed of substitution on a miss (--moe-substitute) or of shadow "
        "experts (--moe-precision) on the testbed",
        description="For each MODEL@K x cache fraction x configuration (a substitution rule, or a precision rule "
        "prec:RULE:type=T that runs misses from a low-bit shadow): perplexity, PPL cost and "
        "mean KL divergence against the exact run of the same model at the same k and slot count (decode "
        "regime: llama-perplexity -ub 1 -b CTX, file store; --stage /dev/shm copies the model to a tmpfs first), "
        "and decode speed from a shorter pass, run alone, reading experts from the original GGUF with O_DIRECT, "
        "with its --moe-stats. Writes NAME.json, NAME.md and the plots NAME.png (PPL cost vs tok/s), "
        "NAME-avoided.png and NAME-kld.png. See docs/substitution.md and docs/precision-study.md. Examples: "
        "pyvis substitute-sweep --point shared+16@4 --fraction 0.5 0.75 --config off router router:tae=p90 buddy "
        "-c 256 --chunks 16 -t 1 -j 2 --stage /dev/shm/vis-sweep; pyvis substitute-sweep --point shared+16@8 "
        "--config off prec:all:type=Q4_0 prec:gate=0.1:type=Q4_0 --stage /dev/shm/vis-sweep",
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
                   "wrel/k); or precision rules prec:RULE:type=T[,KEY=VALUE...] (a miss runs from a low-bit shadow, "
                   "made and cached per model and type); RULE all|vision|gate[=W]|auto, keys type (Q4_0, IQ4_NL, "
                   "Q5_0, Q8_0, ...), gate and target (auto), vision, slots (auto|N), refetch (on|off), e.g. "
                   "prec:gate=0.1:type=Q4_0; "
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
    s.add_argument("--speed-repeats", type=int, default=1, metavar="N",
                   help="tries of each speed run, round-robin over the grid; the median tok/s is kept (default: 1). "
                   "Other jobs' I/O on a shared machine skews single runs")
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
