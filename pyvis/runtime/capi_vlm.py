"""Part of the 1:1 ctypes mirror of src/api/llama-vis.h (:mod:`pyvis.runtime.capi`, which re-exports it): its
section src/api/llama-vis-vlm.h (encoder saliency, prefix-layer evaluation and routing capture), in the
header's order."""
from __future__ import annotations

import ctypes

from .capi_lib import (ctypes_function, ggml_cgraph_p, ggml_context_p, ggml_tensor_p, llama_context_p,  # noqa: F401
                       mtmd_context_p, vis_saliency_state_p)

# ---------------------------------------------------------------------------
# Visual-token pruning support: encoder saliency
# ---------------------------------------------------------------------------
# LLAMA_API int32_t llama_vis_mtmd_saliency_enable(const struct mtmd_context * ctx, int32_t n_layers);
@ctypes_function("llama_vis_mtmd_saliency_enable", [mtmd_context_p, ctypes.c_int32], ctypes.c_int32)
def llama_vis_mtmd_saliency_enable(ctx, n_layers: int) -> int:
    """Ask for saliency (ctx NULL: the process-wide default). n_layers 0 = off. 0, or -1 if n_layers < 0."""


# LLAMA_API int32_t llama_vis_mtmd_get_saliency(const struct mtmd_context * ctx, float * out, int32_t n_max);
@ctypes_function("llama_vis_mtmd_get_saliency", [mtmd_context_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int32],
                 ctypes.c_int32)
def llama_vis_mtmd_get_saliency(ctx, out, n_max: int) -> int:
    """Scores of the last image chunk encoded by ctx, min-max normalised. The count, or -1."""


# LLAMA_API int32_t llama_vis_mtmd_get_saliency_raw(const struct mtmd_context * ctx, float * out, int32_t n_max);
@ctypes_function("llama_vis_mtmd_get_saliency_raw", [mtmd_context_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int32],
                 ctypes.c_int32)
def llama_vis_mtmd_get_saliency_raw(ctx, out, n_max: int) -> int:
    """Same scores before normalisation."""


# Hooks called by libmtmd (patch 0010); not for applications, mirrored for completeness.
# typedef struct vis_saliency_state * (*llama_vis_mtmd_saliency_of)(const struct mtmd_context * ctx);
llama_vis_mtmd_saliency_of = ctypes.CFUNCTYPE(vis_saliency_state_p, mtmd_context_p)


# LLAMA_API struct vis_saliency_state * llama_vis_mtmd_saliency_attach(llama_vis_mtmd_saliency_of state_of);
@ctypes_function("llama_vis_mtmd_saliency_attach", [llama_vis_mtmd_saliency_of], vis_saliency_state_p)
def llama_vis_mtmd_saliency_attach(state_of):
    ...


# LLAMA_API void llama_vis_mtmd_saliency_begin(struct vis_saliency_state * st);
@ctypes_function("llama_vis_mtmd_saliency_begin", [vis_saliency_state_p], None)
def llama_vis_mtmd_saliency_begin(st) -> None:
    ...


# LLAMA_API void llama_vis_mtmd_saliency_end(struct vis_saliency_state * st, bool ok);
@ctypes_function("llama_vis_mtmd_saliency_end", [vis_saliency_state_p, ctypes.c_bool], None)
def llama_vis_mtmd_saliency_end(st, ok: bool) -> None:
    ...


# LLAMA_API bool llama_vis_clip_saliency_active(void);
@ctypes_function("llama_vis_clip_saliency_active", [], ctypes.c_bool)
def llama_vis_clip_saliency_active() -> bool:
    ...


# LLAMA_API bool llama_vis_clip_saliency_layer(const char * projector, int il, int n_layer);
@ctypes_function("llama_vis_clip_saliency_layer", [ctypes.c_char_p, ctypes.c_int, ctypes.c_int], ctypes.c_bool)
def llama_vis_clip_saliency_layer(projector: bytes, il: int, n_layer: int) -> bool:
    ...


