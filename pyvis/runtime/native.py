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
import operator
import os
from dataclasses import dataclass, fields

import numpy as np

from . import capi
from .capi import llama_cpp  # noqa: F401  (re-exported: the llama_cpp bound to our build)

__all__ = ["llama_cpp", "VisError", "last_error", "c_int", "version", "upstream_commit", "system_info_fragment",
           "MoeInfo", "moe_info", "MoeStats", "moe_stats", "moe_reset_stats", "moe_n_managed", "moe_failures", "moe_print_stats",
           "io_stats", "overlap_stats", "mem_probe", "plan", "estimate_reserve", "context_reserve", "Flag", "flags",
           "saliency_enable", "mtmd_saliency", "set_layer_limit", "get_layer_limit", "layer_limit", "moe_capture",
           "moe_capture_reset", "moe_routes"]


class VisError(RuntimeError):
    """A configuration or runtime error reported by the fork (llama_vis_last_error), or an argument out of range."""


def last_error() -> str:
    """Message of the last failed llama_vis_* call on this thread ("" if the last fallible call succeeded)."""
    return (capi.llama_vis_last_error() or b"").decode()


def _check(rc: int, what: str) -> int:
    """rc of a fallible call: raise VisError with that call's message when it is negative."""
    if rc < 0:
        raise VisError(last_error() or f"{what} failed")
    return rc


_C_RANGES = {t: (-(1 << (8 * ctypes.sizeof(t) - 1)), (1 << (8 * ctypes.sizeof(t) - 1)) - 1)
             for t in (ctypes.c_int32, ctypes.c_int64, ctypes.c_int)}


def c_int(name: str, value, ctype=ctypes.c_int32) -> int:
    """``value`` as an integer that fits ``ctype``, else VisError naming ``name`` and the range."""
    try:
        v = operator.index(value)
    except TypeError:
        raise VisError(f"{name} must be an integer, got {value!r}") from None
    lo, hi = _C_RANGES[ctype]
    if not lo <= v <= hi:
        raise VisError(f"{name} = {v} is out of range: the C argument is an int{8 * ctypes.sizeof(ctype)}_t "
                       f"({lo}..{hi})")
    return v


def fill_struct(struct: ctypes.Structure, values: dict, label=lambda field: field) -> ctypes.Structure:
    """Set integer fields of a C struct, each checked against its C type; ``label(field)`` names it in errors."""
    types = dict(struct._fields_)
    for k, v in values.items():
        if k not in types:
            raise VisError(f"{type(struct).__name__} has no field {k!r}")
        setattr(struct, k, c_int(label(k), v, types[k]))
    return struct


def _struct_dict(s: ctypes.Structure) -> dict:
    return {name: int(getattr(s, name)) for name, _ in s._fields_}


def _ptr(obj, attr: str):
    """The raw pointer inside a llama_cpp wrapper (``obj.attr``, twice for Llama -> _internals -> pointer)."""
    p = getattr(obj, attr, obj)
    return getattr(p, attr, p)


def _ctx_ptr(ctx):
    """A llama_context pointer from a llama_cpp.Llama, an _internals.LlamaContext or a pointer."""
    return _ptr(ctx, "ctx")


def _mtmd_ptr(mctx):
    """An mtmd_context pointer (c_void_p / int) or an object holding one in .ctx; None stays None."""
    return None if mctx is None else getattr(mctx, "ctx", mctx)


# ---------------------------------------------------------------------------
# the build and a model's MoE shape
# ---------------------------------------------------------------------------
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
# memory probe and planner
# ---------------------------------------------------------------------------
def mem_probe() -> dict:
    """What this machine gives us: MemTotal/MemAvailable, swap, zram, cgroup v1/v2 limit and usage, RSS."""
    m = capi.llama_vis_mem_info()
    _check(capi.llama_vis_mem_probe(ctypes.byref(m)), "llama_vis_mem_probe")
    return _struct_dict(m)


