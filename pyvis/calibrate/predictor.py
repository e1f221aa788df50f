"""Predictor calibration (``pyvis calibrate predictor``): the co-activation tables that ``--moe-predict coact`` reads
(docs/prediction-calibration.md, issue #16), and their held-out accuracy against the frequency baseline.

Input: routing traces (``--trace``) or a text run through our ``llama-perplexity --moe-trace`` (``--corpus``), as for
``pyvis calibrate buddies`` (:mod:`pyvis.calibrate.inputs`).  The counting, the predictors and the metrics are
:mod:`pyvis.runtime.predict`'s; the file is :mod:`pyvis.runtime.predict_profile`'s.

Evaluation is always on routing the tables did not see: ``--eval-trace`` files, an ``--eval-corpus`` run, or else the
last ``--holdout`` share of each calibration trace's tokens (the profile is then fitted on the rest only).  Reported per
predictor (frequency, coact), per source layer l and distance d = 1..W: recall@B, precision@B and the bytes of the
experts predicted but not used (expert bytes from the model GGUF), and the VisMMOE decayed-target recall.

``--mlp`` also fits the VisMMOE lookahead MLP (:mod:`pyvis.calibrate.mlp`) into the same profile.  It needs hidden
states, which traces do not carry: the corpus runs go through the eval callback instead of llama-perplexity, and
the report adds the MLP and the next-router predictor (the routers ahead on the captured FFN inputs).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..runtime import predict
from ..runtime import profile as prof
from ..runtime.predict_profile import KIND, write_predictor_profile
from ..runtime.trace import Trace, TraceError
from ..runtime.predict_mlp import DEFAULT_HIDDEN as DEFAULT_MLP_HIDDEN, DEFAULT_HISTORY as DEFAULT_MLP_HISTORY
from .inputs import CalibrationError, add_input_args, check_traces, log, traces_from_args, traces_from_corpus, \
    traces_from_files
from .mlp import DEFAULT_EPOCHS as DEFAULT_MLP_EPOCHS

DEFAULT_HOLDOUT = 0.2
_CHUNK = 4096
REPORTED = predict.PREDICTORS + ("mlp", "next-router")    # next-router and mlp: --mlp runs (hidden states)


# --------------------------------------------------------------------------
# fit and evaluate
# --------------------------------------------------------------------------
def routes_of(traces: list[Trace]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids [Lr, T, k], layers [Lr])`` of each trace (the layers that routed every token)."""
    return [t.routes() for t in traces if len(t)]


def split(routes: list, holdout: float) -> tuple[list, list]:
    """The first ``1 - holdout`` of each trace's tokens to fit, the rest to evaluate."""
    if not 0 < holdout < 1:
        raise CalibrationError(f"--holdout {holdout}: must be in (0, 1)")
    fit_, ev = [], []
    for ids, layers in routes:
        cut = int(round(ids.shape[1] * (1 - holdout)))
        if cut < 1 or cut >= ids.shape[1]:
            raise CalibrationError(f"--holdout {holdout}: a trace of {ids.shape[1]} tokens leaves nothing to "
                                   "fit or to evaluate")
        fit_.append((ids[:, :cut], layers))
        ev.append((ids[:, cut:], layers))
    return fit_, ev


def fit(routes: list, n_layer: int, n_expert: int, lookahead: int = predict.DEFAULT_LOOKAHEAD,
        progress=None) -> predict.Counts:
    """The counts of :mod:`pyvis.runtime.predict` over ``routes``, with a progress callback over tokens."""
    c = predict.Counts.empty(n_layer, n_expert, lookahead)
    total, done = sum(ids.shape[1] for ids, _ in routes), 0
    for ids, layers in routes:
        for s in range(0, ids.shape[1], _CHUNK):
            c.add(ids[:, s: s + _CHUNK], layers)
            done += min(_CHUNK, ids.shape[1] - s)
            if progress:
                progress(done, total)
    return c


def expert_bytes(model_path: str, n_layer: int) -> np.ndarray:
    """``[n_layer]`` bytes of one expert of each layer (0 for layers without experts), from the GGUF header."""
    from ..runtime.plan import read_shape
    eb = np.zeros(n_layer)
    for il, nb in read_shape(model_path).expert_bytes.items():
        if il < n_layer:
            eb[il] = nb
    return eb


# --------------------------------------------------------------------------
# text output
# --------------------------------------------------------------------------
def _m(v) -> float:
    a = np.asarray(v, float)
    return float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")


