"""Quality-vs-speed study of substitution on a miss (``pyvis substitute-sweep``; issue #13 item 5).

A *point* is a model at a top-k (``MODEL@K``: a testbed preset or a GGUF path); a *setting* is a point at a
cache size (``--moe-slots S``, S = round(fraction * n_expert)); a *configuration* is a substitution rule
(``off``, ``router``, ``buddy`` with gate options, see :func:`parse_config`).  For every setting:

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
--trace``, cached under ``models/testbed/profiles/``.

Output (``-o DIR``): ``NAME.json`` (every run, written after each one; ``--resume`` reuses its runs),
``NAME.md`` (the table) and ``NAME.png`` (Pareto: decode tok/s against PPL cost, one panel per setting;
``NAME-avoided.png``: share of misses that got a stand-in against PPL cost; ``NAME-kld.png``: tok/s against
mean KLD).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import quality
from .quality import QualityError

DEFAULT_POINTS = ["shared+16@4", "shared+16@8", "shared+64@16"]
DEFAULT_FRACTIONS = [0.5, 0.75]
DEFAULT_CONFIGS = ["off", "router", "router:tae=p25", "router:tae=p50", "router:tae=p75", "router:wrel=1",
                   "router:budget=2", "buddy", "buddy:tae=p50"]
CONFIG_KEYS = {"tae", "margin", "beta", "budget", "weight", "wrel"}
MODES = ("off", "router", "buddy", "auto")


class SweepError(RuntimeError):
    pass


# --------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class SubConfig:
    """One substitution rule. ``spec`` is ``MODE[:KEY=VALUE[,KEY=VALUE...]]``; keys: tae (off, TAU or pN),
    margin, beta, budget, weight (the --moe-sub-weight share) and wrel (the share as a multiple of 1/k:
    ``wrel=1`` substitutes only experts below the token's mean share)."""
    spec: str
    mode: str
    opts: tuple = ()          # ((key, value), ...) in the order given

    @property
    def options(self) -> dict:
        return dict(self.opts)

    def needs_profile(self) -> bool:
        return self.mode == "buddy" or str(self.options.get("tae", "")).startswith("p")

    def flags(self, k: int, profile: str | None = None) -> list[str]:
        """The --moe-sub* flags of this rule at top-k (profile: the buddy profile of the model at k)."""
        o = self.options
        a = ["--moe-substitute", self.mode]
        if self.mode == "off":
            return a
        if self.needs_profile():
            if not profile:
                raise SweepError(f"{self.spec}: needs a buddy profile (--moe-sub-profile)")
            a += ["--moe-sub-profile", str(profile)]
        if "tae" in o:
            a += ["--moe-sub-tae", o["tae"]]
        if "margin" in o:
            a += ["--moe-sub-margin", o["margin"]]
        if "beta" in o:
            a += ["--moe-sub-beta", o["beta"]]
        if "budget" in o:
            a += ["--moe-sub-budget", o["budget"]]
        if "weight" in o:
            a += ["--moe-sub-weight", o["weight"]]
        if "wrel" in o:
            a += ["--moe-sub-weight", _fmt(min(1.0, float(o["wrel"]) / k))]
        return a


def _fmt(x: float) -> str:
    return f"{x:.9g}"


def parse_config(spec: str) -> SubConfig:
    spec = spec.strip()
    mode, _, rest = spec.partition(":")
    if mode not in MODES:
        raise SweepError(f"configuration {spec!r}: mode must be one of {', '.join(MODES)}")
    opts = []
    if rest:
        if mode == "off":
            raise SweepError(f"configuration {spec!r}: off takes no options")
        for item in rest.split(","):
            key, eq, val = item.partition("=")
            key, val = key.strip(), val.strip()
            if not eq or key not in CONFIG_KEYS or not val:
                raise SweepError(f"configuration {spec!r}: expected KEY=VALUE with KEY in "
                                 f"{', '.join(sorted(CONFIG_KEYS))}, got {item!r}")
            if key == "tae":
                if val != "off" and not re.fullmatch(r"p?[0-9]*\.?[0-9]+", val):
                    raise SweepError(f"configuration {spec!r}: tae is off, TAU (0..1) or pN (0..100)")
            elif key == "budget":
                if not val.isdigit() or int(val) < 1:
                    raise SweepError(f"configuration {spec!r}: budget is a positive integer")
            elif key == "margin" and val == "off":
                pass
            else:
                try:
                    float(val)
                except ValueError:
                    raise SweepError(f"configuration {spec!r}: {key} must be a number, got {val!r}") from None
            if "weight" in (key, *(k for k, _ in opts)) and "wrel" in (key, *(k for k, _ in opts)):
                raise SweepError(f"configuration {spec!r}: give weight or wrel, not both")
            opts.append((key, val))
    return SubConfig(spec, mode, tuple(opts))


@dataclass(frozen=True)
class Point:
    name: str        # as given: PRESET or path
    model: str       # GGUF path
    k: int

    @property
    def label(self) -> str:
        return f"{Path(self.model).stem} k={self.k}"


def resolve_model(name: str) -> str:
    """A testbed preset name (models/testbed/NAME.gguf) or a GGUF path."""
    from .moefy import PRESETS, default_out_dir
    if name in PRESETS:
        return str(default_out_dir() / f"{name}.gguf")
    return name


def parse_point(spec: str) -> Point:
    name, at, k = spec.rpartition("@")
    if not at or not name or not k.isdigit() or int(k) < 1:
        raise SweepError(f"point {spec!r}: expected MODEL@K (a preset such as shared+16, or a GGUF path; K >= 1)")
    return Point(name, resolve_model(name), int(k))


@dataclass(frozen=True)
class Setting:
    point: Point
    n_expert: int
    fraction: float
    slots: int

    @property
    def label(self) -> str:
        return f"{self.point.label} S={self.slots}/{self.n_expert}"

    def key(self) -> str:
        return f"{self.point.model}@{self.point.k}/S{self.slots}"


def n_expert_of(model: str) -> int:
    import gguf
    if not Path(model).is_file():
        raise SweepError(f"model not found: {model}")
    r = gguf.GGUFReader(model)
    arch = str(r.fields["general.architecture"].contents())
    f = r.fields.get(f"{arch}.expert_count")
    if f is None:
        raise SweepError(f"{model}: not a MoE ({arch}.expert_count missing)")
    return int(f.contents())


def slots_for(fraction: float, n_expert: int) -> int:
    if not 0 < fraction <= 1:
        raise SweepError(f"cache fraction {fraction}: expected 0 < f <= 1")
    return max(1, int(math.floor(fraction * n_expert + 0.5)))


def expand(points: list[Point], fractions: list[float], n_expert: dict[str, int] | None = None) -> list[Setting]:
    out = []
    for p in points:
        e = (n_expert or {}).get(p.model) or n_expert_of(p.model)
        if p.k > e:
            raise SweepError(f"{p.name}@{p.k}: k is larger than the model's {e} experts")
        for f in fractions:
            out.append(Setting(p, e, f, slots_for(f, e)))
    return out


def check_scored(ctx: int, chunks: int | None) -> None:
    """llama-perplexity prints its KL statistics only over >= 100 scored tokens (the second half of each
    chunk, less the last: ctx - 1 - ctx/2 per chunk)."""
    if chunks is not None and chunks * (ctx - 1 - ctx // 2) < 100:
        raise SweepError(f"-c {ctx} x {chunks} chunks scores {chunks * (ctx - 1 - ctx // 2)} tokens; "
                         "llama-perplexity prints KL statistics only from 100: use more chunks or a larger -c")


# --------------------------------------------------------------------------
# command lines
# --------------------------------------------------------------------------
def _overrides(point: Point) -> list[str]:
    return [f"{quality.model_arch(point.model)}.expert_used_count=int:{point.k}"]


def run_args(setting: Setting, cfg: SubConfig, ctx: int, threads: int | None, store: str,
             profile: str | None = None) -> list[str]:
    """llama-perplexity's arguments for one run, without the text / KL arguments: decode regime (-ub 1,
    -b CTX), --moe-slots S, --moe-store STORE, --moe-stats, and the rule's flags."""
    a = quality._base_args(quality.Config(setting.point.model, _overrides(setting.point)), ctx, threads, ctx)
    a += ["-ub", "1", "--moe-slots", str(setting.slots), "--moe-store", store, "--moe-stats"]
    return a + cfg.flags(setting.point.k, profile)


# --------------------------------------------------------------------------
# parsing --moe-stats and the timing
# --------------------------------------------------------------------------
_N = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
CACHE_FIELDS = ["routed", "hits", "misses", "hit_pct", "mib_loaded", "stall_ms", "passes"]
SUB_FIELDS = ["tokens", "missing", "substituted", "blocked_tae", "blocked_margin", "blocked_beta", "blocked_budget",
              "blocked_weight", "no_candidate", "needed_anyway", "not_eligible", "mib_saved", "bg_reads", "bg_wait_ms"]
# column headings of the substitution table -> field names (a heading not listed keeps its own name)
SUB_HEADINGS = {"tokens": "tokens", "missing": "missing", "subst": "substituted", "tae": "blocked_tae",
                "margin": "blocked_margin", "beta": "blocked_beta", "budget": "blocked_budget",
                "weight": "blocked_weight", "rank": "blocked_rank", "nocand": "no_candidate",
                "anyway": "needed_anyway", "prefil": "not_eligible", "MiB saved": "mib_saved", "bg read": "bg_reads",
                "bg wait": "bg_wait_ms"}


def _num(s: str):
    s = s.rstrip("%")
    return float(s) if any(c in s for c in ".eE") else int(s)


def _sub_columns(heading: str) -> list[str]:
    """Field names of the substitution table from its heading line (after 'layer')."""
    words = heading.split()
    out, i = [], 0
    while i < len(words):
        two = " ".join(words[i:i + 2])
        if two in SUB_HEADINGS:
            out.append(SUB_HEADINGS[two])
            i += 2
        else:
            out.append(SUB_HEADINGS.get(words[i], words[i]))
            i += 1
    return out


def parse_stats(out: str) -> dict:
    """The ``total`` rows of --moe-stats: ``cache`` (the expert cache table) and, with substitution on, ``sub``
    (the outcome table, its columns read from its heading, so a new gate column is picked up); ``tiers`` from
    the ``tiers:`` line when the run read from the file or a host cache.  Raises SweepError when the cache
    table is missing."""
    res: dict = {}
    in_sub = False
    sub_cols = SUB_FIELDS
    for line in out.splitlines():
        if re.match(r"^vis-moe: substitution \(", line):
            in_sub = True
            continue
        m = re.match(r"^vis-moe:\s+layer\s+(tokens\s.*)$", line)
        if m and in_sub:
            sub_cols = _sub_columns(m.group(1))
            continue
        m = re.match(r"^vis-moe:\s+total\s+(.*)$", line)
        if not m:
            continue
        vals = m.group(1).split()
        if not in_sub and len(vals) == len(CACHE_FIELDS) and "cache" not in res:
            res["cache"] = dict(zip(CACHE_FIELDS, map(_num, vals)))
        elif in_sub and len(vals) == len(sub_cols):
            res["sub"] = dict(zip(sub_cols, map(_num, vals)))
        elif in_sub:
            raise SweepError(f"substitution total row has {len(vals)} values for {len(sub_cols)} columns: {line}")
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


# --------------------------------------------------------------------------
# runs
# --------------------------------------------------------------------------
_BUILD_LIBS = ("libllama.so", "libggml-base.so", "libggml-cpu.so", "libllama-common.so", "libllama-perplexity-impl.so")
_build_ids: dict = {}


def build_id() -> str:
    """sha256 (16 hex digits) of the native libraries llama-perplexity runs with: a rebuild with other numerics
    must not reuse a cached reference."""
    from .. import _paths
    d = _paths.lib_dir()
    files = [d / n for n in _BUILD_LIBS if (d / n).is_file()]
    sig = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if sig not in _build_ids:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            h.update(f.resolve().read_bytes())
        _build_ids[sig] = h.hexdigest()[:16]
    return _build_ids[sig]


def _ref_key(setting: Setting, ctx: int, chunks: int | None, text_sha: str) -> str:
    p = Path(setting.point.model)
    st = p.stat()
    return hashlib.sha256(json.dumps([str(p.resolve()), st.st_size, int(st.st_mtime), "sweep-ref", setting.slots,
                                      setting.point.k, ctx, chunks, text_sha, build_id()]).encode()).hexdigest()[:16]


def reference(setting: Setting, text: str, ctx: int, chunks: int | None, threads: int | None,
              timeout: float | None, progress=None, store: str = "file") -> tuple[Path, dict, bool]:
    """The exact run's log-probabilities (cached); returns (file, its result, whether it was cached)."""
    f, sha = quality._text_file(text)
    key = _ref_key(setting, ctx, chunks, sha + store)
    d = quality.kld_dir()
    d.mkdir(parents=True, exist_ok=True)
    stem = f"{Path(setting.point.model).stem}-k{setting.point.k}-S{setting.slots}-ub1-{key}"
    base, meta = d / f"{stem}.kld", d / f"{stem}.json"
    if base.is_file() and meta.is_file():
        return base, json.loads(meta.read_text()), True
    a = run_args(setting, parse_config("off"), ctx, threads, store)
    a += ["-f", str(f), "--kl-divergence-base", str(base) + ".part"]
    if chunks:
        a += ["--chunks", str(chunks)]
    out, dt = quality._run(a, timeout)
    r = quality.parse_ppl(out)
    r.update(seconds=dt, eval_seconds=parse_eval_seconds(out, dt), text_sha256=sha, ctx=ctx, command=_cmdline(a))
    r.update(parse_stats(out))
    os.replace(str(base) + ".part", base)
    meta.write_text(json.dumps(r) + "\n")
    return base, r, False


_stage_lock = __import__("threading").Lock()


def stage_model(model: str, stage_dir: str | Path) -> str:
    """A copy of the model in stage_dir (a tmpfs such as /dev/shm): file-store reads from it are memory
    copies, with the file store's semantics (background reads of substituted-away experts). Reused while
    its size and mtime match."""
    import shutil
    src = Path(model)
    dst = Path(stage_dir) / src.name
    st = src.stat()
    with _stage_lock:      # the quality pool's threads stage the same model at once
        if dst.is_file():
            dt = dst.stat()
            if dt.st_size == st.st_size and int(dt.st_mtime) == int(st.st_mtime):
                return str(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    return str(dst)


def _cmdline(a: list[str]) -> str:
    import shlex
    root = str(Path.cwd()) + "/"
    return " ".join(shlex.quote(x[len(root):] if x.startswith(root) else x) for x in a)


def quality_run(setting: Setting, cfg: SubConfig, base: Path, ctx: int, threads: int | None,
                profile: str | None, timeout: float | None, store: str = "file") -> dict:
    a = run_args(setting, cfg, ctx, threads, store, profile)
    a += ["--kl-divergence-base", str(base), "--kl-divergence"]
    out, dt = quality._run(a, timeout)
    r = quality.parse_kld(out)
    r.update(seconds=dt, eval_seconds=parse_eval_seconds(out, dt), command=_cmdline(a))
    r.update(parse_stats(out))
    return r


def speed_run(setting: Setting, cfg: SubConfig, text: str, ctx: int, chunks: int, threads: int | None,
              profile: str | None, timeout: float | None) -> dict:
    f, _ = quality._text_file(text)
    a = run_args(setting, cfg, ctx, threads, "file", profile) + ["-f", str(f), "--chunks", str(chunks)]
    out, dt = quality._run(a, timeout)
    r = quality.parse_ppl(out)
    ev = parse_eval_seconds(out, dt)
    n_tok = r.get("chunks", chunks) * ctx
    r.update(tokens=n_tok, seconds=dt, eval_seconds=ev, tok_s=n_tok / (ev or dt), command=_cmdline(a),
             loadavg_1min=os.getloadavg()[0])   # other jobs on the cores or the disk skew tok/s
    r.update(parse_stats(out))
    for what in ("io", "cpu"):
        r[f"{what}_pressure_avg10"] = _pressure(what)
    return r


def _pressure(what: str) -> float | None:
    """'some avg10' of /proc/pressure/WHAT (Linux PSI): the share of the last 10 s some task waited for it."""
    try:
        m = re.search(r"some avg10=([0-9.]+)", Path(f"/proc/pressure/{what}").read_text())
        return float(m.group(1)) if m else None
    except OSError:
        return None


# --------------------------------------------------------------------------
# buddy profiles
# --------------------------------------------------------------------------
def profile_dir() -> Path:
    env = os.environ.get("VIS_PROFILE_DIR")
    if env:
        return Path(env)
    from .moefy import default_out_dir
    return default_out_dir() / "profiles"


def ensure_profile(point: Point, calib_text: str, calib_ctx: int, calib_chunks: int, threads: int | None,
                   timeout: float | None, progress=None) -> tuple[Path, dict]:
    """A buddy profile of the model at k from the calibration text (cached); returns (file, info)."""
    from . import corpus
    f, sha = quality._text_file(calib_text)
    try:
        heldout_sha = corpus.heldout().sha256
    except corpus.CorpusError:
        heldout_sha = None
    if sha == heldout_sha:
        raise SweepError("--calib-text is the held-out text: calibrate on other text (default: calibration)")
    p = Path(point.model)
    st = p.stat()
    key = hashlib.sha256(json.dumps([str(p.resolve()), st.st_size, int(st.st_mtime), point.k, sha, calib_ctx,
                                     calib_chunks]).encode()).hexdigest()[:12]
    d = profile_dir()
    d.mkdir(parents=True, exist_ok=True)
    out = d / f"{p.stem}-k{point.k}-{key}.gguf"
    info = d / f"{p.stem}-k{point.k}-{key}.json"
    if out.is_file() and info.is_file():
        return out, json.loads(info.read_text())
    t0 = time.monotonic()
    trace = d / f"{p.stem}-k{point.k}-{key}.trace"
    a = quality._base_args(quality.Config(point.model, _overrides(point)), calib_ctx, threads, None)
    a += ["-f", str(f), "--chunks", str(calib_chunks), "--moe-trace", str(trace), "--no-warmup"]
    if progress:
        progress(f"tracing {point.label} on {calib_text} ({calib_chunks} x {calib_ctx} tokens) for its buddy profile")
    quality._run(a, timeout)
    cal = [sys.executable, "-m", "pyvis", "calibrate", "buddies", "-m", point.model, "--trace", str(trace),
           "--out", str(out)]
    pr = subprocess.run(cal, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    trace.unlink(missing_ok=True)
    if pr.returncode != 0:
        raise SweepError(f"pyvis calibrate buddies failed (exit {pr.returncode}): {' '.join(cal)}\n"
                         + (pr.stdout + pr.stderr)[-2000:])
    meta = {"profile": str(out), "calib_text": calib_text, "calib_sha256": sha, "calib_ctx": calib_ctx,
            "calib_chunks": calib_chunks, "seconds": time.monotonic() - t0,
            "trace_command": _cmdline(a), "calibrate_command": _cmdline(cal[1:]).replace("-m pyvis", "pyvis", 1)}
    meta.update(profile_summary(out))
    info.write_text(json.dumps(meta) + "\n")
    return out, meta


def profile_summary(path: Path) -> dict:
    """TAE spread of a profile (to show whether absolute TAU values can gate anything on this model)."""
    try:
        import numpy as np
        from ..runtime.profile import read_buddy_profile
        pr = read_buddy_profile(path)
        q = np.asarray(pr.tae_quantiles, dtype=np.float64)
        ok = np.isfinite(q).all(axis=1)
        q = q[ok]
        ids = np.asarray(pr.ids)
        lens = (ids >= 0).sum(axis=-1)
        lens = lens[lens > 0]
        return {"tae_p0_min": float(q[:, 0].min()), "tae_p50_mean": float(q[:, 50].mean()),
                "tae_p100_max": float(q[:, 100].max()), "one_minus_tae_p50_mean": float((1 - q[:, 50]).mean()),
                "buddies_mean": float(lens.mean()) if lens.size else 0.0}
    except Exception as e:  # noqa: BLE001 - a summary only
        return {"summary_error": str(e)}


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
    verify_off: bool = False
    timeout: float | None = None


def _row_key(setting: Setting, cfg: SubConfig, kind: str, o: Options) -> str:
    if kind == "speed":
        return f"{setting.key()}|{cfg.spec}|speed|c{o.speed_ctx or o.ctx}x{o.speed_chunks}|t{o.speed_threads or o.threads}"
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
    old = {k: v for k, v in (previous or {}).get("runs", {}).items()
           if "error" not in v and v.get("build") == res["build"]}
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

    # 0. buddy profiles, one per (model, k)
    profiles: dict[str, str | None] = {}
    for s in settings:
        res["settings"].append({"key": s.key(), "label": s.label, "model": s.point.model, "k": s.point.k,
                                "n_expert": s.n_expert, "fraction": s.fraction, "slots": s.slots})
        pk = f"{s.point.model}@{s.point.k}"
        if pk in profiles or not any(c.needs_profile() for c in configs):
            continue
        t0 = time.monotonic()
        try:
            pf, info = ensure_profile(s.point, o.calib_text, o.calib_ctx, o.calib_chunks, o.speed_threads or o.threads,
                                      o.timeout, progress)
            res["profiles"][pk] = info
            profiles[pk] = str(pf)
            say(f"profile of {s.point.label}: {pf} ({time.monotonic() - t0:.1f} s)")
        except (SweepError, QualityError) as e:
            res["profiles"][pk] = {"error": str(e).splitlines()[0]}
            profiles[pk] = None
            say(f"no profile for {s.point.label}: {str(e).splitlines()[0]}")

    def profile_of(s: Setting):
        return profiles.get(f"{s.point.model}@{s.point.k}")

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
            if c.needs_profile() and not profile_of(s):
                raise SweepError(f"{c.spec}: no buddy profile for {s.point.label}")
            if base is None:
                raise SweepError("no exact reference: " + ref.get("error", "?"))
            if c.mode == "off" and not o.verify_off:
                r.update(ppl=ref["ppl"], ppl_err=ref["ppl_err"], kld=0.0, ppl_ratio=1.0, same_top=1.0,
                         from_reference=True, seconds=0.0, cache=ref.get("cache"), sub=ref.get("sub"))
            else:
                r.update(quality_run(staged(s), c, base, o.ctx, o.threads, profile_of(s), o.timeout,
                                     o.quality_store))
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

    # 2. speed runs, one at a time
    if o.speed:
        for s in settings:
            for c in configs:
                key = _row_key(s, c, "speed", o)
                if reuse(key):
                    continue
                t0 = time.monotonic()
                r = {"setting": s.key(), "config": c.spec, "kind": "speed", "build": res["build"]}
                try:
                    if c.needs_profile() and not profile_of(s):
                        raise SweepError(f"{c.spec}: no buddy profile for {s.point.label}")
                    r.update(speed_run(s, c, o.text, o.speed_ctx or o.ctx, o.speed_chunks,
                                       o.speed_threads or o.threads, profile_of(s), o.timeout))
                    what = (f"{s.label} {c.spec} speed: {r['tok_s']:.1f} tok/s, "
                            f"{r['cache']['mib_loaded']:.0f} MiB loaded, stall {r['cache']['stall_ms']:.0f} ms")
                except (SweepError, QualityError) as e:
                    r["error"] = str(e).splitlines()[0]
                    what = f"{s.label} {c.spec} speed FAILED: {r['error'][:200]}"
                done(key, r, what, t0)
    res["seconds"] = time.monotonic() - t_start
    res["table"] = table_rows(res)
    res["recommendation"] = recommend(res)
    save()
    return res


# --------------------------------------------------------------------------
# summary: table, recommendation, plot
# --------------------------------------------------------------------------
def table_rows(res: dict) -> list[dict]:
    """One row per (setting, config): quality and speed side by side, with the speed-up over off."""
    o = res["options"]
    runs = res["runs"]
    rows = []
    for s in res["settings"]:
        off_speed = None
        for c in res["configs"]:
            sk = (f"{s['key']}|{c}|speed|c{o.get('speed_ctx') or o['ctx']}x{o['speed_chunks']}"
                  f"|t{o.get('speed_threads') or o.get('threads')}")
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
        kld = sum(r.get("kld") or 0.0 for r in rs) / len(rs)
        cands.append({"config": c, "worst_cost_pct": worst, "worst_cost_upper_pct": upper, "speedup_geomean": gm,
                      "subst_share_mean": share, "kld_mean": kld, "qualifies": worst < max_cost_pct,
                      "qualifies_2sigma": upper < max_cost_pct})
    def rank(lst):
        return sorted(lst, key=lambda c: (-(c["speedup_geomean"] or 0.0), -c["subst_share_mean"]))
    ok = rank([c for c in cands if c["qualifies"]])
    ok2 = rank([c for c in cands if c["qualifies_2sigma"]])
    return {"max_cost_pct": max_cost_pct, "best": ok[0]["config"] if ok else None,
            "best_2sigma": ok2[0]["config"] if ok2 else None, "candidates": cands}


def format_table(res: dict) -> str:
    o = res["options"]
    rows = res.get("table") or table_rows(res)
    head = (f"text `{o['text']}`; quality: `-c {o['ctx']}`" + (f" × {o['chunks']} chunks" if o["chunks"] else "")
            + f" (`-ub 1 -b {o['ctx']}`, `--moe-store {o.get('quality_store', 'file')}`"
            + (f", model staged in `{o['stage']}`" if o.get("stage") else "")
            + f", `-t {o.get('threads') or 'default'}`, {o.get('jobs', 1)} at a time); speed: "
            + f"`-c {o.get('speed_ctx') or o['ctx']}` × {o['speed_chunks']} chunk(s), `--moe-store file` from the "
            + f"original file, `-t {o.get('speed_threads') or o.get('threads') or 'default'}`, alone")
    lines = [head, "",
             "| model | k | slots | config | PPL | PPL cost % | mean KLD | same top | substituted | decode tok/s | "
             "speed-up | MiB loaded (+ background) | stall ms | bg wait ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    for r in rows:
        cost = f(r.get("cost_pct"), "+.2f")
        if r.get("ppl_ratio_err") is not None and r.get("cost_pct") is not None and r["config"] != "off":
            cost += f" ± {100 * r['ppl_ratio_err']:.2f}"
        err = r.get("quality_error") or r.get("speed_error")
        lines.append(f"| {r['model']} | {r['k']} | {r['slots']}/{r['n_expert']} | `{r['config']}` | {f(r.get('ppl'), '.4f')} "
                     f"| {cost} | {f(r.get('kld'), '.5f')} | "
                     f"{f(None if r.get('same_top') is None else 100 * r['same_top'], '.2f')} % | "
                     f"{f(None if r.get('subst_share') is None else 100 * r['subst_share'], '.1f')} % | "
                     f"{f(r.get('tok_s'), '.2f')} | {f(r.get('speedup'), '.3f')} | {f(r.get('mib_loaded'), '.0f')}"
                     + (f" + {r['bg_mib']:.0f}" if r.get("bg_mib") else "") + " | "
                     + f"{f(r.get('stall_ms'), '.0f')} | {f(r.get('bg_wait_ms'), '.0f')} |"
                     + (f" failed: {err[:120]}" if err else ""))
    rec = res.get("recommendation") or recommend(res)
    lines.append("")
    if rec["best"]:
        b = next(c for c in rec["candidates"] if c["config"] == rec["best"])
        gm = f"{b['speedup_geomean']:.3f}×" if b["speedup_geomean"] else "not measured"
        lines.append(f"fastest configuration with PPL cost < {rec['max_cost_pct']:g} % at every setting: "
                     f"`{rec['best']}` (worst cost {b['worst_cost_pct']:+.2f} %, decode speed-up {gm} "
                     f"(geometric mean), {100 * b['subst_share_mean']:.1f} % of missing pairs substituted)")
    else:
        lines.append(f"no configuration has a PPL cost < {rec['max_cost_pct']:g} % at every setting")
    if rec.get("best_2sigma"):
        lines.append(f"with the cost's 2-sigma upper bound < {rec['max_cost_pct']:g} % at every setting: "
                     f"`{rec['best_2sigma']}`")
    elif "best_2sigma" in rec:
        lines.append(f"no configuration's cost is below {rec['max_cost_pct']:g} % at 2 sigma at every setting "
                     "(more tokens would be needed to tell)")
    lines += ["", "| config | worst PPL cost % | worst cost + 2σ % | mean KLD | speed-up (geo. mean) | "
              "substituted (mean) |", "|---|---|---|---|---|---|"]
    for c in sorted(rec["candidates"], key=lambda c: -(c["speedup_geomean"] or 0)):
        lines.append(f"| `{c['config']}` | {c['worst_cost_pct']:+.2f} | {c['worst_cost_upper_pct']:+.2f} | "
                     f"{c['kld_mean']:.4f} | {f(c['speedup_geomean'], '.3f')} | {100 * c['subst_share_mean']:.1f} % |")
    return "\n".join(lines)


def plot(res: dict, path: Path, x: str = "tok_s", y: str = "cost_pct") -> Path | None:
    """Pareto plot: x = decode tok/s (x='tok_s') or share of missing pairs substituted (x='subst_share'),
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
            if x == "subst_share" and xv is not None:
                xv *= 100
            if xv is None or yv is None:
                continue
            ci = cfgs.index(r["config"]) if r["config"] in cfgs else 0
            err = 100 * r["ppl_ratio_err"] if y == "cost_pct" and r.get("ppl_ratio_err") else None
            ax.errorbar([xv], [yv], yerr=None if err is None else [err], fmt=markers[ci % len(markers)],
                        color=colors[ci % len(colors)], ms=7, elinewidth=0.8, capsize=2, alpha=0.9, zorder=3)
            ax.annotate(r["config"], (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7)
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
        ax.set_xlabel("decode tok/s (file store)" if x == "tok_s" else "missing pairs substituted (%)")
        ax.set_ylabel("PPL cost vs exact (%)" if y == "cost_pct" else "mean KLD vs exact")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("substitution on a miss: " + ("PPL cost (bars: 1 sigma; red: 1 %)" if y == "cost_pct" else "mean KLD")
                 + " vs " + ("decode speed" if x == "tok_s" else "misses substituted"), fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge(results: list[dict]) -> dict:
    """One result from several sweeps with the same options (settings and configurations in order of first
    appearance; runs, references and profiles joined)."""
    out = {"options": results[0]["options"], "configs": [], "settings": [], "runs": {}, "references": {},
           "profiles": {}, "build": results[0].get("build"), "merged_from": len(results)}
    for r in results:
        for c in r["configs"]:
            if c not in out["configs"]:
                out["configs"].append(c)
        for s in r["settings"]:
            if s["key"] not in [x["key"] for x in out["settings"]]:
                out["settings"].append(s)
        for k in ("runs", "references", "profiles"):
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
    p = plot(res, out_dir / f"{name}-avoided.png", "subst_share")
    if p:
        paths["png_avoided"] = str(p)
    p = plot(res, out_dir / f"{name}-kld.png", "tok_s", "kld")
    if p:
        paths["png_kld"] = str(p)
    return paths


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
        o = Options(text=args.file, ctx=args.ctx_size, chunks=args.chunks, speed_ctx=args.speed_ctx,
                    speed_chunks=args.speed_chunks, threads=args.threads, calib_text=args.calib_text,
                    calib_ctx=args.calib_ctx, calib_chunks=args.calib_chunks, quality=not args.no_quality,
                    speed=not args.no_speed, verify_off=args.verify_off, timeout=args.timeout,
                    quality_store=args.quality_store, stage=args.stage, jobs=args.jobs,
                    speed_threads=args.speed_threads)
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
        "substitute-sweep", help="quality vs speed of substitution on a miss (--moe-substitute) on the testbed",
        description="For each MODEL@K x cache fraction x substitution configuration: perplexity, PPL cost and "
        "mean KL divergence against the exact run of the same model at the same k and slot count (decode "
        "regime: llama-perplexity -ub 1 -b CTX, --moe-store model), and decode speed from a shorter pass with "
        "the file store (expert reads from the GGUF with O_DIRECT) with its --moe-stats. Writes NAME.json, "
        "NAME.md and the Pareto plots NAME.png / NAME-avoided.png. Example: pyvis substitute-sweep "
        "--point shared+16@4 --fraction 0.5 0.75 --config off router router:tae=p50 buddy -c 256 --chunks 16 -t 2",
        formatter_class=lambda prog: __import__("argparse").HelpFormatter(prog, max_help_position=32))
    s.add_argument("--point", nargs="+", default=DEFAULT_POINTS, metavar="MODEL@K",
                   help="models and top-k: a testbed preset (models/testbed/PRESET.gguf) or a GGUF path, @ the k "
                   f"(default: {' '.join(DEFAULT_POINTS)})")
    s.add_argument("--fraction", type=float, nargs="+", default=DEFAULT_FRACTIONS, metavar="F",
                   help="cache sizes as fractions of the experts: --moe-slots round(F * n_expert) "
                   f"(default: {' '.join(map(str, DEFAULT_FRACTIONS))})")
    s.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS, metavar="SPEC",
                   help="substitution configurations MODE[:KEY=VALUE,...]; MODE off|router|buddy|auto; keys tae "
                   "(off|TAU|pN), margin, beta, budget, weight (--moe-sub-weight), wrel (--moe-sub-weight = wrel/k); "
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
