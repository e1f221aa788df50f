"""Reading llama-perplexity's output for ``pyvis substitute-sweep``: the ``total`` rows of ``--moe-stats``
(the expert cache table, the substitution outcome table and the precision table, columns from their headings),
the ``tiers:`` line, and the evaluation time from llama.cpp's log timestamps."""
from __future__ import annotations

import re


class SweepError(RuntimeError):
    pass


_N = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
CACHE_FIELDS = ["routed", "hits", "misses", "hit_pct", "mib_loaded", "stall_ms", "passes"]
SUB_FIELDS = ["tokens", "missing", "substituted", "blocked_tae", "blocked_margin", "blocked_beta", "blocked_budget",
              "blocked_weight", "no_candidate", "needed_anyway", "not_eligible", "mib_saved", "bg_reads", "bg_wait_ms"]
# column headings of the substitution table -> field names (a heading not listed keeps its own name)
SUB_HEADINGS = {"tokens": "tokens", "missing": "missing", "subst": "substituted", "dropped": "dropped",
                "tae": "blocked_tae",
                "margin": "blocked_margin", "beta": "blocked_beta", "budget": "blocked_budget",
                "weight": "blocked_weight", "rank": "blocked_rank", "nocand": "no_candidate",
                "anyway": "needed_anyway", "prefil": "not_eligible", "MiB saved": "mib_saved", "bg read": "bg_reads",
                "bg wait": "bg_wait_ms"}
# column headings of the precision table (--moe-precision) -> field names
PREC_FIELDS = ["eligible", "shadow", "pairs", "sh_hits", "sh_reads", "mib_read", "mib_saved", "refetch", "stall_ms",
               "vision"]
PREC_HEADINGS = {"eligibl": "eligible", "eligible": "eligible", "shadow": "shadow", "pairs": "pairs",
                 "sh hits": "sh_hits", "sh reads": "sh_reads", "MiB read": "mib_read", "MiB saved": "mib_saved",
                 "refetch": "refetch", "stall ms": "stall_ms", "vision": "vision"}
# the heading line of each --moe-stats table after the cache table; the attach-time log lines
# ("vis-moe: precision (lossy): ...") do not match
_SECTIONS = {"substitution": r"^vis-moe: substitution \(", "prefetch": r"^vis-moe: prefetch \(",
             "precision": r"^vis-moe: precision \(--moe-precision (\w+), (\w+) shadows\)"}


def _num(s: str):
    s = s.rstrip("%")
    return float(s) if any(c in s for c in ".eE") else int(s)


def _sub_columns(heading: str, names: dict = SUB_HEADINGS) -> list[str]:
    """Field names of a table (substitution: SUB_HEADINGS; precision: PREC_HEADINGS) from its heading line
    (after 'layer'); a heading of two words is looked up first."""
    words = heading.split()
    out, i = [], 0
    while i < len(words):
        two = " ".join(words[i:i + 2])
        if two in names:
            out.append(names[two])
            i += 2
        else:
            out.append(names.get(words[i], words[i]))
            i += 1
    return out


def parse_stats(out: str) -> dict:
    """The ``total`` rows of --moe-stats: ``cache`` (the expert cache table); with substitution on, ``sub``
    (the outcome table); with the precision policy on, ``prec`` (the precision table, plus ``mode`` and
    ``type`` from its title and, for auto, the controller's ``share_pct`` and ``switches``).  Columns are read
    from each table's heading, so a new column is picked up.  ``tiers`` from the ``tiers:`` line when the run
    read from the file or a host cache.  Raises SweepError when the cache table is missing or a total row does
    not fit its heading."""
    res: dict = {}
    section = None
    cols = {"substitution": SUB_FIELDS, "precision": PREC_FIELDS}
    prec_head: dict = {}
    for line in out.splitlines():
        hit = next(((name, m) for name, pat in _SECTIONS.items() if (m := re.match(pat, line))), None)
        if hit:
            section = hit[0]
            if section == "precision":
                prec_head = {"mode": hit[1].group(1), "type": hit[1].group(2).upper()}
            continue
        m = re.match(r"^vis-moe:\s+layer\s+(\S.*)$", line)
        if m and section in cols:
            cols[section] = _sub_columns(m.group(1), SUB_HEADINGS if section == "substitution" else PREC_HEADINGS)
            continue
        m = re.match(r"^vis-moe: precision: \d+ of \d+ eligible misses.*controller: share (\d+) %, (\d+) switches",
                     line)
        if m and "prec" in res:
            res["prec"].update(share_pct=int(m.group(1)), switches=int(m.group(2)))
            continue
        m = re.match(r"^vis-moe:\s+total\s+(.*)$", line)
        if not m:
            continue
        vals = m.group(1).split()
        if section is None and len(vals) == len(CACHE_FIELDS) and "cache" not in res:
            res["cache"] = dict(zip(CACHE_FIELDS, map(_num, vals)))
        elif section in cols:
            if len(vals) != len(cols[section]):
                raise SweepError(f"{section} total row has {len(vals)} values for {len(cols[section])} columns: "
                                 f"{line}")
            key = "sub" if section == "substitution" else "prec"
            res[key] = dict(zip(cols[section], map(_num, vals)))
            if key == "prec":
                res[key].update(prec_head)
    if "cache" not in res:
        raise SweepError("no 'vis-moe: total' row of the expert cache stats in the output (was --moe-stats "
                         "given and the cache on?):\n" + out[-1500:])
    t = parse_tiers(out)
    if t:
        res["tiers"] = t
    return res


def parse_tiers(out: str) -> dict | None:
    m = re.search(r"vis-moe: tiers: slab hits (\d+) \| host-cache hits (\d+) \| file reads (\d+) \("
                  + _N + r" MiB payload, " + _N + r" MiB from storage( with O_DIRECT| buffered), "
                  + _N + r" s waiting, " + _N + r" MiB/s\) \| model copies (\d+)", out)
    if not m:
        return None
    return {"slab_hits": int(m.group(1)), "host_hits": int(m.group(2)), "file_reads": int(m.group(3)),
            "mib_read": float(m.group(4)), "mib_storage": float(m.group(5)), "direct_io": "O_DIRECT" in m.group(6),
            "read_wait_s": float(m.group(7)), "read_mib_s": float(m.group(8)), "model_copies": int(m.group(9))}


_TS = r"(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) [A-Z] "


def _ts(m, g: int = 1) -> float:
    return int(m.group(g)) * 60 + int(m.group(g + 1)) + int(m.group(g + 2)) / 1e3 + int(m.group(g + 3)) / 1e6


def parse_eval_seconds(out: str, wall: float | None = None) -> float | None:
    """Seconds of llama-perplexity's evaluation, from its log timestamps (minutes.seconds.ms.us since start):
    from the 'calculating perplexity over' / 'computing over' line to the 'Final estimate' line, or, when
    there is none (--kl-divergence prints no timestamp after its first chunk), to the end of the process
    (``wall``: its wall time).  None without a start line."""
    m = re.search(_TS + r"[^\n]*(?:calculating perplexity over|computing over) \d+ chunks", out)
    if not m:
        return None
    start = _ts(m)
    e = re.search(_TS + r"Final estimate", out)
    if e and _ts(e) > start:
        return _ts(e) - start
    if wall is not None and wall > start:
        return wall - start
    return None
