"""Routing analysis of a MoE model on real text (``pyvis report``).

Input: a routing trace (:class:`pyvis.runtime.trace.Trace`, collected by :mod:`pyvis.testbed.collect` or
written by ``--moe-trace``), seen as ``ids [L, T, k]`` (:meth:`~pyvis.runtime.trace.Trace.routes`): the experts
each of ``T`` tokens selected at each of ``L`` MoE layers.  Definitions (``S_l(t)`` = token t's set at layer l):

* **usage skew** per layer, from ``n_e`` = tokens that selected expert e: ``max/mean``, ``min/mean``,
  coefficient of variation ``std/mean``, normalised entropy ``H(n/sum n) / log E`` (1 = uniform),
  and the share of all selections taken by the most used quarter of the experts.
* **co-activation concentration**: for expert i, ``c_ij`` = tokens with i and j both in ``S_l(t)``
  (j != i).  ``n80(i)`` = fewest peers whose ``c_ij`` (largest first) cover >= 80 % of ``sum_j c_ij``.
  Reported: mean over experts per layer; uniform routing gives ``ceil(0.8 (E-1))``.
* **reuse**: mean over t >= 1 of ``|S_l(t) & S_l(t-1)| / k``; random routing gives ``k/E``.
* **cross-layer recall@B** (distance d; the counting and ranking of :mod:`pyvis.runtime.predict`): a table
  ``C[i, j]`` = tokens with i in ``S_l`` and j in ``S_{l+d}`` is counted on the first ``train_frac`` of the tokens; for each later token the B experts
  with the largest ``sum_{i in S_l(t)} C[i, j]`` (ties: lower id) are predicted, and recall is
  ``|pred & S_{l+d}(t)| / k``.  Baseline: the B most used experts of layer l+d in the same train part.
  ``train_frac=None`` fits and evaluates on all tokens.
* **working set** over a window W: mean over t of ``|S_l(t) u ... u S_l(t+W-1)|``.
* **miss curves**: one cache of C expert slots per layer (C = k..E); each token needs its k experts
  resident at once.  Misses are counted per expert (cold misses included), rate = misses / (T k).
  LRU and Belady are :mod:`pyvis.runtime.cachesim`'s, the runtime's rules: LRU evicts the least
  recently touched expert the token does not need (a token touches its hits, then loads its misses,
  in top-k order); Belady evicts the one whose next use is farthest.

The PNG heatmap is written by a small pure-numpy PNG encoder (no matplotlib needed).
"""
from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from ..runtime import predict
from ..runtime.cachesim import belady_misses, lru_misses, token_requests
from ..runtime.predict import default_budgets
from ..runtime.trace import Trace, TraceError, load
from .collect import collect


# --------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------
def _ids(tr: Trace) -> np.ndarray:
    """The trace as [L, T, k] (layers that routed every token)."""
    return tr.routes()[0]


def usage_counts(tr: Trace) -> np.ndarray:
    """[L, E] tokens that selected each expert."""
    ids = _ids(tr)
    return np.stack([np.bincount(x.ravel(), minlength=tr.n_expert) for x in ids]).astype(np.int64)