def format_eval(r: dict) -> str:
    """The summary (means over source layers) and, at B = k, the per-layer recall of every predictor and distance."""
    W, k, preds = r["lookahead"], r["k"], [p for p in REPORTED if p in r]
    out = [f"held-out accuracy: {r['tokens']} tokens, top-{k}, lookahead {W}, gamma {r['gamma']:g} "
           f"(means over the {len(r['layers'])} source layers)",
           "predictor   d        B  recall  precision  wasted KiB  recall(new)",
           "(wasted: per token and layer; recall(new): of the experts the previous token did not use there)"]
    for p in preds:
        for d in [f"d{i}" for i in range(1, W + 1)] + ["decayed"]:
            for B in r["budgets"]:
                x = r[p][d]
                rec = _m(x["recall"][str(B)])
                if d == "decayed":
                    out.append(f"{p:11s} {d:7s}  {B:3d}  {rec:6.3f}")
                    continue
                out.append(f"{p:11s} {d:7s}  {B:3d}  {rec:6.3f}  {_m(x['precision'][str(B)]):9.3f}  "
                           f"{_m(x['wasted_bytes'][str(B)]) / 1024:10.1f}  {_m(x['recall_new'][str(B)]):11.3f}")
    ds = [f"d{i}" for i in range(1, W + 1)] + ["decayed"]
    out += ["", f"recall@{k} per source layer l (target l+d)",
            "layer  " + "  ".join(f"{p[:5]}:{d:7s}" for p in preds for d in ds)]
    for a, il in enumerate(r["layers"]):
        out.append(f"{il:5d}  " + "  ".join(f"{r[p][d]['recall'][str(k)][a]:13.3f}" for p in preds for d in ds))
    return "\n".join(out)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _eval_routes(args, traces: list[Trace], n_layer: int, n_expert: int) -> tuple[list, list, str]:
    """``(fit routes, eval routes, what was evaluated on)``; the evaluation routing is checked like the calibration."""
    fit_routes = routes_of(traces)
    if args.eval_trace or args.eval_corpus:
        if args.eval_trace:
            _refuse_same_traces(args.trace or [], args.eval_trace)
            ev, src = traces_from_files(args.eval_trace)
        else:
            ev, src = traces_from_corpus(args.model, args.eval_corpus, args.ctx, args.chunks, args.threads,
                                         args.eval_trace_out, args.n_expert_used)
        ev_k, k = check_traces(ev, n_layer, n_expert), check_traces(traces, n_layer, n_expert)
        if ev_k != k:
            raise CalibrationError(f"the evaluation routes top-{ev_k}, the calibration top-{k}")
        return fit_routes, routes_of(ev), src
    if args.holdout == 0:
        return fit_routes, [], ""
    f, e = split(fit_routes, args.holdout)
    return f, e, f"the last {args.holdout:g} of the calibration tokens"


def _refuse_same_traces(cal: list[str], ev: list[str]) -> None:
    from ..assets import sha256_file
    seen = {sha256_file(Path(p)): p for p in cal if Path(p).is_file()}
    for p in ev:
        if Path(p).is_file() and sha256_file(Path(p)) in seen:
            raise CalibrationError(f"--eval-trace {p} is the calibration trace {seen[sha256_file(Path(p))]}: "
                                   "evaluate on routing the tables never saw")


