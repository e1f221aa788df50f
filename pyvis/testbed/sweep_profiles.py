"""Buddy profiles for ``pyvis substitute-sweep``: one per (model, k), calibrated from a ``--moe-trace`` run over
the calibration text (never the held-out text) with ``pyvis calibrate buddies --trace``, cached under
``models/testbed/profiles/`` (or ``$VIS_PROFILE_DIR``)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import quality
from .sweep_grid import Point, _cmdline, _overrides
from .sweep_parse import SweepError


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