def plan(**request) -> dict:
    """llama_vis_moe_plan: split a budget over resident weights, KV, compute, slabs and the host cache.
    Keys of llama_vis_moe_plan_request (reserve_bytes is required: see :func:`estimate_reserve`; host_mib
    defaults to -1 = plan it, unified to 1); returns the plan as a dict with 'ok' and, if not ok, 'error'."""
    if "reserve_bytes" not in request:
        raise VisError("plan: reserve_bytes is required (llama_vis_moe_estimate_reserve gives the runtime's)")
    rq = fill_struct(capi.llama_vis_moe_plan_request(), dict(host_mib=-1, unified=1) | request)
    out = capi.struct_llama_vis_moe_plan()
    _check(capi.llama_vis_moe_plan(ctypes.byref(rq), ctypes.byref(out)), "llama_vis_moe_plan")
    d = _struct_dict(out)
    d["ok"] = bool(d["ok"])
    if not d["ok"]:
        d["error"] = last_error()
    return d


def cost_default(path) -> dict:
    """llama_vis_moe_cost_default: the cost model --moe-mem configures with (bandwidths probed once per device and
    cached, the VIS_MOE_READ_MBPS / VIS_MOE_PASS_US / VIS_MOE_PLAN_* knobs)."""
    c = capi.llama_vis_moe_cost()
    _check(capi.llama_vis_moe_cost_default(str(path).encode(), ctypes.byref(c)), "llama_vis_moe_cost_default")
    return {name: getattr(c, name) for name, _ in c._fields_}


def cost_probe(path, *, type_: int, n_embd: int, n_ff_exp: int, n_expert_used: int, n_threads: int) -> dict:
    """llama_vis_moe_cost_probe: :func:`cost_default` with the compute side measured (a matmul of the experts' weight
    type at 1 and 64 tokens, a pass's element-wise ops) on n_threads threads, probed once and cached in
    ~/.cache/vis-moe/compute."""
    c = capi.llama_vis_moe_cost()
    _check(capi.llama_vis_moe_cost_probe(str(path).encode(), c_int("type", type_, ctypes.c_int32),
                                         c_int("n_embd", n_embd, ctypes.c_int64),
                                         c_int("n_ff_exp", n_ff_exp, ctypes.c_int64),
                                         c_int("n_expert_used", n_expert_used, ctypes.c_int32),
                                         c_int("n_threads", n_threads, ctypes.c_int32), ctypes.byref(c)),
           "llama_vis_moe_cost_probe")
    return {name: getattr(c, name) for name, _ in c._fields_}


CONFIGURE_MODES = {"auto": -1, "on": 1, "off": 0}   # VIS_MOE_CONFIGURE's values as llama_vis_moe_configure_applies takes them
CONFIGURE_VERDICTS = {capi.LLAMA_VIS_MOE_CONFIGURE_APPLIED: "applied", capi.LLAMA_VIS_MOE_CONFIGURE_OFF: "off",
                      capi.LLAMA_VIS_MOE_CONFIGURE_NOT_F32: "not_f32"}


