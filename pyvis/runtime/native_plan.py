"""The memory probe and the planner of the fork's C API (:mod:`pyvis.runtime.capi_paging`): llama_vis_mem_probe,
llama_vis_moe_plan, the configurator and its cost model, the per-layer slot rules and the vision encoder's estimate.
Part of :mod:`pyvis.runtime.native`, which re-exports every name here (``native.plan(...)``); split out by concern.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from . import capi
from .native_base import VisError, _check, _ctx_ptr, _struct_dict, c_int, fill_struct, last_error

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
              n_ubatch_min: int = 0, miss_curve=None, mode: str = "auto", all_f32: bool = False,
              borrow: bool = False) -> dict:
    """llama_vis_moe_configure: the ubatch and slots with the lowest predicted latency within the plan request's
    budget (``plan``: keys of llama_vis_moe_plan_request; its reserve_bytes is ignored).  ``miss_curve``: None (the
    prior) or an array [managed layers][n_expert + 1] of misses per decode token; then 'layer_slots' (the slab bytes
    split per layer) is returned too.  The configuration as a dict; 'plan' holds llama_vis_moe_plan's at the chosen
    ubatch, 'error' the reason when it does not fit, 'verdict' llama_vis_moe_configure_applies' answer for
    VIS_MOE_CONFIGURE=``mode`` on weights that are (``all_f32``) or not all F32: 'applied' (the runtime runs at
    'n_ubatch'), 'off' or 'not_f32'.  ``borrow``: decode priced with the borrowed slots (VIS_MOE_BORROW=on)."""
    import numpy as np
    rq = capi.llama_vis_moe_configure_request()
    fill_struct(rq.plan, dict(host_mib=-1, unified=1, reserve_bytes=0) | plan)
    fill_struct(rq, dict(n_vocab=n_vocab, n_embd=n_embd, n_ff_exp=n_ff_exp, n_ubatch=n_ubatch,
                         n_ubatch_min=n_ubatch_min, borrow=int(bool(borrow))))
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


def encoder_releasable(ctx) -> bool:
    """llama_vis_moe_encoder_releasable: ctx's --moe-mem plan gives the vision encoder's bytes to the expert slots
    once the tool frees its encoder (VIS_MOE_ENCODER_RELEASE=on, docs/planning.md#freeing-the-encoder-after-the-image)."""
    return int(capi.llama_vis_moe_encoder_releasable(_ctx_ptr(ctx))) == 1


def encoder_freed(ctx) -> None:
    """llama_vis_moe_encoder_freed: the tool has freed its vision encoder; ctx's expert slots grow by its bytes."""
    _check(capi.llama_vis_moe_encoder_freed(_ctx_ptr(ctx)), "llama_vis_moe_encoder_freed")


def context_reserve(ctx) -> int | None:
    """The reserve a context's --moe-mem plan used, in bytes; None if it has no such plan."""
    r = int(capi.llama_vis_moe_context_reserve(_ctx_ptr(ctx)))
    return None if r < 0 else r
