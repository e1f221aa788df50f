"""Summaries of a ``pyvis substitute-sweep`` result: the table rows (quality and speed side by side), the
recommendation (fastest configuration under a PPL cost), the markdown table, the Pareto plots, and the merge of
several sweeps.  Precision rules (``prec:...``) add their columns: the share of the misses that ran from shadows,
the shadow MiB read and the background re-reads."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .sweep_precision import is_prec, prec_fields


def _expert_mib(res: dict, model: str, spec: str, n_expert: int) -> float | None:
    """MiB of one full-precision expert of the model (from the shadow's model bytes; the testbed's MoE layers
    are alike), for the background re-reads of a precision rule."""
    from .sweep_precision import parse_prec_config
    try:
        info = (res.get("shadows") or {}).get(f"{model}|{parse_prec_config(spec).type}") or {}
    except Exception:  # noqa: BLE001 - an old or hand-edited result
        return None
    if info.get("model_mib") and info.get("layers") and n_expert:
        return info["model_mib"] / (info["layers"] * n_expert)
    return None


def table_rows(res: dict) -> list[dict]:
    """One row per (setting, config): quality and speed side by side, with the speed-up over off."""
    o = res["options"]
    runs = res["runs"]
    rows = []
    for s in res["settings"]:
        off_speed = None
        for c in res["configs"]:
            sk = (f"{s['key']}|{c}|speed|c{o.get('speed_ctx') or o['ctx']}x{o['speed_chunks']}"
                  f"|t{o.get('speed_threads') or o.get('threads')}"
                  + (f"|r{o['speed_repeats']}" if (o.get("speed_repeats") or 1) > 1 else ""))
            qk = f"{s['key']}|{c}|quality|c{o['ctx']}x{o['chunks']}|{o['text']}"
            q, sp = runs.get(qk, {}), runs.get(sk, {})
            row = {"setting": s["label"], "setting_key": s["key"], "model": Path(s["model"]).stem, "k": s["k"],
                   "fraction": s["fraction"], "slots": s["slots"], "n_expert": s["n_expert"], "config": c}
            if q and "error" not in q:
                row.update(ppl=q["ppl"], ppl_exact=q.get("ppl_exact"), cost_pct=q.get("cost_pct"), kld=q["kld"],
                           kld_p99=q.get("kld_p99"), same_top=q.get("same_top"),
                           ppl_ratio_err=q.get("ppl_ratio_err"))
                sub = q.get("sub") or {}
                cache = q.get("cache") or {}
                if sub.get("missing"):
                    row["subst_share"] = sub["substituted"] / sub["missing"]
                elif c == "off" or sub == {}:
                    row["subst_share"] = 0.0
                row["misses_q"] = cache.get("misses")
                pf = prec_fields(q)
                if pf:
                    row.update(ppl_ratio=q.get("ppl_ratio"), shadow_share=pf["shadow_share"],
                               shadow_use_share=pf["shadow_use_share"],
                               eligible_q=pf["eligible"], shadow_q=pf["shadow"], shadow_pairs_q=pf["shadow_pairs"])
                elif is_prec(c):
                    row["shadow_share"] = 0.0
                row["avoided_share"] = row.get("shadow_share") if is_prec(c) else row.get("subst_share")
            elif q:
                row["quality_error"] = q["error"]
            if sp and "error" not in sp:
                row.update(tok_s=sp["tok_s"], mib_loaded=sp["cache"]["mib_loaded"], stall_ms=sp["cache"]["stall_ms"],
                           misses=sp["cache"]["misses"], hit_pct=sp["cache"]["hit_pct"])
                t = sp.get("tiers") or {}
                row.update(file_reads=t.get("file_reads"), read_wait_s=t.get("read_wait_s"))
                sub = sp.get("sub") or {}
                row.update(bg_wait_ms=sub.get("bg_wait_ms"), bg_reads=sub.get("bg_reads"))
                c_ = sp["cache"]
                if sub.get("bg_reads") is not None and c_["misses"]:
                    # background reads are not in the cache table's bytes; experts of a layer are equal-sized
                    row["bg_mib"] = sub["bg_reads"] * c_["mib_loaded"] / c_["misses"]
                pf = prec_fields(sp)
                if pf:
                    row.update(shadow_share_speed=pf["shadow_share"], shadow_mib=pf["shadow_mib"],
                               mib_saved=pf["mib_saved"], refetch=pf["refetch"],
                               stall_ms=c_["stall_ms"] + (pf["shadow_stall_ms"] or 0.0))
                    em = _expert_mib(res, s["model"], c, s["n_expert"])
                    if em and pf["refetch"] is not None:
                        row["bg_mib"] = pf["refetch"] * em     # re-reads of shadow-served experts, in the background
                if c == "off":
                    off_speed = sp["tok_s"]
            elif sp:
                row["speed_error"] = sp["error"]
            if not q and not sp:
                continue            # this configuration was not run at this setting (merged sweeps)
            rows.append(row)
        for row in rows:
            if row["setting_key"] == s["key"] and off_speed and row.get("tok_s"):
                row["speedup"] = row["tok_s"] / off_speed
    return rows


def recommend(res: dict, max_cost_pct: float = 1.0) -> dict:
    """The fastest configuration whose PPL cost is below max_cost_pct at every measured setting (speed = the
    geometric mean speed-up over off; ties and missing speeds: the larger mean share of misses substituted)."""
    rows = [r for r in res.get("table") or table_rows(res)]
    by_cfg: dict[str, list[dict]] = {}
    for r in rows:
        if r["config"] != "off":
            by_cfg.setdefault(r["config"], []).append(r)
    n_settings = len(res["settings"])
    cands = []
    for c, rs in by_cfg.items():
        if len(rs) < n_settings or any(r.get("cost_pct") is None for r in rs):
            continue
        worst = max(r["cost_pct"] for r in rs)
        # llama-perplexity's uncertainty of PPL(Q)/PPL(base) (paired over the same tokens), in percent
        upper = max(r["cost_pct"] + 2 * 100 * (r.get("ppl_ratio_err") or 0.0) for r in rs)
        sp = [r["speedup"] for r in rs if r.get("speedup")]
        gm = math.exp(sum(math.log(x) for x in sp) / len(sp)) if len(sp) == len(rs) else None
        share = sum(r.get("subst_share") or 0.0 for r in rs) / len(rs)
        avoided = sum(r.get("avoided_share", r.get("subst_share")) or 0.0 for r in rs) / len(rs)
        kld = sum(r.get("kld") or 0.0 for r in rs) / len(rs)
        cands.append({"config": c, "worst_cost_pct": worst, "worst_cost_upper_pct": upper, "speedup_geomean": gm,
                      "subst_share_mean": share, "avoided_share_mean": avoided, "kld_mean": kld,
                      "qualifies": worst < max_cost_pct, "qualifies_2sigma": upper < max_cost_pct})

    def rank(lst):
        return sorted(lst, key=lambda c: (-(c["speedup_geomean"] or 0.0), -c["avoided_share_mean"]))
    ok = rank([c for c in cands if c["qualifies"]])
    ok2 = rank([c for c in cands if c["qualifies_2sigma"]])
    return {"max_cost_pct": max_cost_pct, "best": ok[0]["config"] if ok else None,
            "best_2sigma": ok2[0]["config"] if ok2 else None, "candidates": cands}


def _fmt(v, fmt):
    if v is None:
        return "–"
    out = format(v, fmt)
    if out.startswith("-") and float(out) == 0:     # -0.00 (an exact run's -1e-9): no sign, or +
        out = ("+" if "+" in fmt else "") + out[1:]
    return out


def _pct(v, fmt=".1f"):
    return _fmt(None if v is None else 100 * v, fmt) + " %"


def _cost(r) -> str:
    cost = _fmt(r.get("cost_pct"), "+.2f")
    if r.get("ppl_ratio_err") is not None and r.get("cost_pct") is not None and r["config"] != "off":
        cost += f" ± {100 * r['ppl_ratio_err']:.2f}"
    return cost


def _mib(r) -> str:
    """MiB read before the layers that needed them (full precision, + shadows), + background reads."""
    out = _fmt(r.get("mib_loaded"), ".0f")
    if r.get("shadow_mib") is not None:
        out += f" + {r['shadow_mib']:.0f} sh"
    return out + (f" + {r['bg_mib']:.0f}" if r.get("bg_mib") else "")


def _row_line(r: dict, prec: bool) -> str:
    err = r.get("quality_error") or r.get("speed_error")
    cells = [r["model"], str(r["k"]), f"{r['slots']}/{r['n_expert']}", f"`{r['config']}`", _fmt(r.get("ppl"), ".4f")]
    if prec:
        ratio = r.get("ppl_ratio") if r.get("ppl_ratio") is not None else (
            None if r.get("cost_pct") is None else 1 + r["cost_pct"] / 100)
        cells += [_fmt(ratio, ".4f"), _cost(r), _fmt(r.get("kld"), ".5f"), _pct(r.get("same_top"), ".2f"),
                  _pct(r.get("avoided_share")), _fmt(r.get("tok_s"), ".2f"), _fmt(r.get("speedup"), ".3f"), _mib(r),
                  _fmt(r.get("stall_ms"), ".0f")]
    else:
        cells += [_cost(r), _fmt(r.get("kld"), ".5f"), _pct(r.get("same_top"), ".2f"), _pct(r.get("subst_share")),
                  _fmt(r.get("tok_s"), ".2f"), _fmt(r.get("speedup"), ".3f"), _mib(r), _fmt(r.get("stall_ms"), ".0f"),
                  _fmt(r.get("bg_wait_ms"), ".0f")]
    return "| " + " | ".join(cells) + " |" + (f" failed: {err[:120]}" if err else "")


def format_table(res: dict) -> str:
    o = res["options"]
    rows = res.get("table") or table_rows(res)
    prec = any(is_prec(c) for c in res["configs"])
    head = (f"text `{o['text']}`; quality: `-c {o['ctx']}`" + (f" × {o['chunks']} chunks" if o["chunks"] else "")
            + f" (`-ub 1 -b {o['ctx']}`, `--moe-store {o.get('quality_store', 'file')}`"
            + (f", model staged in `{o['stage']}`" if o.get("stage") else "")
            + f", `-t {o.get('threads') or 'default'}`, {o.get('jobs', 1)} at a time); speed: "
            + f"`-c {o.get('speed_ctx') or o['ctx']}` × {o['speed_chunks']} chunk(s), `--moe-store file` from the "
            + f"original file, `-t {o.get('speed_threads') or o.get('threads') or 'default'}`, alone"
            + (f", median of {o['speed_repeats']} tries" if (o.get("speed_repeats") or 1) > 1 else ""))
    if prec:
        cols = ["model", "k", "slots", "config", "PPL", "PPL ratio", "PPL cost %", "mean KLD", "same top",
                "misses avoided (from shadows / substituted)", "decode tok/s", "speed-up",
                "MiB read: full + shadow (+ background)", "stall ms"]
    else:
        cols = ["model", "k", "slots", "config", "PPL", "PPL cost %", "mean KLD", "same top", "substituted",
                "decode tok/s", "speed-up", "MiB loaded (+ background)", "stall ms", "bg wait ms"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += [_row_line(r, prec) for r in rows]
    rec = res.get("recommendation") or recommend(res)
    lines.append("")
    if rec["best"]:
        b = next(c for c in rec["candidates"] if c["config"] == rec["best"])
        gm = f"{b['speedup_geomean']:.3f}×" if b["speedup_geomean"] else "not measured"
        share = (f"{100 * b.get('avoided_share_mean', 0.0):.1f} % of misses from shadows" if is_prec(b["config"])
                 else f"{100 * b['subst_share_mean']:.1f} % of missing pairs substituted")
        lines.append(f"fastest configuration with PPL cost < {rec['max_cost_pct']:g} % at every setting: "
                     f"`{rec['best']}` (worst cost {b['worst_cost_pct']:+.2f} %, decode speed-up {gm} "
                     f"(geometric mean), {share})")
    else:
        lines.append(f"no configuration has a PPL cost < {rec['max_cost_pct']:g} % at every setting")
    if rec.get("best_2sigma"):
        lines.append(f"with the cost's 2-sigma upper bound < {rec['max_cost_pct']:g} % at every setting: "
                     f"`{rec['best_2sigma']}`")
    elif "best_2sigma" in rec:
        lines.append(f"no configuration's cost is below {rec['max_cost_pct']:g} % at 2 sigma at every setting "
                     "(more tokens would be needed to tell)")
    lines += ["", "| config | worst PPL cost % | worst cost + 2σ % | mean KLD | speed-up (geo. mean) | "
              + ("misses avoided (mean)" if prec else "substituted (mean)") + " |", "|---|---|---|---|---|---|"]
    for c in sorted(rec["candidates"], key=lambda c: -(c["speedup_geomean"] or 0)):
        share = c.get("avoided_share_mean", c["subst_share_mean"]) if prec else c["subst_share_mean"]
        lines.append(f"| `{c['config']}` | {c['worst_cost_pct']:+.2f} | {c['worst_cost_upper_pct']:+.2f} | "
                     f"{c['kld_mean']:.4f} | {_fmt(c['speedup_geomean'], '.3f')} | {100 * share:.1f} % |")
    return "\n".join(lines)


def plot(res: dict, path: Path, x: str = "tok_s", y: str = "cost_pct") -> Path | None:
    """Pareto plot: x = decode tok/s (x='tok_s') or share of the misses substituted or run from shadows
    (x='avoided_share'; 'subst_share' for the substitution share only),
    y = PPL cost % against exact with llama-perplexity's 1-sigma bar (y='cost_pct') or mean KLD (y='kld');
    one panel per setting, one labelled marker per configuration (same colour and marker in every panel),
    the Pareto front dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res.get("table") or table_rows(res)
    settings = res["settings"]
    if not settings:
        return None
    n = len(settings)
    ncol = min(n, 2)
    nrow = (n + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.6 * nrow), squeeze=False)
    markers = "osD^v<>pPhX*"
    colors = plt.get_cmap("tab10").colors
    cfgs = res["configs"]
    for ax, s in zip(axes.flat, settings):
        rs = [r for r in rows if r["setting_key"] == s["key"]]
        pts = []
        for r in rs:
            xv, yv = r.get(x), r.get(y)
            if x == "avoided_share" and xv is None:
                xv = r.get("subst_share")
            if x in ("subst_share", "avoided_share") and xv is not None:
                xv *= 100
            if xv is None or yv is None:
                continue
            ci = cfgs.index(r["config"]) if r["config"] in cfgs else 0
            err = 100 * r["ppl_ratio_err"] if y == "cost_pct" and r.get("ppl_ratio_err") else None
            ax.errorbar([xv], [yv], yerr=None if err is None else [err], fmt=markers[ci % len(markers)],
                        color=colors[ci % len(colors)], ms=7, elinewidth=0.8, capsize=2, alpha=0.9, zorder=3)
            label = r["config"][5:] if is_prec(r["config"]) else r["config"]
            ax.annotate(label, (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7)
            pts.append((xv, yv))
        # Pareto front: more x is better, less y is better
        front = []
        for xv, yv in sorted(pts, key=lambda p: (-p[0], p[1])):
            if not front or yv < front[-1][1]:
                front.append((xv, yv))
        if len(front) > 1:
            fx, fy = zip(*sorted(front))
            ax.plot(fx, fy, "--", color="grey", lw=0.8, zorder=1)
        if y == "cost_pct":
            ax.axhline(1.0, color="red", lw=0.7, ls=":", zorder=0)
        ax.set_title(f"{Path(s['model']).stem}, k={s['k']}, {s['slots']}/{s['n_expert']} slots", fontsize=10)
        ax.set_xlabel("decode tok/s (file store)" if x == "tok_s" else
                      "missing pairs substituted (%)" if x == "subst_share" else
                      "misses avoided: from shadows or substituted (%)")
        ax.set_ylabel("PPL cost vs exact (%)" if y == "cost_pct" else "mean KLD vs exact")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    kinds = {is_prec(c) for c in cfgs if c != "off"}
    what = {frozenset([True]): "shadow experts (--moe-precision)", frozenset([True, False]):
            "substitution and shadow experts"}.get(frozenset(kinds), "substitution on a miss")
    fig.suptitle(what + ": " + ("PPL cost (bars: 1 sigma; red: 1 %)" if y == "cost_pct" else "mean KLD")
                 + " vs " + ("decode speed" if x == "tok_s" else "misses avoided"), fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge(results: list[dict]) -> dict:
    """One result from several sweeps with the same options (settings and configurations in order of first
    appearance; runs, references and profiles joined)."""
    out = {"options": results[0]["options"], "configs": [], "settings": [], "runs": {}, "references": {},
           "profiles": {}, "shadows": {}, "build": results[0].get("build"), "merged_from": len(results)}
    for r in results:
        for c in r["configs"]:
            if c not in out["configs"]:
                out["configs"].append(c)
        for s in r["settings"]:
            if s["key"] not in [x["key"] for x in out["settings"]]:
                out["settings"].append(s)
        for k in ("runs", "references", "profiles", "shadows"):
            out[k].update(r.get(k, {}))
    out["table"] = table_rows(out)
    out["recommendation"] = recommend(out)
    return out


def write_outputs(res: dict, out_dir: Path, name: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    j = out_dir / f"{name}.json"
    j.write_text(json.dumps(res, indent=1) + "\n")
    md = out_dir / f"{name}.md"
    md.write_text(format_table(res) + "\n")
    paths = {"json": str(j), "md": str(md)}
    p = plot(res, out_dir / f"{name}.png", "tok_s")
    if p:
        paths["png"] = str(p)
    p = plot(res, out_dir / f"{name}-avoided.png", "avoided_share")
    if p:
        paths["png_avoided"] = str(p)
    p = plot(res, out_dir / f"{name}-kld.png", "tok_s", "kld")
    if p:
        paths["png_kld"] = str(p)
    return paths
