"""``--moe-csv`` files: read one strictly, summarise it, plot it (``pyvis report RUN.csv [-o PLOT.png|svg]``).

One row per ubatch of a context (src/api/vis-moe-csv.cpp; a generated token is one decode ubatch), the columns of
:data:`COLUMNS`.  docs/telemetry.md describes each one.
"""
from __future__ import annotations

import csv
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .plot import pyplot

# the header the runtime writes (VIS_MOE_CSV_HEADER in src/api/vis-moe-csv.cpp), in order
COLUMNS = ("t_ms", "phase", "tokens", "wall_ms", "compute_ms", "stall_ms", "routed", "hits", "misses", "host_hits",
           "file_reads", "model_copies", "loaded_bytes", "read_bytes", "ahead_used", "ahead_wasted", "ahead_bytes",
           "substituted", "shadow", "rerouted", "dropped", "mode")
_FLOAT = {"t_ms", "wall_ms", "compute_ms", "stall_ms"}
_TEXT = {"phase", "mode"}
MIB = 1 << 20


class TelemetryError(ValueError):
    """A file that is not a --moe-csv file, or a malformed row (the message names the file and the line)."""


@dataclass
class Run:
    path: Path
    rows: list[dict]

    def decode(self) -> list[dict]:
        return [r for r in self.rows if r["phase"] == "decode"]


def load(path: str | Path) -> Run:
    p = Path(path)
    if p.is_dir():
        raise TelemetryError(f"{p} is a directory, not a --moe-csv file")
    try:
        f = p.open(newline="")
    except OSError as e:
        raise TelemetryError(f"cannot read {p}: {e.strerror}") from None
    with f:
        r = csv.reader(f)
        try:
            head = next(r, None)
        except (csv.Error, UnicodeDecodeError):
            head = None
        if head is None or tuple(head) != COLUMNS:
            raise TelemetryError(f"{p} is not a --moe-csv file: its first line is not the header "
                                 f"'{','.join(COLUMNS[:4])},...' (write one with llama-cli --moe-csv FILE)")
        rows = []
        for line in r:
            if len(line) != len(COLUMNS):
                raise TelemetryError(f"{p}:{r.line_num}: {len(line)} fields, expected {len(COLUMNS)}")
            row = {}
            for k, v in zip(COLUMNS, line):
                try:
                    row[k] = v if k in _TEXT else float(v) if k in _FLOAT else int(v)
                except ValueError:
                    raise TelemetryError(f"{p}:{r.line_num}: column {k}: '{v}' is not a number") from None
            if row["phase"] not in ("prompt", "decode"):
                raise TelemetryError(f"{p}:{r.line_num}: phase '{row['phase']}' is neither prompt nor decode")
            rows.append(row)
    return Run(p, rows)


def summary(run: Run) -> dict:
    """Totals of every row, and of the decode rows: tokens, tok/s (decode tokens per second of their ubatches), hit
    rate, MiB read per decode token (on demand and ahead), stall share (of the decode ubatches' wall time), lossy
    events and the modes seen."""
    tot = {k: sum(r[k] for r in run.rows) for k in COLUMNS if k not in _TEXT and k != "t_ms"}
    dec = run.decode()
    d = {k: sum(r[k] for r in dec) for k in COLUMNS if k not in _TEXT and k != "t_ms"}
    lossy = ("substituted", "shadow", "rerouted", "dropped")
    n = d["tokens"]
    return {
        "file": str(run.path),
        "rows": len(run.rows),
        "prompt_tokens": tot["tokens"] - n,
        "decode_tokens": n,
        "decode_tok_s": n / (d["wall_ms"] / 1000) if d["wall_ms"] > 0 else None,
        "hit_rate": d["hits"] / d["routed"] if d["routed"] else None,
        "mib_per_token": (d["read_bytes"] + d["ahead_bytes"]) / MIB / n if n else None,
        "stall_share": d["stall_ms"] / d["wall_ms"] if d["wall_ms"] > 0 else None,
        "lossy_events": sum(tot[k] for k in lossy),
        "lossy_by_kind": {k: tot[k] for k in lossy},
        "modes": sorted({r["mode"] for r in run.rows}),
        "totals": tot,
    }


def _fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def format_summary(s: dict) -> str:
    t = s["totals"]
    lines = [
        f"{s['file']}: {s['rows']} ubatches, {s['prompt_tokens']} prompt tokens, {s['decode_tokens']} generated",
        f"decode: {_fmt(s['decode_tok_s'], '.2f')} tok/s | hit rate "
        f"{_fmt(None if s['hit_rate'] is None else 100 * s['hit_rate'], '.1f')} % | "
        f"{_fmt(s['mib_per_token'], '.2f')} MiB read per token | stall "
        f"{_fmt(None if s['stall_share'] is None else 100 * s['stall_share'], '.1f')} % of the step time",
        f"all ubatches: hits {t['hits']}, misses {t['misses']} (host cache {t['host_hits']}, storage {t['file_reads']}, "
        f"model copy {t['model_copies']}), {t['read_bytes'] / MIB:.2f} MiB read on demand, "
        f"{t['ahead_bytes'] / MIB:.2f} MiB ahead ({t['ahead_used']} used, {t['ahead_wasted']} wasted), "
        f"stall {t['stall_ms']:.1f} ms",
        f"lossy events: {s['lossy_events']} ("
        + ", ".join(f"{k} {v}" for k, v in s["lossy_by_kind"].items()) + ") | mode: " + ", ".join(s["modes"]),
    ]
    return "\n".join(lines)


def plot(run: Run, out: str | Path) -> Path:
    """Per generated token: its step time split into compute and read wait (stacked), and the MiB it read."""
    plt = pyplot("-o")
    dec = run.decode()
    if not dec:
        raise TelemetryError(f"{run.path} has no decode rows to plot (a prompt only)")
    x = list(range(1, len(dec) + 1))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    comp = [r["compute_ms"] for r in dec]
    stall = [r["stall_ms"] for r in dec]
    a1.bar(x, comp, width=1.0, label="compute", color="#4878a8")
    a1.bar(x, stall, width=1.0, bottom=comp, label="read wait (stall)", color="#d9823b")
    a1.set_ylabel("ms per token")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.plot(x, [(r["read_bytes"] + r["ahead_bytes"]) / MIB for r in dec], lw=1.2, label="MiB read")
    a2.set_ylabel("MiB read per token")
    a2.set_xlabel("generated token")
    a2.grid(alpha=0.3)
    modes = ", ".join(sorted({r["mode"] for r in dec}))
    a1.set_title(f"{run.path.name}: {modes}", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(csv_path: str, out: str | None) -> int:
    """``pyvis report RUN.csv [-o PLOT]``: the summary on stdout, the plot in ``out`` (.png or .svg)."""
    if out:
        if Path(out).exists() and Path(csv_path).exists() and os.path.samefile(csv_path, out):
            raise SystemExit(f"error: -o {out} is the input CSV; choose another output file")
        if Path(out).suffix.lower() not in (".png", ".svg"):
            raise SystemExit(f"error: -o {out}: the plot is written as .png or .svg; give one of those names")
    try:
        run = load(csv_path)
        print(format_summary(summary(run)))
        if out:
            print(f"plot: {plot(run, out)}", file=sys.stderr)
    except TelemetryError as e:
        raise SystemExit(f"error: {e}") from None
    return 0
