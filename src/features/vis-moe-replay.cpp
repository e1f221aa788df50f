// vis-moe-replay.cpp - VIS_MOE_REPLAY: a recorded routing trace replayed in place of the routers
// (vis-moe-replay.h).
#include "vis-moe-replay.h"
#include "vis-moe-context.h"

#include "ggml.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <set>
#include <stdexcept>

namespace {

// the loud line, once per process and trace (llama-bench silences the llama log: straight to stderr)
void say_meaningless(const vis_route_csv & t) {
    static std::mutex m;
    static std::set<std::string> said;
    std::lock_guard<std::mutex> lock(m);
    if (!said.insert(t.path).second) {
        return;
    }
    std::fprintf(stderr, "vis-moe: WARNING: VIS_MOE_REPLAY=%s: every MoE layer runs the experts recorded in this trace "
                 "(%d positions: %d prompt + %d generated), not its own router's: OUTPUTS ARE MEANINGLESS; this is a "
                 "benchmark knob (docs/benchmarks.md#replaying-recorded-routing)\n",
                 t.path.c_str(), t.n_pos, t.n_prompt, t.n_pos - t.n_prompt);
    std::fflush(stderr);
}

} // namespace

vis_moe_replay::vis_moe_replay(const std::string & path, const std::vector<int> & moe_layers, int n_layer,
                               int n_expert, int k_model, int k_used, const std::string & arch)
    : tr(vis_route_csv_read(path)) {
    trace_layer.assign(n_layer, -1);
    const int n_moe = (int) moe_layers.size();
    for (int i = 0; i < n_moe; ++i) {
        if (moe_layers[i] >= 0 && moe_layers[i] < n_layer) {
            trace_layer[moe_layers[i]] = i;
        }
    }
    const std::string shape = "the trace " + path + " records " + std::to_string(tr.n_layer) + " MoE layers x " +
                              std::to_string(tr.n_expert) + " experts, top-" + std::to_string(tr.k) + "; the model has " +
                              std::to_string(n_moe) + " MoE layers x " + std::to_string(n_expert) + " experts, top-" +
                              std::to_string(k_used);
    const std::string fix = " (replay needs a model of the recorded shape; for the shared Qwen3-30B-A3B trace: pyvis "
                            "fixtures --large --layers 48, docs/benchmarks.md#replaying-recorded-routing)";
    if (n_moe != tr.n_layer) {
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": the MoE layer counts differ" + fix);
    }
    if (n_expert != tr.n_expert) {
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": the expert counts differ" + fix);
    }
    n_keep = k_used;
    if (tr.k > 64) {
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": top-k above 64 is not supported");
    }
    if (tr.k == k_model && k_used < k_model) {
        // --moe-topk N on a trace of the model's own top-k: each row's N highest-weighted recorded experts.  An
        // approximation of a recording at top-N (whose later layers would route from other hidden states)
        std::fprintf(stderr, "vis-moe: VIS_MOE_REPLAY with --moe-topk %d: each position replays the %d highest-weighted "
                     "of its %d recorded experts (an approximation: the model recorded at top-%d would route its later "
                     "layers from other hidden states)\n", k_used, k_used, tr.k, k_used);
        std::fflush(stderr);
    } else if (tr.k != k_used) {
        // below the model's top-k, the extra slots would need experts: repeats break the one-expert-per-slot rule that
        // traces and the simulator rely on, other experts add bytes the recording never read
        const std::string k = std::to_string(tr.k);
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": the trace's top-" + k + " is " +
                                 (tr.k > k_used ? "above" : "below") + " the model's; run the model at the trace's "
                                 "top-k: --override-kv " + arch + ".expert_used_count=int:" + k +
                                 (tr.k < k_used ? " (or --moe-topk " + k + ", VIS_MOE_TOPK=" + k + " for llama-bench)"
                                                : std::string()));
    }
    say_meaningless(tr);
}