def usage_skew(tr: Trace) -> dict:
    n = usage_counts(tr).astype(np.float64)
    E = tr.n_expert
    mean = n.mean(1)
    p = n / np.maximum(n.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        H = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    q = max(1, E // 4)
    top = np.sort(n, axis=1)[:, ::-1][:, :q].sum(1) / np.maximum(n.sum(1), 1)
    return {"max_over_mean": (n.max(1) / mean).tolist(), "min_over_mean": (n.min(1) / mean).tolist(),
            "cv": (n.std(1) / mean).tolist(), "entropy_norm": (H / math.log(E) if E > 1 else H * 0 + 1).tolist(),
            "top_quarter_share": top.tolist()}


def coactivation(tr: Trace, l: int) -> np.ndarray:
    """[E, E] tokens in which both experts were selected at layer l (diagonal: usage)."""
    M = _masks(tr, l).astype(np.int64)
    return M.T @ M


def coactivation_n80(tr: Trace, cover: float = 0.8) -> dict:
    per_layer, per_expert = [], []
    for l in range(len(_ids(tr))):
        C = coactivation(tr, l)
        np.fill_diagonal(C, 0)
        vals = []
        for i in range(tr.n_expert):
            row = np.sort(C[i])[::-1]
            tot = row.sum()
            if tot == 0:
                vals.append(float("nan"))
                continue
            vals.append(int(np.searchsorted(np.cumsum(row), cover * tot - 1e-9) + 1))
        per_expert.append(vals)
        v = np.array(vals, float)
        per_layer.append(float(np.nanmean(v)) if np.isfinite(v).any() else float("nan"))
    return {"n80_mean": per_layer, "n80_per_expert": per_expert,
            "uniform_n80": int(math.ceil(cover * (tr.n_expert - 1) - 1e-9))}


def _masks(tr: Trace, l: int) -> np.ndarray:
    """[T, E]: did token t select expert e at layer row l."""
    return predict.masks(_ids(tr)[l], tr.n_expert)


def reuse(tr: Trace) -> list[float]:
    L, T, k = _ids(tr).shape
    out = []
    for l in range(L):
        M = _masks(tr, l)
        if T < 2:
            out.append(float("nan"))
            continue
        out.append(float((M[1:] & M[:-1]).sum(1).mean() / k))
    return out


def cross_layer_recall(tr: Trace, budgets: list[int], distance: int = 1,
                       train_frac: float | None = 0.5) -> dict:
    """recall@B of layer l+d's experts predicted from layer l's via a co-occurrence table (the raw counts of
    :mod:`pyvis.runtime.predict`, ties to the lower id)."""
    ids, (L, T, k), E = _ids(tr), _ids(tr).shape, tr.n_expert
    if train_frac is None:
        tr_sl, ev_sl = slice(0, T), slice(0, T)
    else:
        cut = int(round(T * train_frac))
        tr_sl, ev_sl = slice(0, cut), slice(cut, T)
    rows = np.arange(L)                       # d counts rows of the matrix view (the traced MoE layers)
    c = predict.count([(ids[:, tr_sl], rows)], L, E, distance)
    res = {B: [] for B in budgets}
    base = {B: [] for B in budgets}
    for l in range(L - distance):
        order = predict.rank(predict.coact_scores(predict.masks(ids[l, ev_sl], E), c.coact[distance - 1, l]))
        freq_order = predict.rank(c.use[l + distance][None, :])
        truth = predict.masks(ids[l + distance, ev_sl], E)
        for B in budgets:
            res[B].append(float(predict.hits(predict.top(order, B), truth).mean() / k))
            base[B].append(float(predict.hits(predict.top(freq_order, B), truth).mean() / k))
    return {"distance": distance, "train_frac": train_frac,
            "recall": {str(B): v for B, v in res.items()}, "baseline_frequency": {str(B): v for B, v in base.items()}}


def working_set(tr: Trace, windows: list[int]) -> dict:
    L, T, _ = _ids(tr).shape
    out = {}
    for W in windows:
        vals = []
        for l in range(L):
            M = _masks(tr, l).astype(np.int32)
            if T < W:
                vals.append(float("nan"))
                continue
            cs = np.concatenate([np.zeros((1, tr.n_expert), np.int32), np.cumsum(M, axis=0)])
            win = cs[W:] - cs[:-W]                          # [T-W+1, E] uses in each window
            vals.append(float((win > 0).sum(1).mean()))
        out[str(W)] = vals
    return out


def miss_curves(tr: Trace, sizes: list[int] | None = None, max_tokens: int | None = None) -> dict:
    ids = _ids(tr)
    L, T, k = ids.shape
    E = tr.n_expert
    if sizes is None:
        sizes = default_cache_sizes(k, E)
    sizes = sorted({int(C) for C in sizes if k <= C <= E})
    T = T if max_tokens is None else min(T, max_tokens)
    lru = np.zeros((L, len(sizes)))
    bel = np.zeros((L, len(sizes)))
    cold = np.zeros(L)
    for l in range(L):
        req = token_requests(ids[l, :T])
        for j, C in enumerate(sizes):
            lru[l, j] = lru_misses(req, C) / (T * k)
            bel[l, j] = belady_misses(req, C) / (T * k)
        cold[l] = len(np.unique(ids[l, :T])) / (T * k)
    return {"sizes": sizes, "tokens": T, "lru": lru.tolist(), "belady": bel.tolist(),
            "lru_mean": lru.mean(0).tolist(), "belady_mean": bel.mean(0).tolist(), "cold_mean": float(cold.mean())}


def default_cache_sizes(k: int, E: int, max_points: int = 9) -> list[int]:
    if E - k + 1 <= max_points + 8:
        return list(range(k, E + 1))
    return sorted({int(round(x)) for x in np.linspace(k, E, max_points)})


def analyse(tr: Trace, budgets: list[int] | None = None, distances: tuple[int, ...] = (1, 2),
            windows: tuple[int, ...] = (8, 32, 128), cache_sizes: list[int] | None = None,
            train_frac: float | None = 0.5, miss_tokens: int | None = None) -> dict:
    ids, layers = tr.routes()
    L, T, k = ids.shape
    E = tr.n_expert
    if budgets is None:
        budgets = default_budgets(k, E)
    sk = usage_skew(tr)
    co = coactivation_n80(tr)
    ru = reuse(tr)
    cl = {str(d): cross_layer_recall(tr, budgets, d, train_frac) for d in distances if d < L}
    ws = working_set(tr, list(windows))
    mc = miss_curves(tr, cache_sizes, miss_tokens)
    return {"n_layers": L, "n_tokens": T, "k": k, "n_expert": E,
            "layers": [int(x) for x in layers], "meta": tr.meta,
            "usage": usage_counts(tr).tolist(), "skew": sk, "coactivation": co, "reuse": ru,
            "reuse_random": k / E, "cross_layer": cl, "working_set": ws, "miss": mc}


# --------------------------------------------------------------------------
# text output
# --------------------------------------------------------------------------
def _m(x) -> float:
    a = np.asarray(x, float)
    return float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")


def format_report(r: dict) -> str:
    E, k = r["n_expert"], r["k"]
    out = [f"routing report: {r['n_layers']} MoE layers x {r['n_tokens']} tokens, top-{k} of {E} experts"]
    if r.get("meta", {}).get("model"):
        out.append(f"model: {r['meta']['model']}")
    sk = r["skew"]
    out.append("")
    out.append("## per layer")
    out.append("layer  max/mean  min/mean    cv  entropy  top25%  n80(coact)  reuse  " +
               "  ".join(f"ws@{w}" for w in r["working_set"]))
    for i, il in enumerate(r["layers"]):
        ws = "  ".join(f"{r['working_set'][w][i]:5.1f}" for w in r["working_set"])
        out.append(f"{il:5d}  {sk['max_over_mean'][i]:8.2f}  {sk['min_over_mean'][i]:8.2f}  {sk['cv'][i]:4.2f}  "
                   f"{sk['entropy_norm'][i]:7.3f}  {sk['top_quarter_share'][i]:6.3f}  "
                   f"{r['coactivation']['n80_mean'][i]:10.2f}  {r['reuse'][i]:5.3f}  {ws}")
    ws_mean = "  ".join(f"{_m(v):5.1f}" for v in r["working_set"].values())
    out.append(f" mean  {_m(sk['max_over_mean']):8.2f}  {_m(sk['min_over_mean']):8.2f}  {_m(sk['cv']):4.2f}  "
               f"{_m(sk['entropy_norm']):7.3f}  {_m(sk['top_quarter_share']):6.3f}  "
               f"{_m(r['coactivation']['n80_mean']):10.2f}  {_m(r['reuse']):5.3f}  {ws_mean}")
    out.append(f"(uniform routing: n80 = {r['coactivation']['uniform_n80']}, reuse = {r['reuse_random']:.3f}, "
               f"top25% share = 0.25)")
    out.append("")
    out.append("## cross-layer predictability (co-occurrence table on the first half, recall on the rest)")
    for d, c in r["cross_layer"].items():
        parts = [f"recall@{B} = {_m(v):.3f} (frequency baseline {_m(c['baseline_frequency'][B]):.3f})"
                 for B, v in c["recall"].items()]
        out.append(f"layer l -> l+{d}: " + ", ".join(parts))
    mc = r["miss"]
    out.append("")
    out.append(f"## miss rate per layer cache of C slots (mean over layers, {mc['tokens']} tokens, "
               f"cold misses = {mc['cold_mean']:.4f})")
    out.append("    C    LRU  Belady  LRU/Belady")
    for C, a, b in zip(mc["sizes"], mc["lru_mean"], mc["belady_mean"]):
        ratio = f"{a / b:10.2f}" if b > 0 else "         -"
        out.append(f"{C:5d}  {a:5.3f}  {b:6.3f}  {ratio}")
    return "\n".join(out)


# --------------------------------------------------------------------------
# PNG (pure numpy + zlib)
# --------------------------------------------------------------------------
_CMAP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], float)  # viridis-ish


