"""One llama-perplexity run of ``pyvis substitute-sweep``: the exact reference (cached), a quality run against it,
a speed run, the staging of a model (or a shadow sidecar) on a tmpfs, and the build id that keys the caches.  The
grid and command lines: :mod:`pyvis.testbed.sweep_grid`; the study: :mod:`pyvis.testbed.substitute_sweep`."""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

from . import quality
from .sweep_grid import Setting, SubConfig, _cmdline, parse_config, run_args
from .sweep_parse import parse_eval_seconds, parse_stats


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


_stage_lock = threading.Lock()


def stage_model(model: str, stage_dir: str | Path) -> str:
    """A copy of the model (or of a shadow sidecar) in stage_dir (a tmpfs such as /dev/shm): file-store reads
    from it are memory copies, with the file store's semantics (background reads of substituted-away experts).
    Reused while its size and mtime match."""
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


def quality_run(setting: Setting, cfg: SubConfig, base: Path, ctx: int, threads: int | None,
                side: str | None, timeout: float | None, store: str = "file") -> dict:
    """One configuration against the exact run's log-probabilities (``side``: the file its flags need, a buddy
    profile or a shadow sidecar, see :meth:`SubConfig.side_key`)."""
    a = run_args(setting, cfg, ctx, threads, store, side)
    a += ["--kl-divergence-base", str(base), "--kl-divergence"]
    out, dt = quality._run(a, timeout)
    r = quality.parse_kld(out)
    r.update(seconds=dt, eval_seconds=parse_eval_seconds(out, dt), command=_cmdline(a))
    r.update(parse_stats(out))
    return r


def speed_run(setting: Setting, cfg: SubConfig, text: str, ctx: int, chunks: int, threads: int | None,
              side: str | None, timeout: float | None) -> dict:
    f, _ = quality._text_file(text)
    a = run_args(setting, cfg, ctx, threads, "file", side) + ["-f", str(f), "--chunks", str(chunks)]
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

