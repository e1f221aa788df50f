"""Stall time per layer with and without prefetch (``pyvis report-prefetch``; docs/prediction.md).

Input: logs of runs made with ``--moe-stats`` (llama-cli, llama-bench, llama-perplexity; the logs
``scripts/bench_paging.py`` writes per run, e.g. ``ours-0.25-0.log`` and ``next-router-0.25-0.log``).  From
each log's last stats block it reads, per managed layer, the cache table (routed, hits, misses, MiB loaded,
stall ms) and, when prediction was on, the prefetch table (recall, precision, reads ahead used / wasted /
cancelled, wait ms).  It draws the stall per layer of every run on one plot (and the reads ahead used and
wasted per layer below it) and prints one line per run.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

CACHE_ROW = re.compile(r"^vis-moe:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s*$")
PREFETCH_ROW = re.compile(r"^vis-moe:\s+(\d+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%((?:\s+-?[\d.]+){11})\s*$")  # saved ms may be < 0


class ReportError(ValueError):
    """A log without the --moe-stats tables."""


def parse_log(text: str) -> dict:
    """The last stats block of a log: {'layers': [...], 'stall_ms': [...], 'misses': [...], 'prefetch': {...}}."""
    mark = "vis-moe: expert cache stats"
    # the stats go to stderr: in a log of stdout and stderr together the generated text may end on their first line
    lines = [ln[ln.index(mark):] if mark in ln else ln for ln in text.splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith(mark)]
    if not starts:
        raise ReportError("no '--moe-stats' table in the log (run with --moe-stats)")
    block = lines[starts[-1]:]
    out = {"layers": [], "stall_ms": [], "misses": [], "mib_loaded": [], "prefetch": {}}
    in_prefetch = False
    for ln in block[2:]:
        if ln.startswith("vis-moe: prefetch ("):
            in_prefetch = True
            continue
        m = CACHE_ROW.match(ln)
        if m and not in_prefetch:
            out["layers"].append(int(m[1]))
            out["misses"].append(int(m[5]))
            out["mib_loaded"].append(float(m[7]))
            out["stall_ms"].append(float(m[8]))
            continue
        m = PREFETCH_ROW.match(ln)
        if m and in_prefetch:
            c = [float(x) for x in m[5].split()]
            out["prefetch"][int(m[1])] = dict(recall=float(m[3]), prec=float(m[4]), issued=c[0], used=c[1],
                                              wasted=c[2], late=c[3], cancel=c[4], wait_ms=c[7])
    if not out["layers"]:
        raise ReportError("the --moe-stats table has no managed layer")
    return out


def summary(name: str, r: dict) -> str:
    s = f"{name:>14s}: stall {sum(r['stall_ms']):9.1f} ms, misses {sum(r['misses']):7d}, {sum(r['mib_loaded']):9.1f} MiB loaded"
    if r["prefetch"]:
        p = r["prefetch"].values()
        used, wasted, cancel = (sum(x[k] for x in p) for k in ("used", "wasted", "cancel"))
        s += f"; reads ahead used {used:.0f}, wasted {wasted:.0f}, cancelled {cancel:.0f}"
    return s


def plot(runs: dict[str, dict], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with_pf = {n: r for n, r in runs.items() if r["prefetch"]}
    fig, axes = plt.subplots(2 if with_pf else 1, 1, figsize=(10, 7 if with_pf else 4), sharex=True, squeeze=False)
    ax = axes[0][0]
    for name, r in runs.items():
        ax.plot(r["layers"], r["stall_ms"], marker=".", label=f"{name} ({sum(r['stall_ms']) / 1000:.1f} s)")
    ax.set_ylabel("stall (ms, load + wait)")
    ax.set_title(title or "stall per managed layer")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if with_pf:
        ax = axes[1][0]
        width = 0.8 / len(with_pf)
        for i, (name, r) in enumerate(with_pf.items()):
            ls = sorted(r["prefetch"])
            x = [l + (i - (len(with_pf) - 1) / 2) * width for l in ls]
            ax.bar(x, [r["prefetch"][l]["used"] for l in ls], width, label=f"{name}: used")
            ax.bar(x, [-r["prefetch"][l]["wasted"] for l in ls], width, alpha=0.5, label=f"{name}: wasted (down)")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylabel("reads ahead")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cmd(args) -> int:
    runs = {}
    for spec in args.logs:
        name, _, fname = spec.rpartition("=")
        p = Path(fname)
        try:
            runs[name or p.stem] = parse_log(p.read_text(errors="replace"))
        except OSError as e:
            print(f"error: cannot read {p}: {e.strerror}", file=sys.stderr)
            return 1
        except ReportError as e:
            print(f"error: {p}: {e}", file=sys.stderr)
            return 1
    for name, r in runs.items():
        print(summary(name, r))
    if args.out:
        if Path(args.out).resolve() in {Path(s.rpartition("=")[2]).resolve() for s in args.logs}:
            print(f"error: --out {args.out} is one of the input logs; choose another file", file=sys.stderr)
            return 1
        plot(runs, Path(args.out), args.title)
        print(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


def register(sub) -> None:
    s = sub.add_parser("report-prefetch", help="stall per layer with and without prefetch, from --moe-stats logs (PNG)",
                       description=__doc__.split("\n\n")[1])
    s.add_argument("logs", nargs="+", metavar="[NAME=]LOG", help="a run's log (stderr with --moe-stats)")
    s.add_argument("-o", "--out", metavar="PNG", help="plot to write")
    s.add_argument("--title", default="", help="plot title")
    s.add_argument("--json", metavar="FILE", help="also write the parsed tables")
    s.set_defaults(fn=_cmd)