def configure(plan: dict, *, n_vocab: int, n_embd: int, n_ff_exp: int, n_ubatch: int, cost: dict,
              n_ubatch_min: int = 0, miss_curve=None, mode: str = "auto", all_f32: bool = False) -> dict:
    """llama_vis_moe_configure: the ubatch and slots with the lowest predicted latency within the plan request's
    budget (``plan``: keys of llama_vis_moe_plan_request; its reserve_bytes is ignored).  ``miss_curve``: None (the
    prior) or an array [managed layers][n_expert + 1] of misses per decode token; then 'layer_slots' (the slab bytes
    split per layer) is returned too.  The configuration as a dict; 'plan' holds llama_vis_moe_plan's at the chosen
    ubatch, 'error' the reason when it does not fit, 'verdict' llama_vis_moe_configure_applies' answer for
    VIS_MOE_CONFIGURE=``mode`` on weights that are (``all_f32``) or not all F32: 'applied' (the runtime runs at
    'n_ubatch'), 'off' or 'not_f32'."""
    import numpy as np
    rq = capi.llama_vis_moe_configure_request()
    fill_struct(rq.plan, dict(host_mib=-1, unified=1, reserve_bytes=0) | plan)
    fill_struct(rq, dict(n_vocab=n_vocab, n_embd=n_embd, n_ff_exp=n_ff_exp, n_ubatch=n_ubatch,
                         n_ubatch_min=n_ubatch_min))
    for k, v in cost.items():
        setattr(rq.cost, k, v)
    n_layers = int(plan.get("n_managed_layers", 0))
    curve = slots = None
    if miss_curve is not None:
        curve = np.ascontiguousarray(miss_curve, dtype=np.float32)
        if curve.shape != (n_layers, int(plan["n_expert"]) + 1):
            raise VisError(f"configure: miss_curve must be [{n_layers}][{int(plan['n_expert']) + 1}], got {curve.shape}")
        rq.miss_curve = curve.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        slots = (ctypes.c_int32 * max(n_layers, 1))()
        rq.layer_slots = ctypes.cast(slots, ctypes.POINTER(ctypes.c_int32))
    out = capi.llama_vis_moe_configuration()
    _check(capi.llama_vis_moe_configure(ctypes.byref(rq), ctypes.byref(out)), "llama_vis_moe_configure")
    d = {name: getattr(out, name) for name, _ in out._fields_ if name != "plan"}
    d["verdict"] = CONFIGURE_VERDICTS[capi.llama_vis_moe_configure_applies(ctypes.byref(rq), ctypes.byref(out),
                                                                            CONFIGURE_MODES[mode], int(all_f32))]
    d["ok"] = bool(d["ok"])
    d["plan"] = _struct_dict(out.plan)
    d["plan"]["ok"] = bool(d["plan"]["ok"])
    if not d["ok"]:
        d["error"] = last_error()
    if slots is not None:
        d["layer_slots"] = list(slots)[:n_layers]
    return d


def split_slots(miss_curve, n_expert_used: int, slots: int, row_bytes=None) -> list[int]:
    """llama_vis_moe_split_slots: per-layer slot counts for ``slots`` per layer on average from miss curves
    [layers][n_expert + 1] (what VIS_MOE_SLOT_SPLIT runs at attach; pyvis.runtime.cachesim_split.split_slots is the
    same rule in Python)."""
    curve = np.ascontiguousarray(miss_curve, dtype=np.float64)
    if curve.ndim != 2 or curve.shape[0] < 1:
        raise VisError(f"split_slots: miss_curve must be [layers][n_expert + 1], got {curve.shape}")
    n_layers, n_expert = curve.shape[0], curve.shape[1] - 1
    rb = None
    if row_bytes is not None:
        rba = (ctypes.c_int64 * n_layers)(*[int(x) for x in row_bytes])
        rb = ctypes.cast(rba, ctypes.POINTER(ctypes.c_int64))
    out = (ctypes.c_int32 * n_layers)()
    _check(capi.llama_vis_moe_split_slots(curve.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), n_layers, n_expert,
                                          n_expert_used, slots, rb, out), "llama_vis_moe_split_slots")
    return list(out)


def extra_slots(slots, extra: int, n_expert: int, miss_curve=None) -> list[int]:
    """llama_vis_moe_extra_slots: one more slot in ``extra`` of the layers holding ``slots`` (the bytes a plan leaves
    after whole slot rows), picked by the miss curves [layers][n_expert + 1] or, without, spread over depth
    (pyvis.runtime.cachesim_split.extra_slots is the same rule in Python)."""
    n_layers = len(slots)
    inp = (ctypes.c_int32 * n_layers)(*[int(x) for x in slots])
    curve = None
    if miss_curve is not None:
        c = np.ascontiguousarray(miss_curve, dtype=np.float64)
        if c.shape != (n_layers, n_expert + 1):
            raise VisError(f"extra_slots: miss_curve must be [{n_layers}][{n_expert + 1}], got {c.shape}")
        curve = c.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
    out = (ctypes.c_int32 * n_layers)()
    _check(capi.llama_vis_moe_extra_slots(curve, n_layers, n_expert, inp, extra, out), "llama_vis_moe_extra_slots")
    return list(out)