def colormap(v: np.ndarray) -> np.ndarray:
    v = np.clip(np.nan_to_num(v, nan=0.0), 0, 1) * (len(_CMAP) - 1)
    i = np.minimum(v.astype(int), len(_CMAP) - 2)
    f = (v - i)[..., None]
    return (_CMAP[i] * (1 - f) + _CMAP[i + 1] * f).astype(np.uint8)


def write_png(path: str | Path, rgb: np.ndarray) -> Path:
    """Write an [H, W, 3] uint8 image as PNG."""
    rgb = np.ascontiguousarray(rgb, np.uint8)
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
           chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(png)
    return p


def heatmap(values: np.ndarray, path: str | Path, cell: int = 12, per_row: bool = True) -> Path:
    """values [rows, cols] -> PNG, each row scaled to its own max (per_row) or the global max."""
    v = np.asarray(values, float)
    den = v.max(1, keepdims=True) if per_row else np.array([[v.max()]])
    img = colormap(v / np.maximum(den, 1e-30))
    img = np.repeat(np.repeat(img, cell, axis=0), cell, axis=1)
    return write_png(path, img)


def write_heatmaps(tr: Trace, r: dict, out_dir: str | Path, stem: str) -> list[Path]:
    out = Path(out_dir)
    u = np.asarray(r["usage"], float)
    paths = [heatmap(u, out / f"{stem}-usage.png")]               # rows: layers, cols: experts
    layers = tr.routes()[1]
    mid = len(layers) // 2
    C = coactivation(tr, mid).astype(float)
    np.fill_diagonal(C, 0)
    paths.append(heatmap(C, out / f"{stem}-coact-layer{int(layers[mid])}.png", cell=8, per_row=False))
    return paths


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _progress(msg: str) -> None:
    sys.stderr.write(f"[report] {msg}\n")
    sys.stderr.flush()


