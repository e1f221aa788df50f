// vis-moe-ops.h - the CPU custom ops a managed layer's graph runs (src/core/vis-moe-ops.cpp).
// Each gets a vis_moe_op_ud (layer, pass) as userdata.  An op that fails (an I/O
// error) records the failure in the context and writes ids that keep the graph on
// finite data; the ubatch is then reported as failed (vis_moe_end_ubatch).
#pragma once

#include "ggml.h"

// ids -> slot ids of pass ud->pass; the first pass (dep = the gate weights) plans the ubatch through the features'
// planning chain (vis-moe-feature.h)
void vis_moe_pass_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * dep, int ith, int nth, void * ud);
// the first pass with router substitution: scores = the router's scores [n_expert, n_tokens]
void vis_moe_pass0_scored_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * weights,
                             const ggml_tensor * scores, int ith, int nth, void * ud);
// for each pair, the row of the concatenated pass outputs that holds it (GPU passes)
// shadow pass p (userdata pass = its number among the shadow passes): shadow slot ids (vis-moe-shadow-slots.h)
void vis_moe_shadow_pass_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * dep, int ith, int nth, void * ud);
void vis_moe_select_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * dep, int ith, int nth, void * ud);
// an unmanaged layer with the trace on: record, pass the ids through
void vis_moe_trace_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * weights, int ith, int nth, void * ud);
// prefill streaming: before the layer's experts run through the mapping (read-ahead advice)
void vis_moe_stream_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * weights, int ith, int nth, void * ud);
// in place: copy the rows of the pairs pass ud->pass owns from b into a (CPU passes)
void vis_moe_merge_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, const ggml_tensor * ids, int ith,
                      int nth, void * ud);
// (the ops of features that add graph nodes of their own are theirs: vis_moe_predict_op in vis-moe-prefetch.h,
// vis_moe_replay_op in vis-moe-replay.h)
// prefill streaming: after the layer, drop the streamed pages
void vis_moe_drop_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * ud);
