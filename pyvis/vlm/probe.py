"""The affinity probe: the routing of all N tokens of an image in the first MoE layers, before pruning.

* :func:`probe_native` (default) runs the image rows through only the layers up to the last probed MoE
  layer of the session's own context (``llama_vis_set_layer_limit``), captures their routing in memory
  and drops the probe's KV.
* :class:`Shadow` is a second context on the same model (no expert cache, routing trace on) that mirrors
  every decode of the prompt; its probe runs the image through the whole model and reads the prefix
  layers' routing from its trace.

Both give the routing of the full image in the same left context (tests/test_vlm.py checks them against
the unpruned decode).  :func:`read_decode_trace` reads a ``--moe-trace`` file without the native probe's
records, which land in the same trace.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from ..runtime import native
from ..runtime import trace as vtrace
from ..runtime.config import MoeConfig
from ..runtime.settings import MoeParams
from .context import Ctx, VLMError


def _check_rows(layers, ids, n: int) -> np.ndarray:
    for il, x in zip(layers, ids):
        if len(x) != n:
            raise VLMError(f"probe: layer {il} routed {len(x)} rows for {n} image tokens")
    return np.stack(ids).astype(np.int32)


def _file_size(path: str | None) -> int | None:
    return os.path.getsize(path) if path and os.path.exists(path) else None


def probe_native(c: Ctx, moe_layers: list[int], rows: np.ndarray, pos: np.ndarray, n_past: int, non_causal: bool,
                 trace_path: str | None = None) -> tuple[np.ndarray, tuple[int, int] | None]:
    """Routing ids [len(moe_layers), N, k] of the N image ``rows`` in the context ``c``, evaluating only up to the
    last of ``moe_layers``; and, when the context writes a routing trace to ``trace_path``, the byte range of the
    probe's records in it (the trace is flushed after every ubatch)."""
    start = _file_size(trace_path)
    native.moe_capture(c.ptr, True)
    try:
        with native.layer_limit(c.ptr, moe_layers[-1] + 1):
            c.decode_embd(rows, pos, non_causal)
        ids = [native.moe_routes(c.ptr, il) for il in moe_layers]
    finally:
        native.moe_capture(c.ptr, False)
        c.forget_from(n_past)
    span = (start, _file_size(trace_path)) if start is not None else None
    return _check_rows(moe_layers, ids, rows.shape[0]), span


class Shadow:
    """A second context on the session's model (no expert cache, routing trace on) that mirrors the prompt."""

    def __init__(self, model, params, verbose: bool, n_batch: int, n_embd_inp: int):
        fd, self.trace = tempfile.mkstemp(prefix="vis-probe-", suffix=".trace")
        os.close(fd)
        try:
            self.ctx = Ctx(model, params, MoeConfig.of(MoeParams(trace=self.trace)), verbose, n_batch, n_embd_inp)
        except BaseException:
            Path(self.trace).unlink(missing_ok=True)
            raise

    def close(self) -> None:
        self.ctx.close()
        Path(self.trace).unlink(missing_ok=True)

    def probe(self, n_layers: int, rows: np.ndarray, pos: np.ndarray, n_past: int, non_causal: bool) -> np.ndarray:
        """Routing ids [n_layers, N, k] of the N image ``rows`` in the first n_layers MoE layers; the probe's KV
        is dropped after (every image token shares section-0 position n_past under M-RoPE, or occupies
        n_past .. n_past+N-1)."""
        off = Path(self.trace).stat().st_size
        self.ctx.decode_embd(rows, pos, non_causal)
        data = Path(self.trace).read_bytes()
        tr = vtrace.parse(data[:vtrace.HEADER_BYTES] + data[off:], self.trace)   # this probe's records
        self.ctx.forget_from(n_past)
        layers = [int(x) for x in tr.layers()][:n_layers]
        if len(layers) < n_layers:
            raise VLMError(f"the probe saw {len(layers)} MoE layers, {n_layers} requested")
        return _check_rows(layers, [tr.for_layer(il).ids for il in layers], rows.shape[0])


def read_decode_trace(p, path) -> vtrace.Trace:
    """The --moe-trace file of a prepared prompt (:class:`pyvis.vlm.Prepared`) without the native prefix probe's
    records (the probe runs in the same context, so its routing lands in the same trace)."""
    data = Path(path).read_bytes()
    keep, at = [], 0
    for a, b in sorted(im.probe_trace_bytes for im in p.images if im.probe_trace_bytes):
        keep.append(data[at:a])
        at = b
    keep.append(data[at:])
    return vtrace.parse(b"".join(keep), str(path))