void vis_moe_replay::pick(int pos, int layer, int32_t * ids, float * w) const {
    const int32_t * rid = tr.ids_at(pos, layer);
    const float *   rw  = tr.weights_at(pos, layer);
    if (n_keep == tr.k) {  // the trace's own top-k: its row as recorded
        std::copy(rid, rid + tr.k, ids);
        std::copy(rw, rw + tr.k, w);
        return;
    }
    // --moe-topk below it: the N highest-weighted (the recorder writes router order, descending weight; sorting keeps
    // that and fixes any other order), renormalised to the row's total as a router renormalising its top-N would
    int order[64];  // tr.k <= 64, checked at construction
    for (int i = 0; i < tr.k; ++i) {
        order[i] = i;
    }
    std::stable_sort(order, order + tr.k, [&](int a, int b) { return rw[a] > rw[b]; });
    float all = 0.0f, kept = 0.0f;
    for (int i = 0; i < tr.k; ++i) {
        all += rw[i];
        kept += i < n_keep ? rw[order[i]] : 0.0f;
    }
    const float scale = kept > 0.0f ? all / kept : 1.0f;
    for (int i = 0; i < n_keep; ++i) {
        ids[i] = rid[order[i]];
        w[i]   = rw[order[i]] * scale;
    }
}

std::string vis_moe_replay::past_end(int pos) const {
    const std::string where = "VIS_MOE_REPLAY: " + tr.path;
    if (pos < 0) {
        return where + ": a token of the ubatch has no position";
    }
    return where + " ends at position " + std::to_string(tr.n_pos - 1) + " (" + std::to_string(tr.n_prompt) +
           " prompt + " + std::to_string(tr.n_pos - tr.n_prompt) + " generated tokens); position " +
           std::to_string(pos) + " is past it. Replay stops there, it never wraps: use a prompt and generation that "
           "together fit the trace";
}

std::string vis_moe_replay::fill(int il, ggml_tensor * dst, bool weights) const {
    const ggml_tensor * src = dst->src[0];  // the router's ids [k, n] or weights [1, k, n]
    const int k        = (int) (weights ? dst->ne[1] : dst->ne[0]);
    const int n_rows   = (int) (weights ? dst->ne[2] : dst->ne[1]);
    const size_t nb_k  = weights ? src->nb[1] : src->nb[0];
    const size_t nb_r  = weights ? src->nb[2] : src->nb[1];
    const int    layer = trace_layer[il];
    std::string failure;
    for (int r = 0; r < n_rows; ++r) {
        const int tok = rows.token(r, n_rows);
        const int pos = tok >= 0 ? rows.pos[tok] : -1;
        const bool in_range = pos >= 0 && pos < tr.n_pos;
        if (!in_range && failure.empty()) {
            failure = past_end(pos);
        }
        // a prompt position whose layer the recording did not compute (not an output row there): the router's own
        // choice, said once (upstream's warmup and context check decode positions 0-1 with an output; a shorter prompt)
        const bool own = !in_range || !tr.has(pos, layer);
        if (own && in_range && !weights && !warned_own.exchange(true)) {
            std::fprintf(stderr, "vis-moe: VIS_MOE_REPLAY: %s has no routing for layer %d (model layer %d) at prompt "
                         "position %d (a recording computes the last layer for its output rows only): rows like it run "
                         "the model's own router. Expected for upstream's warmup and 2-token context check; otherwise "
                         "replay a prompt of exactly %d tokens\n", tr.path.c_str(), layer, il, pos, tr.n_prompt);
            std::fflush(stderr);
        }
        int32_t ids[64];
        float   w[64];
        if (!own) {
            pick(pos, layer, ids, w);
        }
        for (int i = 0; i < k; ++i) {
            const char * from = (const char *) src->data + (size_t) i * nb_k + (size_t) r * nb_r;
            if (weights) {
                ((float *) dst->data)[(size_t) r * k + i] = own ? *(const float *) from : w[i];
            } else {
                ((int32_t *) dst->data)[(size_t) r * k + i] = own ? *(const int32_t *) from : ids[i];
            }
        }
    }
    return failure;
}

void vis_moe_replay_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto & ud = *(const vis_moe_op_ud *) userdata;
    const std::string failure = ud.vm->replay->fill(ud.il, dst, ud.kind == VIS_OP_REPLAY_WEIGHTS);
    if (!failure.empty()) {
        ud.vm->fail(failure);  // the first message of the ubatch is kept
    }
}
