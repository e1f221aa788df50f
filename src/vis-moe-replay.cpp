// vis-moe-replay.cpp - VIS_MOE_REPLAY: a recorded routing trace replayed in place of the routers
// (vis-moe-replay.h).
#include "vis-moe-replay.h"
#include "vis-moe-context.h"

#include "llama-arch.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>

namespace {

void replay_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto & ud = *(const vis_moe_op_ud *) userdata;
    ud.vm->replay->fill(*ud.vm, ud.il, dst, ud.kind == VIS_OP_REPLAY_WEIGHTS);
}

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

vis_moe_replay::vis_moe_replay(const std::string & path, const llama_model & model, int k_used)
    : tr(vis_route_csv_read(path)) {
    const auto & hp = model.hparams;
    const int n_layer = (int) hp.n_layer();
    trace_layer.assign(n_layer, -1);
    int n_moe = 0;
    for (int il = 0; il < n_layer && il < (int) model.layers.size(); ++il) {
        for (const ggml_tensor * t : vis_moe_expert_tensors(model.layers[il])) {
            if (t) {
                trace_layer[il] = n_moe++;
                break;
            }
        }
    }
    const int k_model = k_used;
    const std::string shape = "the trace " + path + " records " + std::to_string(tr.n_layer) + " MoE layers x " +
                              std::to_string(tr.n_expert) + " experts, top-" + std::to_string(tr.k) + "; the model has " +
                              std::to_string(n_moe) + " MoE layers x " + std::to_string(hp.n_expert) + " experts, top-" +
                              std::to_string(k_model);
    const std::string fix = " (replay needs a model of the recorded shape; for the shared Qwen3-30B-A3B trace: pyvis "
                            "fixtures --large --layers 48, docs/benchmarks.md#replaying-recorded-routing)";
    if (n_moe != tr.n_layer) {
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": the MoE layer counts differ" + fix);
    }
    if ((int) hp.n_expert != tr.n_expert) {
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": the expert counts differ" + fix);
    }
    const std::string kv = std::string(llm_arch_name(model.arch)) + ".expert_used_count=int:" + std::to_string(tr.k);
    if (tr.k != k_model) {
        // below the model's top-k, the extra slots would need experts: repeats break the one-expert-per-slot rule that
        // traces and the simulator rely on, other experts add bytes the recording never read
        throw std::runtime_error("VIS_MOE_REPLAY: " + shape + ": the trace's top-" + std::to_string(tr.k) + " is " +
                                 (tr.k > k_model ? "above" : "below") + " the model's; run the model at the trace's "
                                 "top-k: --override-kv " + kv +
                                 (tr.k < k_model ? " (or --moe-topk " + std::to_string(tr.k) + ", VIS_MOE_TOPK=" + std::to_string(tr.k) + " for llama-bench)"
                                                  : std::string()));
    }
    say_meaningless(tr);
}

void vis_moe_replay::graph(vis_moe_context & vm, ggml_context * ctx, int il, ggml_tensor *& ids,
                           ggml_tensor *& weights) const {
    if (il < 0 || il >= (int) trace_layer.size() || trace_layer[il] < 0 || !ids || !weights) {
        return;
    }
    if (weights->ne[0] != 1 || weights->ne[1] != ids->ne[0] || weights->ne[2] != ids->ne[1]) {
        vm.fail("VIS_MOE_REPLAY: the router weights of layer " + std::to_string(il) + " are not [1, k, n_tokens]; "
                "replay does not support this architecture");
        return;
    }
    ggml_tensor * id_src[] = { ids };
    ggml_tensor * ri = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], 1, 1, id_src, 1, replay_op, 1,
                                      vm.ud(il, 0, VIS_OP_REPLAY_IDS));
    ggml_format_name(ri, "vis_moe_replay_ids-%d", il);
    ggml_tensor * w_src[] = { weights, ri };  // after the ids: one failure message per layer and ubatch comes first
    ggml_tensor * rw = ggml_custom_4d(ctx, GGML_TYPE_F32, weights->ne[0], weights->ne[1], weights->ne[2],
                                      weights->ne[3], w_src, 2, replay_op, 1, vm.ud(il, 0, VIS_OP_REPLAY_WEIGHTS));
    ggml_format_name(rw, "vis_moe_replay_weights-%d", il);
    ids     = ri;
    weights = rw;
}

std::string vis_moe_replay::why_not(int pos) const {
    const std::string where = "VIS_MOE_REPLAY: " + tr.path;
    if (pos < 0) {
        return where + ": a token of the ubatch has no position";
    }
    return where + " ends at position " + std::to_string(tr.n_pos - 1) + " (" + std::to_string(tr.n_prompt) +
           " prompt + " + std::to_string(tr.n_pos - tr.n_prompt) + " generated tokens); position " +
           std::to_string(pos) + " is past it. Replay stops there, it never wraps: use a prompt and generation that "
           "together fit the trace";
}

void vis_moe_replay::fill(vis_moe_context & vm, int il, ggml_tensor * dst, bool weights) const {
    const ggml_tensor * src = dst->src[0];  // the router's ids [k, n] or weights [1, k, n]
    const int k        = (int) (weights ? dst->ne[1] : dst->ne[0]);
    const int n_rows   = (int) (weights ? dst->ne[2] : dst->ne[1]);
    const size_t nb_k  = weights ? src->nb[1] : src->nb[0];
    const size_t nb_r  = weights ? src->nb[2] : src->nb[1];
    const int    layer = trace_layer[il];
    bool failed = false;
    for (int r = 0; r < n_rows; ++r) {
        const int tok = rows.token(r, n_rows);
        const int pos = tok >= 0 ? rows.pos[tok] : -1;
        const bool in_range = pos >= 0 && pos < tr.n_pos;
        if (!in_range && !failed && !weights) {
            vm.fail(why_not(pos));
        }
        failed = failed || !in_range;
        // a prompt position whose layer the recording did not compute (not an output row there): the router's own
        // choice, said once (llama-cli's context check decodes positions 0-1 with an output; a shorter prompt)
        const bool own = !in_range || !tr.has(pos, layer);
        if (own && in_range && !weights && !warned_own.exchange(true)) {
            std::fprintf(stderr, "vis-moe: VIS_MOE_REPLAY: %s has no routing for layer %d (model layer %d) at prompt "
                         "position %d (a recording computes the last layer for its output rows only): rows like it run "
                         "the model's own router. Expected for upstream's warmup and 2-token context check; otherwise "
                         "replay a prompt of exactly %d tokens\n", tr.path.c_str(), layer, il, pos, tr.n_prompt);
            std::fflush(stderr);
        }
        for (int i = 0; i < k; ++i) {
            const char * from = (const char *) src->data + (size_t) i * nb_k + (size_t) r * nb_r;
            if (weights) {
                ((float *) dst->data)[(size_t) r * k + i] = own ? *(const float *) from : tr.weights_at(pos, layer)[i];
            } else {
                ((int32_t *) dst->data)[(size_t) r * k + i] = own ? *(const int32_t *) from : tr.ids_at(pos, layer)[i];
            }
        }
    }
}
