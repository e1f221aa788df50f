"""The buddy graph of one layer of a substitution profile, as a picture (``pyvis report-buddies``).

Experts sit on a circle in id order.  Each buddy j of expert i is an arrow i -> j whose width and opacity grow
with q(j|i); the first buddy of each list is drawn darker.  Nodes are sized by the share of the layer's tokens
that selected the expert (``expert.freq`` of the profile; equal sizes when the profile has none) and experts
never seen in calibration are drawn hollow.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..runtime import profile as prof


def default_layer(p: prof.BuddyProfile) -> int:
    """The first layer with buddy lists."""
    has = np.flatnonzero((p.ids >= 0).any(axis=(1, 2)))
    if not len(has):
        raise prof.ProfileError(f"{p.path}: no layer has buddy lists")
    return int(has[0])


def draw_buddy_graph(p: prof.BuddyProfile, layer: int, out: str | Path, min_q: float = 0.0, dpi: int = 150) -> Path:
    """Draw layer ``layer``'s buddy graph of profile ``p`` into a PNG; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    if not 0 <= layer < p.n_layer:
        raise prof.ProfileError(f"--layer {layer}: the profile has layers 0..{p.n_layer - 1}")
    ids, q = p.ids[layer], p.q[layer]
    if not (ids >= 0).any():
        raise prof.ProfileError(f"{p.path}: layer {layer} has no buddy lists (no routing in calibration); "
                                f"try --layer {default_layer(p)}")
    E = p.n_expert
    ang = np.pi / 2 - 2 * np.pi * np.arange(E) / E
    xy = np.stack([np.cos(ang), np.sin(ang)], 1)
    freq = p.freq[layer].astype(np.float64) if p.freq is not None else np.ones(E)
    seen = freq > 0 if p.freq is not None else (ids >= 0).any(1)
    fmax = freq.max() if freq.max() > 0 else 1.0
    size = 20 + 380 * np.sqrt(freq / fmax)
    qmax = float(q.max()) if q.max() > 0 else 1.0

    fig, ax = plt.subplots(figsize=(8, 8))
    rad = 0.12 if E > 2 else 0.0
    n_arrows = 0
    for i in range(E):
        for r, j in enumerate(ids[i]):
            if j < 0 or q[i, r] < min_q:
                continue
            s = float(q[i, r]) / qmax
            ax.add_patch(FancyArrowPatch(xy[i], xy[j], arrowstyle="-|>", mutation_scale=6 + 6 * s,
                                         connectionstyle=f"arc3,rad={rad}", lw=0.3 + 2.7 * s, shrinkA=6, shrinkB=6,
                                         color=("#b2182b" if r == 0 else "#2166ac"), alpha=0.15 + 0.75 * s,
                                         zorder=1))
            n_arrows += 1
    ax.scatter(xy[seen, 0], xy[seen, 1], s=size[seen], c="#4d4d4d", zorder=2)
    ax.scatter(xy[~seen, 0], xy[~seen, 1], s=40, facecolors="none", edgecolors="#999999", zorder=2)
    if E <= 64:
        for i in range(E):
            ax.annotate(str(i), 1.1 * xy[i], ha="center", va="center", fontsize=7 if E > 32 else 9)
    sizes = (ids >= 0).sum(1)
    ax.set_title(f"{Path(p.path).name}: layer {layer} buddy graph ({p.arch}, {E} experts, alpha {p.alpha:.2f}, "
                 f"k_max {p.k_max})\nmean |B| {sizes[seen].mean() if seen.any() else 0:.2f}, {n_arrows} arrows "
                 f"i -> j, width and opacity ~ q(j|i) (max {qmax:.3f}), red: first buddy"
                 + (", node area ~ activation share" if p.freq is not None else ""), fontsize=9)
    ax.set_xlim(-1.25, 1.25)
    ax.set_ylim(-1.25, 1.25)
    ax.set_aspect("equal")
    ax.axis("off")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _cmd_report_buddies(args) -> int:
    try:
        p = prof.read_buddy_profile(args.profile, args.model)
        layer = default_layer(p) if args.layer is None else args.layer
        path = draw_buddy_graph(p, layer, args.out, min_q=args.min_q)
    except prof.ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} (layer {layer})")
    return 0


def register(sub) -> None:
    s = sub.add_parser("report-buddies", help="draw one layer's buddy graph of a substitution profile (PNG)",
                       description="Draw the buddy graph of one layer of a profile written by `pyvis calibrate "
                       "buddies`: experts on a circle, an arrow i -> j for each buddy j of i, width and opacity by "
                       "q(j|i), node size by activation share.")
    s.add_argument("profile", metavar="PROFILE", help="profile GGUF (pyvis calibrate buddies --out)")
    s.add_argument("-l", "--layer", type=int, metavar="N", help="layer to draw (default: the first with buddies)")
    s.add_argument("-o", "--out", required=True, metavar="FNAME", help="PNG to write")
    s.add_argument("-m", "--model", metavar="FNAME", help="check the profile against this model first")
    s.add_argument("--min-q", type=float, default=0.0, metavar="Q",
                   help="leave out arrows with q(j|i) below Q (default: 0, all buddies)")
    s.set_defaults(fn=_cmd_report_buddies)
