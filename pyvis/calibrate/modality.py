"""Expert modality bias (``pyvis calibrate modality``): which experts image tokens use, which text tokens use, which
both (docs/modality.md, issue #14 item 3).

Input: routing traces written with ``--moe-trace`` by a run that saw images (``llama-mtmd-cli``, ``pyvis chat``);
each row carries the modality of its ubatch (1: image embeddings, ``ub.embd != nullptr``; 0: text).  Per MoE layer l
and expert e, over the rows of layer l:

* ``image_pairs[l, e]`` / ``text_pairs[l, e]``: (token, slot) pairs of image / text rows whose top-k holds e;
* ``p[r, j] = w[r, j] / sum_j w[r, j]``: a row's gate weights normalised over its k experts (``1/k`` each when they are
  missing: all 0, negative or non-finite), so every row carries mass 1;
* ``image_mass[l, e]`` / ``text_mass[l, e]``: the sum of p over those pairs; ``N_I[l]`` / ``N_T[l]``: image / text
  rows of layer l (= the sums of the masses over e);
* visual share ``v = a_I / (a_I + a_T)`` with ``a_I = image_mass / N_I``, ``a_T = text_mass / N_T``: the expert's
  share of the image routing against its share of the text routing.  Equivalently, with the raw image share
  ``s = I / (I + T)`` and the image share of the data ``pi = N_I / (N_I + N_T)``:
  ``v = (s / pi) / (s / pi + (1 - s) / (1 - pi))``.  An expert used in proportion to the data has v = 0.5, one only
  image tokens use 1, one only text tokens use 0.  Undefined (NaN) where layer l has no image or no text rows, or the
  expert's pairs carried no mass;
* label: ``unused`` (no pair at all), else ``visual`` (v >= --visual-min), ``text`` (v <= --text-max), ``shared``
  (in between), ``unknown`` (v undefined).

The routed ids are used (``Trace.ids``), not the executed ones of a run with substitution on.  The profile format is
:mod:`pyvis.runtime.modality_profile`'s.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..runtime import profile as prof
from ..runtime.modality_profile import KIND as MODALITY_KIND, LABELS, SHARED, TEXT, UNKNOWN, UNUSED, VISUAL, \
    check_thresholds, write_modality_profile
from ..runtime.trace import Trace, TraceError
from .inputs import CalibrationError, check_traces, traces_from_files

DEFAULT_VISUAL_MIN = 0.7
DEFAULT_TEXT_MAX = 0.3
_CHUNK_ROWS = 1 << 16
NO_IMAGE = ("run an image prompt through llama-mtmd-cli with --moe-trace FILE (llama-mtmd-cli -m MODEL --mmproj "
            "MMPROJ --image IMAGE -p PROMPT --moe-trace FILE)")


# --------------------------------------------------------------------------
# the counts and the shares
# --------------------------------------------------------------------------
@dataclass
class ModalityFit:
    n_layer: int
    n_expert: int
    k: int
    image_pairs: np.ndarray     # [L, E] int64
    text_pairs: np.ndarray
    image_mass: np.ndarray      # [L, E] float64
    text_mass: np.ndarray
    image_rows: np.ndarray      # [L] int64
    text_rows: np.ndarray
    n_image_tokens: int
    n_text_tokens: int
    n_unweighted: int           # rows whose gate weights were missing (counted 1/k per pair)
    visual_min: float = DEFAULT_VISUAL_MIN
    text_max: float = DEFAULT_TEXT_MAX
    visual_share: np.ndarray | None = None   # [L, E] float64, NaN where undefined
    label: np.ndarray | None = None          # [L, E] int32, index into LABELS

    def arrays(self) -> dict:
        """The tensors of the profile (:func:`pyvis.runtime.modality_profile.write_modality_profile`)."""
        return {n: getattr(self, n) for n in ("image_pairs", "text_pairs", "image_mass", "text_mass", "image_rows",
                                              "text_rows", "visual_share", "label")}


def row_mass(weights: np.ndarray) -> tuple[np.ndarray, int]:
    """``(p [N, k] float64, rows without usable weights)``: each row's gate weights over its sum; 1/k where the
    weights are missing (all 0, negative or non-finite, as in the last layer's rows of some traces)."""
    w = np.asarray(weights, np.float64)
    s = w.sum(1)
    ok = np.isfinite(w).all(1) & (w >= 0).all(1) & (s > 0)
    p = np.full(w.shape, 1.0 / max(w.shape[1], 1))
    p[ok] = w[ok] / s[ok, None]
    return p, int((~ok).sum())


def count(traces: list[Trace], n_layer: int, n_expert: int,
          progress: Callable[[int, int], None] | None = None) -> ModalityFit:
    """The image and text routing of every layer and expert (no shares yet: :func:`label`)."""
    k = check_traces(traces, n_layer, n_expert)
    L, E = int(n_layer), int(n_expert)
    pairs = np.zeros(2 * L * E, np.int64)       # [text | image] x [L, E]
    mass = np.zeros(2 * L * E, np.float64)
    rows = np.zeros(2 * L, np.int64)
    n_tok = np.zeros(2, np.int64)
    n_unweighted, total, done = 0, sum(len(t) for t in traces), 0
    for t in traces:
        trows = np.zeros(2 * L, np.int64)
        for s in range(0, len(t), _CHUNK_ROWS):
            lay = t.layer[s: s + _CHUNK_ROWS].astype(np.int64)
            img = (t.modality[s: s + _CHUNK_ROWS] != 0).astype(np.int64)
            ids = t.ids[s: s + _CHUNK_ROWS].astype(np.int64)
            p, bad = row_mass(t.weights[s: s + _CHUNK_ROWS])
            key = ((img * L + lay)[:, None] * E + ids).ravel()
            pairs += np.bincount(key, minlength=2 * L * E)
            mass += np.bincount(key, weights=p.ravel(), minlength=2 * L * E)
            trows += np.bincount(img * L + lay, minlength=2 * L)
            n_unweighted += bad
            done += len(lay)
            if progress:
                progress(done, total)
        rows += trows
        n_tok += trows.reshape(2, L).max(1)     # a token is one row of every layer it reached
    pairs, mass, rows = pairs.reshape(2, L, E), mass.reshape(2, L, E), rows.reshape(2, L)
    return ModalityFit(L, E, k, pairs[1], pairs[0], mass[1], mass[0], rows[1], rows[0], int(n_tok[1]), int(n_tok[0]),
                       n_unweighted)


def visual_share(f: ModalityFit) -> np.ndarray:
    """``v [L, E]`` float64 (module docstring); NaN where undefined."""
    with np.errstate(invalid="ignore", divide="ignore"):
        a_i = f.image_mass / f.image_rows[:, None]
        a_t = f.text_mass / f.text_rows[:, None]
        v = a_i / (a_i + a_t)
    v[(f.image_rows == 0) | (f.text_rows == 0)] = np.nan
    return v


def _check_flags(visual_min: float, text_max: float) -> None:
    why = check_thresholds(visual_min, text_max)
    if why:
        raise CalibrationError(why.replace("visual_min", "--visual-min").replace("text_max", "--text-max"))


def label(f: ModalityFit, visual_min: float = DEFAULT_VISUAL_MIN, text_max: float = DEFAULT_TEXT_MAX) -> ModalityFit:
    """Set ``f.visual_share`` and ``f.label`` for these thresholds (0 <= text_max < visual_min <= 1); returns f."""
    _check_flags(visual_min, text_max)
    v = visual_share(f)
    lab = np.full(v.shape, UNKNOWN, np.int32)
    lab[v >= visual_min] = VISUAL
    lab[v <= text_max] = TEXT
    lab[(v > text_max) & (v < visual_min)] = SHARED
    lab[(f.image_pairs + f.text_pairs) == 0] = UNUSED
    f.visual_min, f.text_max, f.visual_share, f.label = float(visual_min), float(text_max), v, lab
    return f


# --------------------------------------------------------------------------
# reports: table, JSON, heat map
# --------------------------------------------------------------------------
def _counts(lab: np.ndarray) -> dict:
    return {name: int((lab == i).sum()) for i, name in enumerate(LABELS)}


def summary(f: ModalityFit, top: int = 5) -> str:
    """Per layer: rows of each modality, experts per label, quantiles of v; then the whole model."""
    pi = f.n_image_tokens / max(f.n_image_tokens + f.n_text_tokens, 1)
    out = [f"modality: top-{f.k} of {f.n_expert} experts, {f.n_layer} layers; {f.n_image_tokens} image tokens, "
           f"{f.n_text_tokens} text tokens (image share {pi:.3f}); visual: v >= {f.visual_min:g}, text: "
           f"v <= {f.text_max:g}",
           "layer  img rows  txt rows  visual  shared  text  unused  unknown  v p10  v p50  v p90"]
    traced = np.flatnonzero(f.image_rows + f.text_rows)
    for il in traced:
        c = _counts(f.label[il])
        v = f.visual_share[il][np.isfinite(f.visual_share[il])]
        q = np.percentile(v, (10, 50, 90)) if len(v) else (np.nan,) * 3
        out.append(f"{il:5d}  {f.image_rows[il]:8d}  {f.text_rows[il]:8d}  {c['visual']:6d}  {c['shared']:6d}  "
                   f"{c['text']:4d}  {c['unused']:6d}  {c['unknown']:7d}  {q[0]:5.3f}  {q[1]:5.3f}  {q[2]:5.3f}")
    c = _counts(f.label[traced])
    labelled = c["visual"] + c["shared"] + c["text"]
    out.append(f"total  {'':8s}  {'':8s}  {c['visual']:6d}  {c['shared']:6d}  {c['text']:4d}  {c['unused']:6d}  "
               f"{c['unknown']:7d}")
    out.append("")
    both = [il for il in traced if f.image_rows[il] and f.text_rows[il]]
    if labelled:
        out.append(f"of {labelled} labelled experts ({len(both)} layers): {c['visual']} visual "
                   f"({100 * c['visual'] / labelled:.1f} %), {c['shared']} shared "
                   f"({100 * c['shared'] / labelled:.1f} %), {c['text']} text ({100 * c['text'] / labelled:.1f} %)")
    half = sorted(set(traced) - set(both))
    if half:
        out.append(f"layers without rows of one modality (their experts are unknown): {', '.join(map(str, half))}"
                   " (upstream computes the last layer for the output rows only)")
    v = np.where(np.isfinite(f.visual_share), f.visual_share, np.nan)
    order = np.argsort(v, axis=None, kind="stable")
    finite = [i for i in order if np.isfinite(v.flat[i])]
    for name, pick in (("most visual", finite[::-1][:top]), ("most textual", finite[:top])):
        if pick:
            out.append(f"{name}: " + ", ".join(f"L{i // f.n_expert}/E{i % f.n_expert} v={v.flat[i]:.3f} "
                                               f"({f.image_pairs.flat[i]}i/{f.text_pairs.flat[i]}t)" for i in pick))
    return "\n".join(out)


def to_json(f: ModalityFit, source: str, model: str | None, profile: str | None) -> dict:
    """Every number of the fit (NaN as null), per layer and expert."""
    from .predictor import _json_safe
    traced = np.flatnonzero(f.image_rows + f.text_rows)
    return _json_safe({
        "model": model, "profile": profile, "source": source, "k": f.k, "n_layer": f.n_layer, "n_expert": f.n_expert,
        "visual_min": f.visual_min, "text_max": f.text_max, "n_image_tokens": f.n_image_tokens,
        "n_text_tokens": f.n_text_tokens, "n_unweighted_rows": f.n_unweighted, "labels": list(LABELS),
        "totals": _counts(f.label[traced]),
        "layers": [{"layer": int(il), "image_rows": int(f.image_rows[il]), "text_rows": int(f.text_rows[il]),
                    **_counts(f.label[il])} for il in traced],
        "image_pairs": f.image_pairs.tolist(), "text_pairs": f.text_pairs.tolist(),
        "image_mass": f.image_mass.tolist(), "text_mass": f.text_mass.tolist(),
        "visual_share": f.visual_share.tolist(), "label": [[LABELS[x] for x in row] for row in f.label]})


def plot(f: ModalityFit, out: str | Path, title: str = "", dpi: int = 150) -> Path:
    """Heat map of v per layer (rows) and expert (columns); grey: unused or undefined."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")
    L, E = f.visual_share.shape
    fig, ax = plt.subplots(figsize=(min(6 + 0.12 * E, 24), min(2.5 + 0.35 * L, 16)))
    im = ax.imshow(np.ma.masked_invalid(f.visual_share), cmap=cmap, vmin=0, vmax=1, aspect="auto",
                   interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    if L <= 64:
        ax.set_yticks(range(L))
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("visual share v (0.5: in proportion)")
    for y in (f.text_max, f.visual_min):
        cb.ax.axhline(y, color="k", lw=1)
    c = _counts(f.label)
    ax.set_title((title + "\n" if title else "") +
                 f"{f.n_image_tokens} image / {f.n_text_tokens} text tokens: {c['visual']} visual (v >= "
                 f"{f.visual_min:g}), {c['shared']} shared, {c['text']} text (v <= {f.text_max:g})\n"
                 "grey: unused, or v undefined (no rows of one modality)", fontsize=8)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _share(s: str) -> float:
    """A threshold: a finite number in [0, 1] (argparse type)."""
    try:
        v = float(s)
    except ValueError:
        v = float("nan")
    if not (np.isfinite(v) and 0 <= v <= 1):
        raise argparse.ArgumentTypeError(f"'{s}' is not a number in [0, 1]")
    return v


def _shape_of(traces: list[Trace], model: str | None) -> tuple[int, int, dict | None]:
    """``(n_layer, n_expert, fingerprint)``: the model's, checked against every trace, or the traces' own."""
    if model is not None:
        fp = prof.model_fingerprint(model)
        for t in traces:
            if t.meta.get("format") == "vis-moe trace v1" and t.n_layer != fp["n_layer"]:
                raise CalibrationError(f"{t.meta.get('source', 'a trace')}: traced a model of {t.n_layer} layers, "
                                       f"{model} has {fp['n_layer']}: a trace of another model")
        return fp["n_layer"], fp["n_expert"], fp
    t0 = traces[0]
    for t in traces[1:]:
        if t.n_expert != t0.n_expert or (t.n_layer and t0.n_layer and t.n_layer != t0.n_layer):
            raise CalibrationError(f"{t.meta.get('source')} ({t.n_layer} layers x {t.n_expert} experts) and "
                                   f"{t0.meta.get('source')} ({t0.n_layer} x {t0.n_expert}) are traces of different "
                                   "models")
    n_layer = max([t.n_layer for t in traces] + [int(t.layer.max()) + 1 for t in traces if len(t)])
    return n_layer, t0.n_expert, None


def _refuse_overwrite(args) -> None:
    """Every trace exists; --json / --plot / --out never replace the model or a trace; --out:
    prof.check_output_path (all before any work)."""
    for p in args.trace:
        if not Path(p).is_file():
            raise CalibrationError(f"trace not found: {p}")
    keep = [Path(p) for p in args.trace + ([args.model] if args.model else []) if Path(p).exists()]
    for flag, p in (("--json", args.json), ("--plot", args.plot), ("--out", args.out)):
        if p and any(Path(p).exists() and Path(p).resolve() == k.resolve() for k in keep):
            raise CalibrationError(f"{flag} {p}: refusing to overwrite an input (the model or a trace)")
    if args.out:
        if not args.model:
            raise CalibrationError("--out needs -m MODEL: a profile carries the fingerprint of the model it is for")
        prof.check_output_path(Path(args.out), Path(args.model), MODALITY_KIND, args.force)


def _cmd_modality(args) -> int:
    from ..progress import Progress
    try:
        _check_flags(args.visual_min, args.text_max)      # before any work
        if args.model and not Path(args.model).is_file():
            raise CalibrationError(f"model not found: {args.model}")
        _refuse_overwrite(args)
        traces, source = traces_from_files(args.trace, progress=Progress("reading", 1))
        L, E, fp = _shape_of(traces, args.model)
        r = count(traces, L, E, progress=Progress("modality", 1, unit="rows", scale=1))
        if not (r.image_rows.any() or r.text_rows.any()):
            raise CalibrationError(f"{', '.join(args.trace)}: the traces hold no routing records")
        if not r.n_image_tokens:
            raise CalibrationError(f"{', '.join(args.trace)}: no image tokens (every ubatch was text); {NO_IMAGE}")
        if not r.n_text_tokens:
            raise CalibrationError(f"{', '.join(args.trace)}: no text tokens (every ubatch was an image): v compares "
                                   "image routing with text routing; trace a prompt with text as well")
        label(r, args.visual_min, args.text_max)
        path = None
        if args.out:
            path = write_modality_profile(args.out, fp, r.arrays(), r.visual_min, r.text_max, r.n_image_tokens,
                                          r.n_text_tokens, r.k, source, model_path=args.model,
                                          force=args.force)
        if args.json:
            Path(args.json).write_text(json.dumps(to_json(r, source, args.model, path and str(path))) + "\n")
        if args.plot:
            plot(r, args.plot, Path(args.model).name if args.model else ", ".join(Path(p).name for p in args.trace))
    except (CalibrationError, prof.ProfileError, TraceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(r))
    if r.n_unweighted:
        print(f"({r.n_unweighted} rows had no gate weights: each of their pairs counted 1/{r.k})")
    for p in (args.json, args.plot):
        if p:
            print(f"wrote {p}")
    if path:
        print(f"wrote {path} (router hash {fp['router_hash']:016x})")
    return 0


def register(sub) -> None:
    """``pyvis calibrate modality`` (``sub``: the subparsers of ``pyvis calibrate``)."""
    s = sub.add_parser("modality", help="expert modality bias (visual / text / shared) from image-prompt traces",
                       description="Count, per MoE layer and expert, the routing of image (embedding) tokens and of "
                       "text tokens in routing traces written with --moe-trace by an image prompt (llama-mtmd-cli), "
                       "compute each expert's visual share v (0 = text only, 0.5 = used in proportion to the data, "
                       "1 = image only) and label it visual, text, shared or unused (docs/modality.md). With -m and "
                       "--out, write a modality profile (GGUF sidecar tied to the model).")
    s.add_argument("--trace", action="append", required=True, metavar="FNAME",
                   help="routing trace (--moe-trace file or .npz) with image and text tokens; repeat for several")
    s.add_argument("-m", "--model", metavar="FNAME", help="MoE GGUF the traces are of: checked against them, "
                   "and needed for --out (default: none, the traces' own shape)")
    s.add_argument("-o", "--out", metavar="FNAME", help="modality profile to write; needs -m (never a model or "
                   "another existing file that is not a profile)")
    s.add_argument("--visual-min", type=_share, default=DEFAULT_VISUAL_MIN, metavar="V",
                   help=f"label an expert visual when v >= V (default: {DEFAULT_VISUAL_MIN})")
    s.add_argument("--text-max", type=_share, default=DEFAULT_TEXT_MAX, metavar="V",
                   help=f"label an expert text when v <= V; below --visual-min (default: {DEFAULT_TEXT_MAX})")
    s.add_argument("--force", action="store_true", help="replace an existing vis sidecar of another kind at --out")
    s.add_argument("--json", metavar="FNAME", help="also write every count, share and label here")
    s.add_argument("--plot", metavar="FNAME", help="also draw v per layer x expert as a heat map (PNG)")
    s.set_defaults(fn=_cmd_modality)
