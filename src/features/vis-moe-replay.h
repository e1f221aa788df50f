// vis-moe-replay.h - VIS_MOE_REPLAY=TRACE, a benchmark knob and never a default
// (docs/benchmarks.md#replaying-recorded-routing): every MoE layer runs the experts and weights that a recorded
// routing trace (the shared CSV format, vis-moe-route-csv.h) chose at each token position, instead of its own
// router's, so that a random-weights model of the recorded model's shape reads exactly the experts the real model
// read.  Outputs are meaningless under replay; llama-server refuses it (patch 0013).
//
// Where it hooks in: vis_moe_layer_graph (vis-moe-graph.cpp) replaces the router's ids [k, n_tokens] and weights
// [1, k, n_tokens] of every MoE layer by two ops (vis_moe_replay_op, vis-moe-ops.cpp) that write the trace's, before
// anything reads them: the expert cache's passes (managed layers), the trace recorder and upstream's mul_mat_id
// (unmanaged layers).  A context with VIS_MOE_REPLAY set always gets a vis_moe_context, with no managed layer when
// every cache feature is off: then the graph is upstream's plus those two ops per layer, the baseline on the same
// routing.  This file knows the trace and the ubatch, nothing of the cache.
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

#include "vis-moe-feature.h"

#include <atomic>
#include <string>
#include <vector>

struct ggml_tensor;

class vis_moe_replay : public vis_moe_feature {
public:
    // the trace at `path`, checked against the model: moe_layers = its layers with routed experts (in order),
    // n_layer its layers, n_expert, k_model its top-k, k_used the experts per token it runs (k_model, or
    // --moe-topk's N: then a trace recorded at k_model replays each row's N highest-weighted experts), arch its name
    // (for the --override-kv hint).  Throws std::runtime_error naming the file and the mismatch.
    vis_moe_replay(const std::string & path, const std::vector<int> & moe_layers, int n_layer, int n_expert,
                   int k_model, int k_used, const std::string & arch);

    void begin_ubatch(const llama_ubatch & ub) { rows.begin(ub); }

    // the feature (vis-moe-feature.h): the rows of each ubatch
    const char * feature_name() const override { return "replay"; }
    void ubatch_begin(vis_moe_context &, const llama_ubatch & ub) override { begin_ubatch(ub); }

    // does model layer il replay (a MoE layer)?
    bool replays(int il) const { return il >= 0 && il < (int) trace_layer.size() && trace_layer[il] >= 0; }

    // extra graph nodes per layer (vis_moe_extra_nodes)
    static constexpr int NODES_PER_LAYER = 2;

    // the op's work: dst = the trace's ids [k, n] (or weights [1, k, n]) of layer il for each row of the ubatch;
    // dst->src[0] holds the router's.  A row past the trace's end keeps the router's value and returns the message
    // that fails the ubatch ("" when every row was served); a prompt row the trace lacks keeps it too, said once.
    std::string fill(int il, ggml_tensor * dst, bool weights) const;

private:
    std::string past_end(int pos) const;

    // the row's experts to run: all k of the trace, or (--moe-topk N) its N highest-weighted, in weight order
    void pick(int pos, int layer, int32_t * ids, float * w) const;

    vis_route_csv    tr;
    int              n_keep = 0;       // experts replayed per row: the trace's k, or --moe-topk's N below it
    std::vector<int> trace_layer;  // model layer -> the trace's layer (its index among the MoE layers), -1 if none
    vis_ubatch_rows  rows;
    mutable std::atomic<bool> warned_own{ false };  // a row ran the router's own choice (said once)
};

// the replay ops (graph nodes replacing layer ud->il's routing): dst = the recorded ids (ud->kind VIS_OP_REPLAY_IDS)
// or weights (VIS_OP_REPLAY_WEIGHTS); src[0] = the router's
void vis_moe_replay_op(ggml_tensor * dst, int ith, int nth, void * ud);