def _json_safe(x):
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _cmd_predictor(args) -> int:
    from ..progress import Progress
    from ..testbed.quality import QualityError
    try:
        if not Path(args.model).is_file():
            raise CalibrationError(f"model not found: {args.model}")
        if args.lookahead < 1:
            raise CalibrationError(f"--lookahead {args.lookahead}: must be at least 1")
        if not 0 < args.gamma <= 1:
            raise CalibrationError(f"--gamma {args.gamma}: must be in (0, 1]")
        if args.eval_corpus and args.corpus and Path(args.eval_corpus) == Path(args.corpus):
            raise CalibrationError("--eval-corpus is the calibration text: evaluate on text the tables never saw")
        out = Path(args.out)
        prof.check_output_path(out, Path(args.model), KIND, args.force)     # before minutes of work
        fp = prof.model_fingerprint(args.model)
        L, E = fp["n_layer"], fp["n_expert"]
        if args.budgets and (max(args.budgets) > E or min(args.budgets) < 1):
            raise CalibrationError(f"--budgets: each B must be in 1..{E}")     # before minutes of work
        if args.mlp:
            return _cmd_mlp(args, out, fp)
        traces, source = traces_from_args(args)
        k = check_traces(traces, L, E)
        fit_routes, ev_routes, ev_src = _eval_routes(args, traces, L, E)
        if not fit_routes:
            raise CalibrationError("the traces hold no routing records")
        total = sum(ids.shape[1] for ids, _ in fit_routes)
        counts = fit(fit_routes, L, E, args.lookahead, progress=Progress("predictor", total, unit="tokens", scale=1))
        source += f" (fitted on {total} tokens" + (f"; evaluated on {ev_src})" if ev_src else ")")
        path = write_predictor_profile(out, fp, counts.freq(), counts.tables(), k, total, source, args.weighting,
                                       model_path=args.model, force=args.force)
        res = None
        if ev_routes:
            budgets = args.budgets or predict.default_budgets(k, E)
            log(f"evaluating on {ev_src} ...")
            model = predict.Model.from_counts(counts, args.weighting)
            res = predict.evaluate(model, ev_routes, budgets, gamma=args.gamma,
                                   expert_bytes=expert_bytes(args.model, L))
            res |= {"model": str(args.model), "profile": str(path), "weighting": args.weighting,
                    "calibration": source, "evaluation": ev_src, "fit_tokens": total}
    except (CalibrationError, predict.PredictError, prof.ProfileError, TraceError, QualityError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"predictor profile: lookahead {args.lookahead}, top-{k} of {E} experts, {total} tokens, "
          f"weighting {args.weighting}")
    return _report(res, args, path, fp, "--holdout 0 and no --eval-trace / --eval-corpus")


def _report(res: dict | None, args, path: Path, fp: dict, no_eval: str) -> int:
    """Print the evaluation (and write it to --json), then the profile written."""
    if res is not None:
        print(format_eval(res))
        if args.json:
            Path(args.json).write_text(json.dumps(_json_safe(res)) + "\n")
            print(f"\nwrote {args.json}")
    else:
        print(f"(no evaluation: {no_eval})")
    print(f"\nwrote {path} (router hash {fp['router_hash']:016x})")
    return 0


def _check_mlp_args(args) -> None:
    if args.trace or args.eval_trace:
        raise CalibrationError("--mlp learns from and is evaluated on hidden states, which routing traces "
                               "(--trace / --eval-trace) do not carry: give --corpus TEXT [--eval-corpus TEXT] "
                               "and the run captures them")
    if args.trace_out or args.eval_trace_out:
        raise CalibrationError("--trace-out / --eval-trace-out: --mlp runs no llama-perplexity trace")
    for name, v, hi in (("--mlp-hidden", args.mlp_hidden, 4096), ("--mlp-epochs", args.mlp_epochs, 10000),
                        ("--mlp-history", args.mlp_history, 64)):     # the C loader's limits
        if not 1 <= v <= hi:
            raise CalibrationError(f"{name} {v}: must be in 1..{hi}")
    if args.lookahead > 64:
        raise CalibrationError(f"--lookahead {args.lookahead}: at most 64 with --mlp")


def _cmd_mlp(args, out: Path, fp: dict) -> int:
    """``--mlp``: capture a corpus run's routing and hidden states, fit the tables and the MLP, evaluate all four
    predictors (frequency, coact, mlp, next-router) on held-out hidden states."""
    from ..progress import Progress
    from . import mlp as M
    _check_mlp_args(args)
    L, E = fp["n_layer"], fp["n_expert"]
    cap = M.capture(args.model, args.corpus, args.ctx, args.chunks, args.threads, args.n_expert_used)
    if args.eval_corpus:
        ev = M.capture(args.model, args.eval_corpus, args.ctx, args.chunks, args.threads, args.n_expert_used)
        ev_src = ev.source
    elif args.holdout:
        cap, ev = cap.split(args.holdout)
        ev_src = f"the last {args.holdout:g} of the calibration tokens"
    else:
        ev, ev_src = None, ""
    k, total = cap.k, cap.n_tokens
    counts = fit(cap.routes(), L, E, args.lookahead)
    log(f"fitting the MLP: {len(cap.layers) - 1} source layers, {total} tokens, {args.mlp_epochs} epochs ...")
    weights = M.fit_mlp(cap, L, E, args.lookahead, args.mlp_hidden, args.mlp_history, gamma=args.gamma,
                        epochs=args.mlp_epochs, seed=args.seed,
                        progress=Progress("mlp", 1, unit="layer-epochs", scale=1))
    source = cap.source + f" (fitted on {total} tokens" + (f"; evaluated on {ev_src})" if ev_src else ")")
    path = write_predictor_profile(out, fp, counts.freq(), counts.tables(), k, total, source, args.weighting,
                                   model_path=args.model, mlp=weights, force=args.force)
    print(f"predictor profile: lookahead {args.lookahead}, top-{k} of {E} experts, {total} tokens, weighting "
          f"{args.weighting}, MLP {weights.n_embd}+{E} -> {weights.hidden} -> {args.lookahead}x{E} "
          f"(history {weights.history}, {path.stat().st_size / (1 << 20):.1f} MiB)")
    res = None
    if ev is not None:
        budgets = args.budgets or predict.default_budgets(k, E)
        if ev.k != k:
            raise CalibrationError(f"the evaluation routes top-{ev.k}, the calibration top-{k}")
        log(f"evaluating on {ev_src} ...")
        res = M.evaluate(predict.Model.from_counts(counts, args.weighting), ev, weights, args.model, budgets,
                         args.gamma, expert_bytes(args.model, L))
        res |= {"model": str(args.model), "profile": str(path), "weighting": args.weighting, "calibration": source,
                "evaluation": ev_src, "fit_tokens": total}
    return _report(res, args, path, fp, "--holdout 0 and no --eval-corpus")


