"""Does visual-token pruning concentrate expert demand? (``pyvis prune-report``)

For every pruning method and keep ratio, the prompt (text + images) is prefilled through
:mod:`pyvis.vlm` in a fresh session with the routing trace on (and, with ``--moe-slots``, the
expert cache), and the report gives:

* **prefill time** and its stages (encode, score, probe, decode), image tokens kept;
* **expert cache** (``--moe-slots``): prefill hit rate, MiB loaded, passes, load stall;
* **concentration** of the image tokens' routing, per MoE layer, averaged over layers
  (definitions below), for text tokens, the raw (unpruned) image tokens and the kept ones:

  - ``distinct``  experts selected by at least one token of the group;
  - ``n90``       fewest experts that take 90 % of the group's selections (JSON; insensitive to rare tails);
  - ``H``         entropy of the group's expert-usage distribution / log(E) (1 = uniform);
  - ``topk_cov``  share of the group's selections that land on its k most used experts
    (k = the model's top-k; VisMMOE's "top-k expert coverage");
  - ``xl_recall`` inter-layer routing predictability: recall@k of layer l+1's experts from
    layer l's through a co-occurrence table fitted on the same tokens
    (:func:`pyvis.testbed.routing_report.cross_layer_recall`, ``train_frac=None``), mean over l;

* **fidelity proxies**: ``KL`` = KL(unpruned || pruned) of the next-token distribution after the
  prompt (nats), and ``sal_mass`` = saliency mass of the kept tokens / that of the top-|K| most
  salient tokens (1 for saliency-only; methods that compute saliency only);
* ``core_coverage`` (JSON, affinity): share of the prefix experts the salient core already uses;
  near 1 the affinity term cannot discriminate (every token's experts are in E_target);
* PNG heatmaps (expert id x layer) of expert usage share for text / raw image / pruned image
  (VisMMOE Fig. 1-3), one file per method and keep ratio, and a JSON with every number.

Only layers that routed every prompt row are used (upstream computes the last layer for the
output row only). Random-weight fixtures route pseudo-randomly: their numbers check the mechanics,
not the paper's affinity effect.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import prune


# --------------------------------------------------------------------------
# metrics (pure numpy)
# --------------------------------------------------------------------------
def usage(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids [L, N, k] -> [L, E] selection counts."""
    ids = np.asarray(ids)
    return np.stack([np.bincount(ids[l].ravel(), minlength=n_expert) for l in range(ids.shape[0])]) \
        if ids.shape[0] else np.zeros((0, n_expert), np.int64)


def concentration(ids: np.ndarray, n_expert: int) -> dict:
    """Per-layer concentration numbers of one token group's routing ids [L, N, k] (module doc)."""
    ids = np.asarray(ids)
    L = ids.shape[0]
    N = ids.shape[1] if ids.ndim == 3 else 0
    k = ids.shape[2] if ids.ndim == 3 else 0
    keys = ("distinct", "n90", "entropy", "topk_cov", "xl_recall")
    out = {"n_tokens": int(N), **{m: [] for m in keys}}
    if N == 0 or L == 0:
        return out | {"mean": {m: float("nan") for m in keys}}
    u = usage(ids, n_expert).astype(np.float64)
    for l in range(L):
        c = u[l]
        p = c / c.sum()
        nz = p[p > 0]
        out["distinct"].append(int((c > 0).sum()))
        cum = np.cumsum(np.sort(c)[::-1]) / c.sum()
        out["n90"].append(int(np.searchsorted(cum, 0.9 - 1e-12) + 1))
        out["entropy"].append(float(-(nz * np.log(nz)).sum() / math.log(n_expert)) if n_expert > 1 else 1.0)
        out["topk_cov"].append(float(np.sort(c)[::-1][:k].sum() / c.sum()))
    if L >= 2:
        from ..runtime.trace import Trace
        from ..testbed.routing_report import cross_layer_recall
        r = cross_layer_recall(Trace.from_routes(ids.astype(np.int32), n_expert), [k], 1, None)
        out["xl_recall"] = [float(x) for x in r["recall"][str(k)]]
    out["mean"] = {m: (float(np.mean(out[m])) if out[m] else float("nan")) for m in keys}
    return out


