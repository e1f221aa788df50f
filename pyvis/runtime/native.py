"""The friendly layer over the fork's C API (:mod:`pyvis.runtime.capi`): dataclasses, VisError, numpy.

``from pyvis import _native`` is this module.  Settings (the --moe-* flags) live in
:mod:`pyvis.runtime.settings`.

Errors: a failing C call raises :class:`VisError` with the message of that very call (the C side clears
``llama_vis_last_error()`` at the start of every fallible call).  Integers are checked against their C type
in Python, so a value that would wrap around (``2**32``) is an error naming the argument, never a silent
different value.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
from dataclasses import dataclass, fields

import numpy as np

from . import capi
from .capi import llama_cpp  # noqa: F401  (re-exported: the llama_cpp bound to our build)

__all__ = ["llama_cpp", "VisError", "last_error", "c_int", "version", "upstream_commit", "system_info_fragment",
           "MoeInfo", "moe_info", "MoeStats", "moe_stats", "moe_reset_stats", "moe_n_managed", "moe_failures", "moe_print_stats",
           "io_stats", "overlap_stats", "mem_probe", "plan", "estimate_reserve", "context_reserve", "Flag", "flags",
           "saliency_enable", "mtmd_saliency", "set_layer_limit", "get_layer_limit", "layer_limit", "moe_capture",
           "moe_capture_reset", "moe_routes"]


from .native_base import (VisError, _check, _ctx_ptr, _mtmd_ptr, _ptr, _struct_dict, c_int,  # noqa: F401
                          fill_struct, last_error)


# ---------------------------------------------------------------------------
# the build and a model's MoE shape
# ---------------------------------------------------------------------------
def props() -> dict | None:
    """llama_vis_moe_props_json: the mode ("exact" or "lossy", the lossy mechanisms) and the memory plan of the context
    created last on this thread; None when there was none."""
    return json.loads(capi.llama_vis_moe_props_json().decode())


def version() -> str:
    return capi.llama_vis_version().decode()


def upstream_commit() -> str:
    return capi.llama_vis_upstream_commit().decode()


def system_info_fragment() -> str:
    return capi.llama_vis_system_info().decode()


@dataclass(frozen=True)
class MoeInfo:
    n_layer: int
    n_moe_layers: int
    first_moe_layer: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    has_shared_exp: bool
    has_exp_bias: bool
    has_gate_up_exp: bool
    expert_bytes: int
    routed_bytes: int


def moe_info(model) -> MoeInfo:
    """MoE shape of a loaded model (a `llama_cpp.Llama`, an _internals.LlamaModel, or a raw llama_model pointer)."""
    info = capi.llama_vis_moe_info()
    if capi.llama_vis_model_moe_info(_ptr(model, "model"), ctypes.byref(info)) != 0:
        raise VisError("llama_vis_model_moe_info: NULL model")
    return MoeInfo(**{f.name: (bool if f.name.startswith("has_") else int)(getattr(info, f.name))
                      for f in fields(MoeInfo)})


# ---------------------------------------------------------------------------
# expert residency: stats
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MoeStats:
    n_slots: int
    managed: bool
    n_routed: int
    n_hits: int
    n_misses: int
    bytes_loaded: int
    load_us: int
    n_calls: int
    n_passes: int

    @property
    def hit_rate(self) -> float:
        return self.n_hits / self.n_routed if self.n_routed else 0.0


def moe_stats(ctx, layer: int = -1) -> MoeStats | None:
    """Stats of one layer, or totals (layer=-1); None if the context has no expert cache."""
    s = capi.llama_vis_moe_stats()
    if capi.llama_vis_moe_get_stats(_ctx_ptr(ctx), c_int("layer", layer), ctypes.byref(s)) != 0:
        return None
    d = _struct_dict(s)
    return MoeStats(**(d | {"managed": bool(d["managed"])}))


def moe_reset_stats(ctx) -> None:
    capi.llama_vis_moe_reset_stats(_ctx_ptr(ctx))


def moe_n_managed(ctx) -> int:
    return int(capi.llama_vis_moe_n_managed(_ctx_ptr(ctx)))


def moe_failures(ctx) -> tuple[int, str]:
    """(decodes the expert cache failed, message of the last decode's failure or "" if it did not fail there)."""
    p = _ctx_ptr(ctx)
    return int(capi.llama_vis_moe_n_failures(p)), (capi.llama_vis_moe_last_failure(p) or b"").decode()


def moe_print_stats(ctx) -> None:
    capi.llama_vis_moe_print_stats(_ctx_ptr(ctx))


def io_stats(ctx) -> dict | None:
    """Per-tier stats of a context (slab/host hits, file reads, bytes, I/O wait, peak RSS); None without a cache."""
    s = capi.llama_vis_moe_io_stats()
    if capi.llama_vis_moe_get_io_stats(_ctx_ptr(ctx), ctypes.byref(s)) != 0:
        return None
    return _struct_dict(s)


def overlap_stats(ctx, layer: int = -1) -> dict | None:
    """Decode misses read while their layer computed (VIS_MOE_OVERLAP): reads, miss passes, read time hidden behind
    compute, time waited, reads issued late; one layer or totals (layer=-1); None without a cache."""
    s = capi.llama_vis_moe_overlap_stats()
    if capi.llama_vis_moe_get_overlap_stats(_ctx_ptr(ctx), c_int("layer", layer), ctypes.byref(s)) != 0:
        return None
    return _struct_dict(s)


def sub_stats(ctx, layer: int = -1) -> dict | None:
    """Substitution stats of one layer, or totals (layer=-1): missing pairs by outcome (names of
    pyvis.runtime.trace.SUB_OUTCOMES), bytes and stall saved, background reads; None without a cache."""
    from .trace import SUB_OUTCOMES
    s = capi.llama_vis_moe_sub_stats()
    if capi.llama_vis_moe_get_sub_stats(_ctx_ptr(ctx), c_int("layer", layer), ctypes.byref(s)) != 0:
        return None
    d = {f: getattr(s, f) for f, _ in s._fields_ if f != "outcomes"}
    d["outcomes"] = {name: int(s.outcomes[i]) for i, name in enumerate(SUB_OUTCOMES)}
    return d


def prec_stats(ctx, layer: int = -1) -> dict | None:
    """Shadow-expert stats of one layer, or totals (layer=-1): eligible and served misses, shadow pairs, hits and
    reads, bytes read and saved, refetches, vision ubatches; totals add the controller's switches and share
    (docs/precision.md); all zero when --moe-precision is off; None without a cache."""
    s = capi.llama_vis_moe_prec_stats()
    if capi.llama_vis_moe_get_prec_stats(_ctx_ptr(ctx), c_int("layer", layer), ctypes.byref(s)) != 0:
        return None
    return _struct_dict(s)


def cap_stats(ctx, layer: int = -1) -> dict | None:
    """Entropy-weighted capacity stats of one layer, or totals (layer=-1): image ubatches, capacity, R_v, missing
    image-only experts loaded / over capacity / forced, pairs rerouted / dropped, bytes saved (docs/precision.md);
    all zero when --moe-capacity is off; None without a cache."""
    s = capi.llama_vis_moe_cap_stats()
    if capi.llama_vis_moe_get_cap_stats(_ctx_ptr(ctx), c_int("layer", layer), ctypes.byref(s)) != 0:
        return None
    return _struct_dict(s)


def macs_weights(embd, delta: float = 1.0):
    """MACS's weight of each embedding row [N, D] as the runtime computes it (llama_vis_moe_macs_weights)."""
    import numpy as np
    e = np.ascontiguousarray(embd, np.float32)
    if e.ndim != 2 or e.shape[1] == 0:
        raise VisError(f"macs_weights: embeddings must be [N, D] with D > 0, got shape {e.shape}")
    out = np.zeros(e.shape[0], np.float32)
    fp = ctypes.POINTER(ctypes.c_float)
    if capi.llama_vis_moe_macs_weights(e.ctypes.data_as(fp), e.shape[0], e.shape[1], float(delta),
                                       out.ctypes.data_as(fp)) != 0:
        raise VisError(last_error())
    return out


def prefetch_stats(ctx, layer: int = -1) -> dict | None:
    """Lookahead prefetch stats of one layer, or totals (layer=-1): the next layer's prediction (recall and
    precision counts), reads ahead issued / used / wasted / late / cancelled, bytes, wait and saved time
    (docs/prediction.md); all zero when prediction is off; None without a cache."""
    s = capi.llama_vis_moe_prefetch_stats()
    if capi.llama_vis_moe_get_prefetch_stats(_ctx_ptr(ctx), c_int("layer", layer), ctypes.byref(s)) != 0:
        return None
    return _struct_dict(s)


# ---------------------------------------------------------------------------
# the --moe-* flag table of the C tools
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    name: str               # "--moe-slots"
    env: str                # "VIS_MOE_SLOTS"
    value_hint: str | None  # "N", "auto|MIB", ...; None for a flag without a value
    help: str
    scope: int              # capi.LLAMA_VIS_MOE_SCOPE_*: a user flag, or an engine knob (docs/knobs.md)
    value_type: int         # capi.LLAMA_VIS_MOE_VALUE_*: what its value is (pyvis.moe.MoeConfig types its field by it)

    @property
    def knob(self) -> bool:
        return self.scope == capi.LLAMA_VIS_MOE_SCOPE_KNOB


def flags() -> list[Flag]:
    """Every --moe-* flag, from the C settings table (llama_vis_moe_get_flag)."""
    out = []
    for i in range(capi.llama_vis_moe_n_flags()):
        f = capi.llama_vis_moe_flag()
        _check(capi.llama_vis_moe_get_flag(i, ctypes.byref(f)), "llama_vis_moe_get_flag")
        out.append(Flag(f.name.decode(), f.env.decode(), f.value_hint.decode() if f.value_hint else None,
                        f.help.decode(), f.scope, f.value_type))
    return out


# ---------------------------------------------------------------------------
# visual-token pruning (issue #4): encoder saliency, layer limit, routing capture
# semantics: docs/vlm-native-api.md
# ---------------------------------------------------------------------------
def saliency_enable(mctx, n_layers: int = 1) -> None:
    """Ask the vision encoder for per-token saliency ("attention received").

    mctx: an mtmd_context pointer (from ``llama_cpp.mtmd_cpp.mtmd_init_from_file``), or None
    for the process-wide default of every mtmd context. n_layers: 0 = off (encoder graph
    unchanged), k = average over the last k encoder layers. Takes effect at the next encode.
    """
    _check(capi.llama_vis_mtmd_saliency_enable(_mtmd_ptr(mctx), c_int("n_layers", n_layers)),
           "llama_vis_mtmd_saliency_enable")


def mtmd_saliency(mctx, raw: bool = False) -> np.ndarray:
    """Saliency of the last image chunk encoded by mctx: float32 [n_image_tokens].

    Normalised to [0, 1] (min-max), or with raw=True the mean attention each token
    receives (sums to 1 / merge factor). Raises VisError when the last encode had
    saliency off, failed, or its projector has no saliency support.
    """
    fn = capi.llama_vis_mtmd_get_saliency_raw if raw else capi.llama_vis_mtmd_get_saliency
    p = _mtmd_ptr(mctx)
    n = _check(fn(p, None, 0), "llama_vis_mtmd_get_saliency")
    out = np.zeros(n, dtype=np.float32)
    if n:
        fn(p, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
    return out


def set_layer_limit(ctx, n_layers: int) -> None:
    """Evaluate only the first n_layers layers in the following llama_decode calls (0 = off).

    No logits are produced under a limit, and the KV cells of the decoded tokens stay taken:
    remove them with ``llama_memory_seq_rm`` before the real decode. Raises VisError for a
    bad n_layers or an unsupported architecture.
    """
    _check(capi.llama_vis_set_layer_limit(_ctx_ptr(ctx), c_int("n_layers", n_layers)), "llama_vis_set_layer_limit")


def get_layer_limit(ctx) -> int:
    return int(capi.llama_vis_get_layer_limit(_ctx_ptr(ctx)))


@contextlib.contextmanager
def layer_limit(ctx, n_layers: int):
    """``with layer_limit(ctx, L): llama_decode(...)`` - the limit is restored to its old value after."""
    old = get_layer_limit(ctx)
    set_layer_limit(ctx, n_layers)
    try:
        yield
    finally:
        set_layer_limit(ctx, old)


def moe_capture(ctx, on: bool = True) -> None:
    """Start (clearing earlier captures) or stop (freeing them) the in-memory routing capture."""
    _check(capi.llama_vis_moe_capture(_ctx_ptr(ctx), int(bool(on))), "llama_vis_moe_capture")


def moe_capture_reset(ctx) -> None:
    """Drop the captured routes; capture stays on."""
    capi.llama_vis_moe_capture_reset(_ctx_ptr(ctx))


def moe_routes(ctx, layer: int) -> np.ndarray:
    """Routed expert ids of one layer since the last reset: int32 [n_rows, k], rows in ubatch order.

    Empty ([0, 0]) for a layer without experts or not evaluated. In a full decode the last
    layer only routes the output rows.
    """
    p, il = _ctx_ptr(ctx), c_int("layer", layer)
    k = _check(capi.llama_vis_moe_routes_k(p, il), "llama_vis_moe_routes_k")
    n = _check(capi.llama_vis_moe_get_routes(p, il, None, 0), "llama_vis_moe_get_routes")
    out = np.zeros((n, k), dtype=np.int32)
    if n and k:
        capi.llama_vis_moe_get_routes(p, il, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n * k)
    return out


# the memory probe and the planner: native_plan.py, split out by concern
from .native_plan import (  # noqa: E402
    mem_probe, plan, cost_default, cost_probe, configure, split_slots, extra_slots, estimate_reserve, io_buffer_bytes, whole_model_fits, _encoder_dict, encoder_estimate, plan_encoder, planned_encoder, encoder_releasable, encoder_freed,
    context_reserve)