def _cmd_report(args) -> int:
    if args.csv:  # a --moe-csv file of a run (pyvis.runtime.telemetry)
        from ..runtime import telemetry
        if args.model or args.trace:
            raise SystemExit("error: pyvis report RUN.csv summarises a --moe-csv file; -m and --trace are for the "
                             "routing report: give one or the other")
        return telemetry.report(args.csv, args.out_dir)
    from . import corpus
    try:
        if args.trace:
            tr = load(args.trace)
        else:
            if not args.model:
                raise TraceError("give -m MODEL (to collect a trace) or --trace FILE")
            text = corpus.load_text(args.file)
            tr = collect(args.model, text.text, n_ctx=args.ctx_size, n_expert_used=args.n_expert_used,
                         n_chunks=args.chunks, n_threads=args.threads, progress=_progress)
            tr.meta["text"] = text.describe() | {"files": text.files}
            if args.trace_out:
                tr.save(args.trace_out)
                _progress(f"trace saved to {args.trace_out}")
        r = analyse(tr, budgets=args.budgets, distances=tuple(args.distance), windows=tuple(args.window),
                    cache_sizes=args.cache_sizes, miss_tokens=args.miss_tokens)
    except (TraceError, corpus.CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(r))
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.name or (Path(args.model).stem + f"-k{tr.k}" if args.model else Path(args.trace).stem)
        (out / f"{stem}.json").write_text(json.dumps(r) + "\n")
        pngs = write_heatmaps(tr, r, out, stem)
        print(f"\nwrote {out / (stem + '.json')}, " + ", ".join(str(p) for p in pngs))
    return 0