# --------------------------------------------------------------------------
# heatmaps
# --------------------------------------------------------------------------
def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def write_heatmaps(panels: dict[str, np.ndarray], path: str | Path, title: str = "",
                   layers: list[int] | None = None) -> Path:
    """panels: name -> [L, E] usage counts; each panel shows the usage share (counts / selections of
    the layer), all on one colour scale. matplotlib when available, else a plain PNG (panels left to
    right in the given order, separated by white columns; rows = layers top-down, columns = experts)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shares = {}
    for name, u in panels.items():
        u = np.asarray(u, np.float64)
        shares[name] = u / np.maximum(u.sum(1, keepdims=True), 1)
    vmax = max((float(s.max()) for s in shares.values() if s.size), default=1.0) or 1.0
    if _have_matplotlib():
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
        n = len(shares)
        L, E = next(iter(shares.values())).shape
        fig, axes = plt.subplots(1, n, figsize=(n * min(6.0, 2.5 + 0.05 * E) + 1.2, min(9.0, max(2.4, 0.22 * L + 1.6))),
                                 squeeze=False, layout="constrained")
        im = None
        names = layers if layers is not None and len(layers) == L else list(range(L))
        step = max(1, L // 12)
        for ax, (name, s) in zip(axes[0], shares.items()):
            im = ax.imshow(s, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("expert id")
            ax.set_ylabel("layer")
            ax.set_yticks(range(0, L, step), [str(names[i]) for i in range(0, L, step)])
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if im is not None:
            fig.colorbar(im, ax=axes[0].tolist(), label="share of the layer's selections")
        if title:
            fig.suptitle(title, fontsize=10)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    from ..testbed.routing_report import colormap, write_png
    cell = 10
    blocks = []
    for i, s in enumerate(shares.values()):
        img = colormap(s / vmax)
        img = np.repeat(np.repeat(img, cell, axis=0), cell, axis=1)
        if i:
            blocks.append(np.full((img.shape[0], cell, 3), 255, np.uint8))
        blocks.append(img)
    return write_png(path, np.concatenate(blocks, axis=1))


# --------------------------------------------------------------------------
# running the configurations
# --------------------------------------------------------------------------
def _split_trace(p, path):
    """Decode trace (without the prefix probe) -> (text ids [L, Nt, k], image ids [L, Ni, k], layers),
    full layers only."""
    from .probe import read_decode_trace
    t = read_decode_trace(p, path)
    ids, layers = t.routes()
    modality = t.for_layer(int(layers[0])).modality       # the same rows, in the same order, in every full layer
    return ids[:, modality == 0], ids[:, modality == 1], [int(il) for il in layers]


def run_config(model, mmproj, prompt, images, method, keep_ratio, *, tmp_dir, moe=None, session_kw=None,
               repeat: int = 1, **prep_kw) -> dict:
    """Prefill once per repeat (fresh session each: cold expert cache) and collect numbers + routing."""
    from .. import vlm
    from ..runtime.config import MoeConfig
    from ..runtime.settings import MoeParams
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tr = tmp_dir / f"{method}-{keep_ratio:g}.trace"
    base = moe or MoeParams()
    prefill, rows = [], None
    prep_kw.setdefault("keep_scores", True)
    for r in range(max(1, repeat)):
        params = MoeParams(base.slots, base.cache_mib, base.pinned_layers, False, str(tr) if r == 0 else None)
        with vlm.Session(model, mmproj, MoeConfig.of(params), **(session_kw or {})) as s:
            p = s.prepare(prompt, images, keep_ratio=keep_ratio, method=method, **prep_kw)
            info = s.info
        prefill.append(p.timings_ms["prefill"])
        if r == 0:
            rows = p
    p = rows
    txt, img, layers = _split_trace(p, tr)
    st = p.moe_stats
    out = {"method": method, "keep_ratio": keep_ratio, "n_image_tokens": p.n_image_tokens,
           "n_image_kept": p.n_image_kept, "n_text_tokens": p.n_text_tokens,
           "prefill_ms": statistics.median(prefill), "prefill_ms_all": prefill, "timings_ms": p.timings_ms,
           "saliency_source": sorted({im.saliency_source for im in p.images if im.saliency_source}),
           "layers": layers, "n_expert": info.n_expert, "k": info.n_expert_used,
           "cache": None if st is None or not st.managed else
           {"hit_rate": st.hit_rate, "n_routed": st.n_routed, "n_hits": st.n_hits, "n_misses": st.n_misses,
            "bytes_loaded": st.bytes_loaded, "load_us": st.load_us, "n_passes": st.n_passes,
            "n_calls": st.n_calls},
           "text": concentration(txt, info.n_expert), "image": concentration(img, info.n_expert),
           "usage_text": usage(txt, info.n_expert).tolist(), "usage_image": usage(img, info.n_expert).tolist()}
    # saliency mass kept, relative to the best possible at this budget (top-|K| by saliency): 1 = saliency-only
    masses = []
    for im in p.images:
        sal = im.scores.get("saliency")
        if sal is not None and im.n_kept:
            best = np.sort(sal)[::-1][:im.n_kept].sum()
            masses.append(float(sal[im.kept].sum() / best) if best > 0 else 1.0)
    out["saliency_mass"] = float(np.mean(masses)) if masses else None
    cov = [im.core_coverage for im in p.images if im.core_coverage is not None]
    out["core_coverage"] = float(np.mean(cov)) if cov else None
    out["alpha"] = prep_kw.get("alpha")
    out["logits"] = p.logits           # dropped before writing JSON
    tr.unlink(missing_ok=True)
    return out


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """KL(softmax(ref) || softmax(logits)) in nats: how far pruning moved the next-token distribution."""
    a = np.asarray(ref_logits, np.float64)
    b = np.asarray(logits, np.float64)
    la = a - a.max() - np.log(np.exp(a - a.max()).sum())
    lb = b - b.max() - np.log(np.exp(b - b.max()).sum())
    return float((np.exp(la) * (la - lb)).sum())


def format_table(results: list[dict]) -> str:
    head = (f"{'method':14s} {'keep':>5s} {'img kept':>9s} {'prefill ms':>10s} {'score ms':>8s} {'probe ms':>8s} "
            f"{'distinct':>8s} {'H':>6s} {'topk_cov':>8s} {'xl_rec':>6s} {'hit%':>6s} {'MiB load':>8s} {'passes':>6s} "
            f"{'KL':>7s} {'sal_mass':>8s}")
    out = [head]
    for r in results:
        c = r["image"]["mean"]
        t = r["timings_ms"]
        cache = r["cache"]
        hit = f"{100 * cache['hit_rate']:6.1f}" if cache else "     -"
        mib = f"{cache['bytes_loaded'] / (1 << 20):8.2f}" if cache else "       -"
        passes = f"{cache['n_passes']:6d}" if cache else "     -"
        name = r["method"] + (f" a={r['alpha']:g}" if r["method"] == "affinity" else "")
        kl = f"{r['kl']:7.4f}" if r.get("kl") is not None else "      -"
        sm = f"{r['saliency_mass']:8.3f}" if r.get("saliency_mass") is not None else "       -"
        out.append(f"{name:14s} {r['keep_ratio']:5.2f} {r['n_image_kept']:4d}/{r['n_image_tokens']:<4d} "
                   f"{r['prefill_ms']:10.1f} {t.get('score', 0):8.2f} {t.get('probe', 0):8.1f} "
                   f"{c['distinct']:8.2f} {c['entropy']:6.3f} {c['topk_cov']:8.3f} {c['xl_recall']:6.3f} "
                   f"{hit} {mib} {passes} {kl} {sm}")
    return "\n".join(out)


def _progress(msg: str) -> None:
    sys.stderr.write(f"[prune-report] {msg}\n")
    sys.stderr.flush()


def _cmd(args) -> int:
    from .. import vlm
    from ..runtime.settings import MoeParams
    from .chat import moe_params
    methods = args.methods
    ratios = sorted(set(args.keep_ratio), reverse=True)
    moe = moe_params(args) or MoeParams()
    session_kw = dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                      n_threads=args.threads, verbose=args.verbose)
    prep = dict(lam=args.lam, prefix_layers=args.prefix_layers, saliency=args.saliency,
                seed=args.seed, chat_template=not args.no_chat_template)
    alphas = args.alpha
    configs = [("none", 1.0, alphas[0])]
    for b in ratios:
        for m in methods:
            if m == "none" or b >= 1.0:
                continue
            for a in (alphas if m == "affinity" else alphas[:1]):
                if m == "affinity" and a > b:
                    continue
                configs.append((m, b, a))
    out_dir = Path(args.out_dir) if args.out_dir else None
    tmp = (out_dir or Path(".")) / ".prune-report-tmp"
    results = []
    t0 = time.monotonic()
    try:
        for i, (m, b, a) in enumerate(configs):
            _progress(f"{i + 1}/{len(configs)} {m} keep {b:g}" + (f" alpha {a:g}" if m == "affinity" else "") +
                      f" ({time.monotonic() - t0:.1f} s)")
            results.append(run_config(args.model, args.mmproj, args.prompt, args.image, m, b, tmp_dir=tmp, moe=moe,
                                      session_kw=session_kw, repeat=args.repeat, alpha=a, **prep))
    except (vlm.VLMError, prune.PruneError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if tmp.is_dir() and not any(tmp.iterdir()):
            tmp.rmdir()
    raw = results[0]
    for r in results:
        r["kl"] = kl_divergence(raw["logits"], r["logits"])
    for r in results:
        del r["logits"]
    info = f"{Path(args.model).name}: top-{raw['k']} of {raw['n_expert']} experts, MoE layers {raw['layers']}"
    print(f"prune report: {info}; {raw['n_text_tokens']} text + {raw['n_image_tokens']} image tokens")
    if moe.slots or moe.cache_mib:
        print(f"expert cache: slots {moe.slots or '-'}, cache MiB {moe.cache_mib or '-'}, "
              f"pinned layers {moe.pinned_layers}, -ub {args.ubatch_size or args.batch_size}")
    print("concentration columns are means over layers for the IMAGE tokens decoded; text tokens: "
          f"distinct {raw['text']['mean']['distinct']:.2f}, H {raw['text']['mean']['entropy']:.3f}, "
          f"topk_cov {raw['text']['mean']['topk_cov']:.3f}")
    print(format_table(results))
    srcs = sorted({s for r in results for s in r["saliency_source"]})
    if srcs:
        print(f"saliency source: {', '.join(srcs)}")
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = args.name or Path(args.model).stem
        pngs = []
        for r in results[1:] or results:
            panels = {f"text ({raw['n_text_tokens']} tok)": np.array(raw["usage_text"]),
                      f"raw image ({raw['n_image_tokens']} tok)": np.array(raw["usage_image"])}
            tag = r["method"] + (f"-a{r['alpha']:g}" if r["method"] == "affinity" and len(args.alpha) > 1 else "")
            if r is not raw:
                panels[f"{tag} keep {r['keep_ratio']:g} ({r['n_image_kept']} tok)"] = np.array(r["usage_image"])
            pngs.append(write_heatmaps(panels, out_dir / f"{stem}-{tag}-{r['keep_ratio']:g}.png",
                                       title=f"{stem}: expert usage share per MoE layer", layers=raw["layers"]))
        (out_dir / f"{stem}.json").write_text(json.dumps({"model": args.model, "mmproj": args.mmproj,
                                                          "images": args.image, "prompt": args.prompt,
                                                          "results": results}) + "\n")
        print(f"\nwrote {out_dir / (stem + '.json')} and {len(pngs)} heatmaps ({pngs[0].name}, ...)"
              + ("" if _have_matplotlib() else " [plain PNG: pip install matplotlib for labelled plots]"))
    return 0


def register(sub) -> None:
    from .chat import add_common_args
    s = sub.add_parser("prune-report", help="visual-token pruning vs expert demand: prefill time, cache hit rate, "
                       "expert concentration and heatmaps per method and keep ratio",
                       description="Prefill a multimodal prompt with every pruning method at every keep ratio "
                       "(fresh session each, routing trace on, expert cache with --moe-slots) and report prefill "
                       "time, scoring and probe cost, prefill cache hit rate and bytes loaded, and the image "
                       "tokens' expert concentration (distinct experts per layer, usage entropy, top-k coverage, "
                       "inter-layer recall). -o writes expert-usage heatmaps (text vs raw image vs pruned "
                       "image) and a JSON. Definitions: pyvis/vlm/report.py, docs/pruning.md.")
    s.add_argument("--image", action="append", required=True, help="image file (repeatable)")
    s.add_argument("-p", "--prompt", default="Describe the image.", help="prompt text")
    s.add_argument("--methods", nargs="+", default=["random", "saliency", "entropy", "affinity"],
                   choices=list(prune.METHODS), help="methods to compare with none (default: all)")
    s.add_argument("--keep-ratio", type=float, nargs="+", default=[0.7, 0.5], help="keep ratios (default: 0.7 0.5;"
                   " 1.0 = the unpruned run, always included)")
    add_common_args(s, many_alphas=True)
    s.add_argument("--repeat", type=int, default=1, help="prefills per configuration; the median time is "
                   "reported (default: 1)")
    s.add_argument("-o", "--out-dir", help="write NAME-METHOD-KEEP.png heatmaps and NAME.json here")
    s.add_argument("--name", help="file stem for -o outputs (default: model stem)")
    s.set_defaults(fn=_cmd)


# --------------------------------------------------------------------------
# synthetic routing with visual-expert affinity (pyvis prune-sim)
# --------------------------------------------------------------------------
def synthetic_routing(n_tokens: int = 600, n_layers: int = 8, n_expert: int = 64, k: int = 8, n_clusters: int = 12,
                      affinity: float = 0.8, pool: int | None = None, seed: int = 0, sal_cluster: float = 0.3):
    """Routing ids [L, N, k] and saliency [N] of N image tokens drawn from latent visual clusters.

    Each cluster prefers its own ``pool`` experts (default 2k) in every layer: a token's k experts are drawn
    without replacement with weights ``affinity / pool`` on its cluster's pool plus ``(1 - affinity) / E``
    on every expert.
    Saliency = ``sal_cluster`` x a per-cluster level + (1 - ``sal_cluster``) x token noise (how much of
    a token's saliency its visual cluster explains). affinity = 0 is routing without structure, like the
    random-weight fixtures; trained VLM routers sit in between (VisMMOE section 2.3)."""
    rng = np.random.default_rng(seed)
    pool = pool or 2 * k
    sizes = rng.dirichlet(np.full(n_clusters, 2.0))
    cluster = rng.choice(n_clusters, n_tokens, p=sizes)
    prefs = rng.random((n_layers, n_clusters, n_expert)).argsort(axis=2)[:, :, :pool]   # [L, C, pool]
    w = np.full((n_layers, n_clusters, n_expert), (1.0 - affinity) / n_expert)
    np.put_along_axis(w, prefs, (1.0 - affinity) / n_expert + affinity / pool, axis=2)
    # k experts without replacement, proportional to w (Gumbel top-k = successive sampling)
    g = -np.log(-np.log(rng.random((n_layers, n_tokens, n_expert))))
    ids = np.argsort(-(np.log(w[:, cluster]) + g), axis=2)[:, :, :k]
    level = rng.random(n_clusters)
    sal = sal_cluster * level[cluster] + (1 - sal_cluster) * rng.random(n_tokens)
    return ids, sal


def simulate(ids: np.ndarray, sal: np.ndarray, n_expert: int, keep_ratio: float = 0.5,
             alphas=(0.05, 0.1, 0.2, 0.3), lam: float = prune.DEFAULT_LAMBDA, prefix_layers: int = 1,
             seed: int = 0) -> list[dict]:
    """Distinct experts per layer after the prefix (what a cold cache must load for the kept tokens) and
    the saliency mass kept, for none / random / saliency / affinity at each alpha."""
    N = ids.shape[1]
    masks = prune.expert_masks(ids[:prefix_layers], n_expert)
    s = prune.normalize(sal)
    configs = [("none", None), ("random", None), ("saliency", None)] + [("affinity", a) for a in alphas
                                                                         if a <= keep_ratio]
    out = []
    for m, a in configs:
        b = 1.0 if m == "none" else keep_ratio
        if m == "affinity":
            keep = prune.affinity_select(s, masks, b, a, lam)
        else:
            keep = prune.select(m, N, b, saliency=s, seed=seed)
        later = ids[prefix_layers:, keep]
        c = concentration(later, n_expert) if later.shape[0] else concentration(ids[:, keep], n_expert)
        best = np.sort(s)[::-1][:len(keep)].sum()
        pre = concentration(ids[:prefix_layers, keep], n_expert)
        out.append({"method": m, "alpha": a, "keep_ratio": b, "n_kept": int(len(keep)),
                    "prefix_distinct": pre["mean"]["distinct"], "later_distinct": c["mean"]["distinct"],
                    "prefix_n90": pre["mean"]["n90"], "later_n90": c["mean"]["n90"],
                    "later_topk_cov": c["mean"]["topk_cov"], "later_xl_recall": c["mean"]["xl_recall"],
                    "saliency_mass": float(s[keep].sum() / best) if best > 0 else 1.0})
    return out


def _cmd_sim(args) -> int:
    print(f"synthetic routing: {args.tokens} image tokens, {args.layers} MoE layers, top-{args.k} of "
          f"{args.experts} experts, {args.clusters} visual clusters (saliency {args.sal_cluster:g} cluster-level); "
          f"keep ratio {args.keep_ratio:g}, "
          f"lambda {args.lam:g}, {args.prefix_layers} prefix layer(s)")
    print(f"{'affinity':>8s} {'method':14s} {'kept':>5s} {'prefix n90':>10s} {'later distinct':>14s} "
          f"{'later n90':>9s} {'later topk_cov':>14s} {'later xl_rec':>12s} {'sal_mass':>8s}")
    for aff in args.affinity:
        rows = []
        for seed in range(args.seeds):
            ids, sal = synthetic_routing(args.tokens, args.layers, args.experts, args.k, args.clusters, aff,
                                         seed=seed, sal_cluster=args.sal_cluster)
            rows.append(simulate(ids, sal, args.experts, args.keep_ratio, args.alpha, args.lam, args.prefix_layers,
                                 seed))
        for j, r in enumerate(rows[0]):
            mean = lambda key: float(np.mean([x[j][key] for x in rows]))  # noqa: E731
            name = r["method"] + (f" a={r['alpha']:g}" if r["alpha"] is not None else "")
            print(f"{aff:8.2f} {name:14s} {r['n_kept']:5d} {mean('prefix_n90'):10.2f} "
                  f"{mean('later_distinct'):14.2f} {mean('later_n90'):9.2f} {mean('later_topk_cov'):14.3f} "
                  f"{mean('later_xl_recall'):12.3f} {mean('saliency_mass'):8.3f}")
    print(f"(means over {args.seeds} seeds; 'later' = MoE layers after the prefix, i.e. the cache-managed ones)")
    return 0


def register_sim(sub) -> None:
    s = sub.add_parser("prune-sim", help="Algorithm 1 vs baselines on synthetic routing with a tunable "
                       "visual-expert affinity (no model needed)",
                       description="Draw image-token routing from latent visual clusters whose tokens prefer the "
                       "same experts in every layer (affinity = share of selections taken from the cluster's "
                       "pool; 0 = structureless, like random-weight fixtures), then compare none, random, "
                       "saliency-only and Algorithm 1 at several alphas: distinct experts per later layer (cold "
                       "cache loads), top-k coverage, inter-layer recall and saliency mass kept.")
    s.add_argument("--affinity", type=float, nargs="+", default=[0.0, 0.5, 0.8], help="routing affinity values "
                   "(default: 0 0.5 0.8)")
    s.add_argument("--tokens", type=int, default=600, help="image tokens (default: 600)")
    s.add_argument("--layers", type=int, default=8, help="MoE layers (default: 8)")
    s.add_argument("--experts", type=int, default=64, help="experts per layer (default: 64)")
    s.add_argument("-k", type=int, default=8, help="top-k (default: 8)")
    s.add_argument("--clusters", type=int, default=12, help="latent visual clusters (default: 12)")
    s.add_argument("--keep-ratio", type=float, default=0.5, help="beta (default: 0.5)")
    s.add_argument("--alpha", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.3],
                   help="alphas (default: 0.02 0.05 0.1 0.2 0.3)")
    s.add_argument("--lambda", dest="lam", type=float, default=prune.DEFAULT_LAMBDA, help="lambda (default: 2)")
    s.add_argument("--prefix-layers", type=int, default=1, help="prefix layers (default: 1)")
    s.add_argument("--seeds", type=int, default=3, help="repetitions (default: 3)")
    s.add_argument("--sal-cluster", type=float, default=0.3, help="share of a token's saliency explained by its "
                   "visual cluster, the rest is token noise (default: 0.3)")
    s.set_defaults(fn=_cmd_sim)
