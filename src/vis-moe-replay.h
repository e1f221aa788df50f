// vis-moe-replay.h - VIS_MOE_REPLAY=TRACE, a benchmark knob and never a default
// (docs/benchmarks.md#replaying-recorded-routing): every MoE layer runs the experts and weights that a recorded
// routing trace (the shared CSV format, vis-moe-route-csv.h) chose at each token position, instead of its own
// router's, so that a random-weights model of the recorded model's shape reads exactly the experts the real model
// read.  Outputs are meaningless under replay; llama-server refuses it (patch 0013).
//
// Where it hooks in: vis_moe_layer_graph (vis-moe-graph.cpp) replaces the router's ids [k, n_tokens] and weights
// [1, k, n_tokens] of every MoE layer by two ops that write the trace's, before anything reads them: the expert
// cache's passes (managed layers), the trace recorder and upstream's mul_mat_id (unmanaged layers).  A context
// with VIS_MOE_REPLAY set always gets a vis_moe_context, with no managed layer when every cache feature is off:
// then the graph is upstream's plus those two ops per layer, the baseline on the same routing.
//
// Positions: the token at position p replays the trace's step p (prompt and generated steps alike).  A position
// past the trace's end fails the decode with a message; it never wraps.  A recording computes the last layer for
// its output rows only, so a prompt position before the last may lack a layer: a run that needs it there (an output
// row the recording did not have: llama-cli's 2-token context check, a shorter prompt) gets the router's own choice
// for that row, with one warning.
// The model must route the trace's top-k (--override-kv ARCH.expert_used_count=int:K, or --moe-topk K): fewer
// slots could not hold the trace's experts, more would need experts the recording never read.
#pragma once

#include "vis-moe-route-csv.h"
#include "vis-moe-ubatch-rows.h"

#include <atomic>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct vis_moe_context;

class vis_moe_replay {
public:
    // the trace at `path`, checked against the model's MoE layers, experts and the experts per token it runs
    // (k_used: the model's k, or --moe-topk's): throws std::runtime_error naming the file and the mismatch
    vis_moe_replay(const std::string & path, const llama_model & model, int k_used);

    void begin_ubatch(const llama_ubatch & ub) { rows.begin(ub); }

    // graph of layer il: ids and weights become the outputs of the replay ops (unchanged for a layer without experts)
    void graph(vis_moe_context & vm, ggml_context * ctx, int il, ggml_tensor *& ids, ggml_tensor *& weights) const;

    // extra graph nodes per layer
    static constexpr int NODES_PER_LAYER = 2;

    // the op: dst = the trace's ids (or weights) of layer il for each row of the ubatch; a row past the trace's end
    // keeps the router's value (src[0]) and fails the ubatch through vm; a prompt row the trace lacks keeps it too
    void fill(vis_moe_context & vm, int il, ggml_tensor * dst, bool weights) const;

private:
    std::string why_not(int pos) const;

    vis_route_csv   tr;
    std::vector<int> trace_layer;  // model layer -> the trace's layer (its index among the MoE layers), -1 if none
    vis_ubatch_rows  rows;
    mutable std::atomic<bool> warned_own{ false };  // a row ran the router's own choice (said once)
};
