// vis-moe.h - the hooks of the expert-residency cache, called by the ggml-patches
// in llama-context.cpp (patch 0002) and llama-graph.cpp (build_moe_ffn).
//
// Public C API: llama-vis.h.  State: vis-moe-context.h.  Design: docs/architecture.md.
#pragma once

#include "llama-vis.h"
#include "vis-owner.h"
#include "ggml.h"

#include <cstdint>
#include <vector>

struct llama_context;
class llama_kv_cache;
struct ggml_backend_buffer;
struct llama_cparams;
struct llama_memory_params;
struct llama_model;
struct llama_ubatch;
struct vis_moe_context;

// ---- context lifetime (patch 0002, llama-context.cpp) -----------------------

// The expert cache of a new context, from the settings in force on this thread; null when
// the feature is off.  Throws std::runtime_error with a message naming the flag on bad
// configuration (also left in llama_vis_last_error()).
vis_owned<vis_moe_context> vis_moe_context_attach(const llama_context * lctx, const llama_model & model);
// Print the stats if asked (--moe-stats) and free the cache.
void vis_moe_context_detach(vis_owned<vis_moe_context> & vm);

// Before upstream creates (and clears) the KV cache of a context (patch 0002): under --moe-mem, runs the memory
// plan the attach will run (llama_vis_moe_plan, as `pyvis plan` asks it) with the KV cache these parameters create,
// and throws std::runtime_error when it does not fit, naming the smallest budget for this context and the largest
// context for this budget.  First the configurator may lower cp.n_ubatch where a smaller compute buffer buys expert
// slots worth more (vis-moe-configure.h; before upstream reserves the compute buffers).
void vis_moe_check_kv(const llama_model & model, const llama_memory_params & pm, llama_cparams & cp);

// A ubatch is about to be computed: before its graph is built or reused and before its inputs are set (patch 0017).
// Features may change slot limits here (the graph is then built for them) and drop pages of the compute buffer
// (the last ubatch's outputs were copied out).  A failure is reported by vis_moe_end_ubatch.
void vis_moe_prepare_ubatch(vis_moe_context * vm, const llama_ubatch & ubatch);
// Record the ubatch about to be computed (positions, sequences, modality for the trace).
void vis_moe_begin_ubatch(vis_moe_context * vm, const llama_ubatch & ubatch);
// After compute: false if a load or a trace write failed during the ubatch (message in llama_vis_last_error()).
bool vis_moe_end_ubatch(vis_moe_context * vm);

// Extra graph nodes the cache may add for a ubatch of n_tokens.
uint32_t vis_moe_extra_nodes(const vis_moe_context * vm, uint32_t n_tokens);
// Changes whenever the pass counts a graph of this cache builds may change (the online controller's slot limits):
// a graph built at another epoch is not reused (patch 0016, llm_graph_params::allow_reuse).  0 without a cache.
uint64_t vis_moe_graph_epoch(const vis_moe_context * vm);

// ---- the KV cache's pages (patch 0016, llama-kv-cache.cpp; src/core/vis-moe-kv-pages.cpp) ----
// under VIS_MOE_ONLINE=on: the KV buffer's clear drops its pages instead of writing them (zeros all the same,
// resident only once written), else upstream's clear
void vis_kv_buffer_clear(ggml_backend_buffer * buf);
// the end of llama_kv_cache::seq_rm: under VIS_MOE_ONLINE=on, the pages that hold only empty cells are dropped
void vis_kv_seq_removed(const llama_kv_cache & kv);

// ---- graph (patch 0002, llm_graph_context::build_moe_ffn; src/core/vis-moe-graph.cpp) ----

// the experts each token of a MoE layer runs: N under --moe-topk N (src/features/vis-moe-topk.cpp), else the model's
int64_t vis_moe_n_expert_used(const vis_moe_context * vm, int64_t n_expert_used);
//
// For one MoE layer of one graph.  An unmanaged layer (or no cache) yields one
// pass whose ids and weights are upstream's: the graph is unchanged.
class vis_moe_layer_graph {
public:
    // scores: what the router ranked the experts by [n_expert, n_tokens] (router substitution reads it);
    // cur: the FFN input [n_embd, 1, n_tokens] (the routers of the layers ahead read it: --moe-predict);
    // image_ubatch: the ubatch is image embeddings (--moe-capacity may bound its experts, vis-moe-capacity.h).
    // selected_experts and weights are the caller's: under VIS_MOE_REPLAY (vis-moe-replay.h) they are replaced by
    // the recorded routing, which everything after this call reads; otherwise they are left as they are.
    vis_moe_layer_graph(const vis_moe_context * vm, ggml_context * ctx, ggml_cgraph * gf, int il,
                        ggml_tensor *& selected_experts, ggml_tensor *& weights, ggml_tensor * scores, ggml_tensor * cur,
                        int64_t n_tokens, bool image_ubatch = false);

    int n_passes() const { return n_pass; }

    // ids for the three mul_mat_id of pass p (slot ids when managed)
    ggml_tensor * mm_ids(int p, ggml_tensor * selected_experts);

    // the tensor the mul_mat_id of pass p reads instead of w (a slab when managed)
    ggml_tensor * weight(ggml_tensor * w) const;

    // collect the weighted expert outputs [n_embd, n_used, n_tokens] of pass p
    void push_output(ggml_tensor * experts);
    // the combined expert outputs: each (token, slot) taken from the pass that owned its expert
    ggml_tensor * output();

private:
    // the predict op (vis-moe-prefetch.h), after `dep` (null: no ordering)
    void add_predict(ggml_tensor * dep);
    // VIS_MOE_REPLAY (vis-moe-replay.h): ids and weights become the replay ops' outputs
    void add_replay(ggml_tensor *& ids, ggml_tensor *& weights);

    const vis_moe_context * vm = nullptr;  // the ops change the cache through their userdata (vis_moe_op_ud)
    ggml_context    * ctx;
    ggml_cgraph     * gf;
    int               il;
    int               n_pass = 1;
    int               n_full = 1;   // passes on the full-precision slabs; the passes after them read the shadow slabs
    int               cur_pass = 0; // the pass whose mm_ids was asked for last: weight() answers for it
    bool              managed = false;
    bool              stream  = false;  // this ubatch reads the layer's experts through the mapping (upstream graph)
    bool              staged  = false;  // ... into a staging buffer in the slabs instead (vis-moe-stage.h)
    bool              staged_shadow = false;  // ... the layer's shadows (--moe-precision: every routed expert served)
    ggml_tensor     * stream_ids = nullptr;  // the stream op's output (the routed ids): the layer's matmuls follow it
    ggml_tensor     * ids_cont = nullptr;  // contiguous copy of the routed ids
    ggml_tensor     * weights  = nullptr;
    ggml_tensor     * scores   = nullptr;  // router substitution only, else null
    ggml_tensor     * last     = nullptr;  // ordering dependency between passes
    ggml_tensor     * cur_in   = nullptr;  // the FFN input
    bool              predicting = false;  // --moe-predict: the predict op follows pass 0 (managed) or the routing
    std::vector<ggml_tensor *> outs;
    size_t            n_merged = 0;  // passes merged in place (CPU layers)
};