def estimate_reserve(n_ubatch: int, n_vocab: int, n_embd: int, n_expert_used: int, n_ff_exp: int) -> int:
    """Bytes of compute buffers + runtime the runtime plans --moe-mem with, from the model's shape."""
    args = dict(n_ubatch=n_ubatch, n_vocab=n_vocab, n_embd=n_embd, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp)
    return int(capi.llama_vis_moe_estimate_reserve(*(c_int(k, v, ctypes.c_int64) for k, v in args.items())))


def io_buffer_bytes(io_threads: int, slice_bytes: int, n_slab_tensors: int) -> int:
    """Bytes of the expert reads' memory the runtime plans --moe-mem with (io_bytes): the O_DIRECT bounce buffers of
    io_threads I/O threads for slices of up to slice_bytes, and the in-page placement of n_slab_tensors slabs."""
    return int(capi.llama_vis_moe_io_buffer_bytes(c_int("io_threads", io_threads, ctypes.c_int32),
                                                  c_int("slice_bytes", slice_bytes, ctypes.c_int64),
                                                  c_int("n_slab_tensors", n_slab_tensors, ctypes.c_int32)))


def whole_model_fits(model_bytes: int, budget_bytes: int = 0) -> bool:
    """Does a model of model_bytes fit the budget whole (0: the machine's)?  Then --moe-mem alone runs upstream's path."""
    return capi.llama_vis_moe_whole_model_fits(c_int("model_bytes", model_bytes, ctypes.c_int64),
                                               c_int("budget_bytes", budget_bytes, ctypes.c_int64)) == 1


def _encoder_dict(e) -> dict:
    d = {name: int(getattr(e, name)) for name, _ in e._fields_ if name != "projector"}
    d["projector"] = e.projector.decode(errors="replace")
    return d


def encoder_estimate(mmproj_path, image_max_tokens: int = -1, flash_attn: int = -1, warmup: bool = True) -> dict:
    """llama_vis_moe_encoder_estimate: the vision encoder's bytes that --moe-mem plans (weights, compute buffer and
    image copies at the largest image: image_max_tokens, <= 0 the projector's limit; warmup: libmtmd warms it up,
    as the tools do), as a dict."""
    out = capi.llama_vis_encoder_estimate()
    _check(capi.llama_vis_moe_encoder_estimate(os.fsencode(mmproj_path), c_int("image_max_tokens", image_max_tokens),
                                               c_int("flash_attn", flash_attn), int(bool(warmup)), ctypes.byref(out)),
           "llama_vis_moe_encoder_estimate")
    return _encoder_dict(out)


def plan_encoder(mmproj_path, image_max_tokens: int = -1, flash_attn: int = -1, warmup: bool = True) -> dict | None:
    """llama_vis_moe_plan_encoder: count that encoder in every --moe-mem plan made from now on in this process
    (None: none).  Returns the encoder planned now (None if none)."""
    _check(capi.llama_vis_moe_plan_encoder(None if mmproj_path is None else os.fsencode(mmproj_path),
                                           c_int("image_max_tokens", image_max_tokens),
                                           c_int("flash_attn", flash_attn), int(bool(warmup))),
           "llama_vis_moe_plan_encoder")
    return planned_encoder()


def planned_encoder() -> dict | None:
    """The encoder every --moe-mem plan of this process counts now (llama_vis_moe_planned_encoder), None if none."""
    out = capi.llama_vis_encoder_estimate()
    return _encoder_dict(out) if capi.llama_vis_moe_planned_encoder(ctypes.byref(out)) > 0 else None


def context_reserve(ctx) -> int | None:
    """The reserve a context's --moe-mem plan used, in bytes; None if it has no such plan."""
    r = int(capi.llama_vis_moe_context_reserve(_ctx_ptr(ctx)))
    return None if r < 0 else r


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
