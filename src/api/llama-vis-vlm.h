// llama-vis-vlm.h - visual-token pruning support: encoder saliency, prefix-layer evaluation, routing capture.
// A section of llama-vis.h (include that), in its order; mirrored 1:1 by pyvis/runtime/capi_vlm.py.
#pragma once

#include "llama-vis-paging.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------
// Visual-token pruning support (issue #4, docs/vlm-native-api.md)
// ---------------------------------------------------------------------------
struct mtmd_context;

// -- encoder saliency (src/vlm/vis-mtmd-saliency.cpp, patch 0010) --
//
// "Attention received" of each image token: for each of the last k encoder
// layers, the softmax attention A[h, q, j] is averaged over heads h and query
// patches q (per-patch score, sums to 1 over patches), averaged over the patches
// merged into each output token (2x2 merge) and over the k layers.

// Ask for saliency. ctx == NULL sets the process-wide default for every mtmd
// context (initially VIS_MTMD_SALIENCY from the environment, else 0); a non-NULL
// ctx overrides the default for that context.  n_layers: 0 = off (the encoder
// graph is upstream's, unchanged), k >= 1 = average over the last k layers.
// Returns 0, or -1 with llama_vis_last_error() if n_layers < 0.
LLAMA_API int32_t llama_vis_mtmd_saliency_enable(const struct mtmd_context * ctx, int32_t n_layers);

// Scores of the last image chunk encoded by ctx, one per output token (the
// chunk's token order), min-max normalised to [0, 1] (a constant map gives 1.0).
// Writes min(count, n_max) values to out (out may be NULL).  Returns the count,
// or -1 with llama_vis_last_error() when the last encode had saliency off, failed,
// or used a projector without saliency support.
LLAMA_API int32_t llama_vis_mtmd_get_saliency(const struct mtmd_context * ctx, float * out, int32_t n_max);

// Same scores before normalisation: sum over the tokens * merge factor == 1.
LLAMA_API int32_t llama_vis_mtmd_get_saliency_raw(const struct mtmd_context * ctx, float * out, int32_t n_max);

// Hooks called by libmtmd (patch 0010); not for applications.  The state is owned by the
// mtmd context (mtmd_context::vis_saliency, src/api/vis-owner.h) and freed with it.  libmtmd
// links libllama, not the reverse, so the functions above cannot look inside an mtmd_context:
// attach hands over libmtmd's accessor of a context's state (one function for every context).
struct vis_saliency_state;
typedef struct vis_saliency_state * (*llama_vis_mtmd_saliency_of)(const struct mtmd_context * ctx);
LLAMA_API struct vis_saliency_state * llama_vis_mtmd_saliency_attach(llama_vis_mtmd_saliency_of state_of);
LLAMA_API void llama_vis_mtmd_saliency_begin(struct vis_saliency_state * st);
LLAMA_API void llama_vis_mtmd_saliency_end(struct vis_saliency_state * st, bool ok);
LLAMA_API bool llama_vis_clip_saliency_active(void);
LLAMA_API bool llama_vis_clip_saliency_layer(const char * projector, int il, int n_layer);
LLAMA_API void llama_vis_clip_saliency_collect(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * kq, int il);
LLAMA_API void llama_vis_clip_saliency_attn(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * q,
                                            struct ggml_tensor * k, struct ggml_tensor * kq_mask, float kq_scale,
                                            struct ggml_tensor * sinks, int il);
LLAMA_API void llama_vis_clip_saliency_fetch(struct ggml_cgraph * gf, int n_tokens_out);

// -- prefix-layer evaluation and routing capture (src/vlm/vis-moe-capture.cpp, patch 0011) --

// From the next llama_decode on, evaluate only layers 0..n_layers-1 (0 = off).
// Every token runs through every evaluated layer; the graph stops after layer
// n_layers-1: no logits or embeddings are produced, and only the evaluated layers'
// KV is written (the KV cells are still taken: llama_memory_seq_rm them before the
// real decode).  Returns 0, or -1 with llama_vis_last_error() for a NULL ctx,
// n_layers outside 0..n_layer, or an architecture that does not support it.
LLAMA_API int32_t llama_vis_set_layer_limit(struct llama_context * ctx, int32_t n_layers);
LLAMA_API int32_t llama_vis_get_layer_limit(const struct llama_context * ctx);

// on = 1: capture the routed expert ids of every MoE layer of every decoded ubatch
// (clears earlier captures); on = 0: stop and free.  Returns 0, or -1 (NULL ctx,
// model without experts).
LLAMA_API int32_t llama_vis_moe_capture(struct llama_context * ctx, int32_t on);
LLAMA_API void    llama_vis_moe_capture_reset(struct llama_context * ctx);

// Routes of layer il since the last reset: row-major [n_rows][k] expert ids, rows
// in ubatch order.  Writes min(n_rows * k, n_max) ids (ids may be NULL).  Returns
// n_rows (0 if the layer has no experts or was not evaluated), or -1 when capture
// is off or il is out of range.  In a full decode the last layer routes only the
// output rows.
LLAMA_API int32_t llama_vis_moe_get_routes(const struct llama_context * ctx, int32_t il, int32_t * ids, int32_t n_max);

// k (ids per row) of layer il's capture; 0 if nothing was captured.
LLAMA_API int32_t llama_vis_moe_routes_k(const struct llama_context * ctx, int32_t il);

#ifdef __cplusplus
}
#endif