def register(sub) -> None:
    s = sub.add_parser("report", help="routing analysis: skew, co-activation, reuse, cross-layer recall, "
                       "working set, LRU vs Belady miss curves",
                       description="Collect a routing trace of a MoE GGUF on text (llama.cpp eval callback) "
                       "or load one (--trace), and report per-layer expert-usage skew, co-activation "
                       "concentration, reuse between consecutive tokens, cross-layer recall@B, working-set "
                       "size, and LRU vs Belady miss curves per cache size. Definitions: "
                       "pyvis/testbed/routing_report.py.")
    s.add_argument("csv", nargs="?", metavar="RUN.csv",
                   help="instead: summarise a --moe-csv file of a run (tok/s, hit rate, MiB read per token, stall "
                   "share, lossy events; docs/telemetry.md); with -o PLOT.png|svg also plot it per generated token")
    s.add_argument("-m", "--model", help="MoE GGUF to trace")
    s.add_argument("--trace", help="read this routing trace (.npz, or a --moe-trace file) instead of running a model")
    s.add_argument("-f", "--file", default="heldout", help="text: heldout (Vim user manual, default), vim-all, "
                   "calibration, or a file")
    s.add_argument("-c", "--ctx-size", type=int, default=256, help="chunk size in tokens (default: 256)")
    s.add_argument("--chunks", type=int, help="use this many chunks, spread over the text (default: all)")
    s.add_argument("-k", "--n-expert-used", type=int, help="override the model's top-k "
                   "(as --override-kv ARCH.expert_used_count=int:K)")
    s.add_argument("-t", "--threads", type=int, help="CPU threads")
    s.add_argument("--trace-out", help="save the collected trace here (.npz)")
    s.add_argument("-o", "--out-dir", help="write NAME.json and PNG heatmaps here (with RUN.csv: the plot file)")
    s.add_argument("--name", help="file stem for --out-dir outputs (default: model stem + -kK)")
    s.add_argument("--budgets", type=int, nargs="+",
                   help="B values for cross-layer recall@B (default: k, k+(E-k)/4, k+(E-k)/2)")
    s.add_argument("--distance", type=int, nargs="+", default=[1, 2], help="layer distances d (default: 1 2)")
    s.add_argument("--window", type=int, nargs="+", default=[8, 32, 128], help="working-set windows "
                   "(default: 8 32 128)")
    s.add_argument("--cache-sizes", type=int, nargs="+", help="cache sizes C for the miss curves "
                   "(default: k..E, or 9 points for large E)")
    s.add_argument("--miss-tokens", type=int, help="only the first N tokens for the miss curves")
    s.set_defaults(fn=_cmd_report)
