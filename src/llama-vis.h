// llama-vis.h - public C API of the vis-moe fork of llama.cpp.
//
// Everything the fork adds to libllama is declared here, as new functions
// (never new fields in upstream structs, so that the ctypes mirrors in
// llama-cpp-python stay valid).  Python bindings: pyvis/_native.py.
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Version of the fork, e.g. "0.1.0".
LLAMA_API const char * llama_vis_version(void);

// Pinned upstream llama.cpp commit the fork is built on, e.g. "0c1e570".
LLAMA_API const char * llama_vis_upstream_commit(void);

// Fragment appended to llama_print_system_info() by patch 0001:
// "VIS_MOE : VERSION = 0.1.0 | UPSTREAM = 0c1e570 | "
LLAMA_API const char * llama_vis_system_info(void);

// Shape of a model's Mixture-of-Experts part, as seen by the loaded model.
struct llama_vis_moe_info {
    int32_t  n_layer;          // transformer layers
    int32_t  n_moe_layers;     // layers with routed experts (*_exps tensors)
    int32_t  first_moe_layer;  // index of the first MoE layer, -1 if none
    int32_t  n_expert;         // routed experts per MoE layer
    int32_t  n_expert_used;    // experts selected per token (top-k, max over layers)
    int32_t  n_expert_shared;  // shared experts per layer (hparams; 0 if none)
    int32_t  has_shared_exp;   // 1 if any layer has *_shexp tensors
    int32_t  has_exp_bias;     // 1 if any layer has per-expert biases (*_exps_b)
    int32_t  has_gate_up_exp;  // 1 if any layer has a merged gate_up_exps tensor
    int64_t  expert_bytes;     // bytes of one routed expert in one layer (gate+up+down), max over layers
    int64_t  routed_bytes;     // bytes of all routed experts in all layers
};

// Fill *info for a loaded model. Returns 0 on success, -1 if model or info is NULL.
LLAMA_API int32_t llama_vis_model_moe_info(const struct llama_model * model, struct llama_vis_moe_info * info);

#ifdef __cplusplus
}
#endif