def register(sub) -> None:
    """``pyvis calibrate predictor`` (``sub``: the subparsers of ``pyvis calibrate``)."""
    s = sub.add_parser("predictor", help="co-activation tables for --moe-predict coact, with held-out accuracy",
                       description="Fit a predictor profile (GGUF sidecar, docs/prediction-calibration.md) from routing traces "
                       "(--trace) or from a text run through llama-perplexity --moe-trace (--corpus): per MoE layer "
                       "l and distance d = 1..W, how often expert j fires at layer l+d with expert i at l, and each "
                       "layer's expert frequency; then print recall@B, precision@B and bytes wasted of the "
                       "co-activation and frequency predictors on held-out routing.")
    add_input_args(s, "profile")
    s.add_argument("-W", "--lookahead", type=int, default=predict.DEFAULT_LOOKAHEAD, metavar="W",
                   help=f"predict layers l+1 .. l+W (default: {predict.DEFAULT_LOOKAHEAD})")
    s.add_argument("--weighting", choices=predict.WEIGHTINGS, default="conditional",
                   help="sum the source experts' rows as conditionals P(j|i) (WiSP) or as raw counts "
                   "(default: conditional)")
    ev = s.add_mutually_exclusive_group()
    ev.add_argument("--eval-trace", action="append", metavar="FNAME",
                    help="evaluate on this routing trace (held-out text); repeat for several")
    ev.add_argument("--eval-corpus", metavar="FNAME", help="evaluate on this text run through llama-perplexity "
                    "(e.g. heldout); -c, --chunks, -t apply")
    ev.add_argument("--holdout", type=float, default=DEFAULT_HOLDOUT, metavar="F",
                    help=f"without --eval-*: fit on the first 1-F of each trace's tokens, evaluate on the rest; "
                    f"0 = no evaluation (default: {DEFAULT_HOLDOUT})")
    s.add_argument("--eval-trace-out", metavar="FNAME", help="--eval-corpus: keep the trace of the run here")
    s.add_argument("--budgets", type=int, nargs="+", metavar="B",
                   help="prediction sizes B (default: k, k+(E-k)/4, k+(E-k)/2)")
    s.add_argument("--gamma", type=float, default=predict.DEFAULT_GAMMA,
                   help=f"decay of the VisMMOE target over distance (default: {predict.DEFAULT_GAMMA})")
    s.add_argument("--json", metavar="FNAME", help="also write the evaluation (every number, per layer) here")
    m = s.add_argument_group("the lookahead MLP (--moe-predict mlp; needs --corpus: hidden states are captured)")
    m.add_argument("--mlp", action="store_true", help="also fit the VisMMOE lookahead MLP into the profile, and "
                   "report it and next-router next to frequency and coact")
    m.add_argument("--mlp-hidden", type=int, default=DEFAULT_MLP_HIDDEN, metavar="H",
                   help=f"bottleneck width (default: {DEFAULT_MLP_HIDDEN})")
    m.add_argument("--mlp-history", type=int, default=DEFAULT_MLP_HISTORY, metavar="N",
                   help=f"routing-history layers in the histogram, layer l included (default: {DEFAULT_MLP_HISTORY})")
    m.add_argument("--mlp-epochs", type=int, default=DEFAULT_MLP_EPOCHS, metavar="N",
                   help=f"training epochs (default: {DEFAULT_MLP_EPOCHS})")
    m.add_argument("--seed", type=int, default=0, help="MLP initialisation and batch order (default: 0)")
    s.set_defaults(fn=_cmd_predictor)