# LLAMA_API void llama_vis_clip_saliency_collect(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * kq, int il);
@ctypes_function("llama_vis_clip_saliency_collect", [ggml_context_p, ggml_cgraph_p, ggml_tensor_p, ctypes.c_int], None)
def llama_vis_clip_saliency_collect(ctx, gf, kq, il: int) -> None:
    ...


# LLAMA_API void llama_vis_clip_saliency_attn(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * q,
#                                             struct ggml_tensor * k, struct ggml_tensor * kq_mask, float kq_scale,
#                                             struct ggml_tensor * sinks, int il);
@ctypes_function("llama_vis_clip_saliency_attn", [ggml_context_p, ggml_cgraph_p, ggml_tensor_p, ggml_tensor_p,
                                                  ggml_tensor_p, ctypes.c_float, ggml_tensor_p, ctypes.c_int], None)
def llama_vis_clip_saliency_attn(ctx, gf, q, k, kq_mask, kq_scale: float, sinks, il: int) -> None:
    ...


# LLAMA_API void llama_vis_clip_saliency_fetch(struct ggml_cgraph * gf, int n_tokens_out);
@ctypes_function("llama_vis_clip_saliency_fetch", [ggml_cgraph_p, ctypes.c_int], None)
def llama_vis_clip_saliency_fetch(gf, n_tokens_out: int) -> None:
    ...


# ---------------------------------------------------------------------------
# Visual-token pruning support: prefix-layer evaluation and routing capture
# ---------------------------------------------------------------------------
# LLAMA_API int32_t llama_vis_set_layer_limit(struct llama_context * ctx, int32_t n_layers);
@ctypes_function("llama_vis_set_layer_limit", [llama_context_p, ctypes.c_int32], ctypes.c_int32)
def llama_vis_set_layer_limit(ctx, n_layers: int) -> int:
    """From the next llama_decode on, evaluate only layers 0..n_layers-1 (0 = off). 0, or -1."""


# LLAMA_API int32_t llama_vis_get_layer_limit(const struct llama_context * ctx);
@ctypes_function("llama_vis_get_layer_limit", [llama_context_p], ctypes.c_int32)
def llama_vis_get_layer_limit(ctx) -> int:
    ...


# LLAMA_API int32_t llama_vis_moe_capture(struct llama_context * ctx, int32_t on);
@ctypes_function("llama_vis_moe_capture", [llama_context_p, ctypes.c_int32], ctypes.c_int32)
def llama_vis_moe_capture(ctx, on: int) -> int:
    """on = 1: capture the routed expert ids of every MoE layer (clears earlier captures); on = 0: stop and free."""


# LLAMA_API void    llama_vis_moe_capture_reset(struct llama_context * ctx);
@ctypes_function("llama_vis_moe_capture_reset", [llama_context_p], None)
def llama_vis_moe_capture_reset(ctx) -> None:
    ...


# LLAMA_API int32_t llama_vis_moe_get_routes(const struct llama_context * ctx, int32_t il, int32_t * ids, int32_t n_max);
@ctypes_function("llama_vis_moe_get_routes", [llama_context_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                              ctypes.c_int32], ctypes.c_int32)
def llama_vis_moe_get_routes(ctx, il: int, ids, n_max: int) -> int:
    """Routes of layer il since the last reset: row-major [n_rows][k]. n_rows, or -1 (capture off, il out of range)."""


# LLAMA_API int32_t llama_vis_moe_routes_k(const struct llama_context * ctx, int32_t il);
@ctypes_function("llama_vis_moe_routes_k", [llama_context_p, ctypes.c_int32], ctypes.c_int32)
def llama_vis_moe_routes_k(ctx, il: int) -> int:
    """k (ids per row) of layer il's capture; 0 if nothing was captured."""
