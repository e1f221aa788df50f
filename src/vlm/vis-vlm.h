// vis-vlm.h - internal interface of the visual-token pruning support (issue #4):
// encoder saliency (src/vlm/vis-mtmd-saliency.cpp) and prefix-layer evaluation with
// routing capture (src/vlm/vis-moe-capture.cpp), used by the hooks of patches 0010/0011.
//
// Public C API: llama-vis.h.  Python: pyvis/_native.py.  Docs: docs/vlm-native-api.md.
#pragma once

#include "llama-vis.h"
#include "ggml.h"

#include <cstdint>

struct llama_context;
struct llama_cparams;
struct llm_graph_params;
class  llm_graph_result;

// ---- patch 0011 (llama-graph.cpp, llama-model.cpp, llama-context.cpp) ----

// number of layers the graph of a ubatch evaluates: the model's, or the layer limit
int64_t vis_graph_n_layer(const llama_cparams & cparams, int64_t n_layer);

// capture on: a contiguous, output-flagged copy "vis_capture_ids-<il>" of the routed ids
void vis_capture_graph_ids(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * selected_experts, int il);

// layer limit on: cut the graph after the last node of layer n-1 and drop its outputs
void vis_layer_limit_finish(const llm_graph_params & params, llm_graph_result * res);

// after a ubatch was computed: append the captured routes of every layer
void vis_capture_collect(llama_context * lctx, ggml_cgraph * gf);
