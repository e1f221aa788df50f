// vis-moe-prefetch.cpp - lookahead prefetch (vis-moe-prefetch.h).
#include "vis-moe-prefetch.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-fetch-slots.h"  // vis_fetch_done
#include "vis-moe-profile.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <chrono>
#include <stdexcept>
#include <string>

namespace {
constexpr int TUNE_WINDOW = 16;  // reads ahead judged together
constexpr int TUNE_OFF    = 32;  // steps a wasteful layer's prefetch stays off
}

vis_moe_prefetcher::vis_moe_prefetcher(const vis_moe_predict_settings & s, std::unique_ptr<vis_moe_predictor> p,
                                       int n_layer, int budget)
    : pred(std::move(p)), W(s.lookahead), B(budget), tune(s.tune != 0), layers(n_layer) {
    for (auto & ls : layers) {
        ls.st.enabled = 1;
    }
}

static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void vis_moe_prefetcher::begin_ubatch(bool decode_) {
    decode = decode_;
    cur_step++;
    if (tune) {
        ab.begin(decode);
        issuing = ab.on();
    }
    t_begin_us = now_us();
}

void vis_moe_prefetcher::end_ubatch() {
    if (tune) {
        ab.end(now_us() - t_begin_us);
    }
}

void vis_moe_prefetcher::reset_stats() {
    for (auto & ls : layers) {
        const int32_t on = ls.st.enabled;
        ls.st = {};
        ls.st.enabled = on;
    }
}

void vis_moe_prefetcher::step(vis_moe_context & vm, vis_predict_input & in) {
    in.step = cur_step;
    pred->observe(in);
    if (!decode || in.n_tokens == 0) {
        return;
    }
    const int n_layer = (int) vm.layers.size();
    for (int d = 1; d <= W && in.il + d < n_layer; ++d) {
        const int T = in.il + d;
        const vis_moe_layer & L = vm.layers[T];
        layer_state & ls = layers[T];
        if (!L.managed || !L.deferred || ls.off_left > 0) {
            continue;
        }
        if (!pred->predict(in, d, L.n_expert, score)) {
            continue;
        }
        const std::vector<int32_t> top = vis_predict_top(score, B);
        if (d == 1) {
            ls.pred      = top;
            ls.pred_step = cur_step;
        }
        if (!issuing) {
            continue;  // measured slower with reads ahead: predictions are still scored
        }
        // best first; a resident expert is kept from the victims of the reads for the experts ranked below it
        // (vis_moe_context::apply_reads), one already being read is skipped, the first without a slot ends them
        reads.clear();
        for (int e : top) {
            reads.push_back({ e, VIS_READ_AHEAD, true, VIS_READ_NOT_ISSUED });
        }
        vm.apply_reads(T, reads);
        for (const auto & r : reads) {
            if (r.done == VIS_READ_SERVED || r.done == VIS_READ_QUEUED) {
                ls.ahead.push_back({ r.expert, r.done == VIS_READ_QUEUED });
                ls.st.n_issued++;
            }
        }
    }
}

void vis_moe_prefetcher::collected(const vis_moe_layer & L, int il,
                                   const std::vector<vis_fetch_done> & done, int64_t waited_us, const int32_t * ids,
                                   int64_t n_pairs) {
    layer_state & ls = layers[il];
    std::vector<uint8_t> routed(L.n_expert, 0);
    int64_t n_distinct = 0;
    for (int64_t j = 0; j < n_pairs; ++j) {
        if (ids[j] >= 0 && ids[j] < L.n_expert && !routed[ids[j]]) {
            routed[ids[j]] = 1;
            n_distinct++;
        }
    }
    if (ls.pred_step == cur_step && !ls.pred.empty()) {
        ls.st.n_steps++;
        ls.st.n_predicted += (int64_t) ls.pred.size();
        ls.st.n_routed += n_distinct;
        for (int e : ls.pred) {
            ls.st.n_pred_hits += routed[e];
        }
    }
    ls.pred.clear();
    // reads ahead: cancelled ones read nothing; the others were used if this step routed them
    std::vector<uint8_t> cancelled(L.n_expert, 0);
    for (const auto & d : done) {
        if (d.speculative && d.cancelled) {
            cancelled[d.expert] = 1;
            ls.st.n_cancelled++;
        }
    }
    if (!ls.ahead.empty()) {
        ls.st.wait_us += waited_us;
    }
    int used = 0, wasted = 0;
    for (const auto & a : ls.ahead) {
        if (a.queued && cancelled[a.expert]) {
            continue;
        }
        if (a.queued) {
            ls.st.bytes_read += L.expert_bytes;
        }
        if (routed[a.expert]) {
            used++;
            ls.st.n_late += a.queued && waited_us > 0 ? 1 : 0;
        } else {
            wasted++;
            ls.st.bytes_wasted += a.queued ? L.expert_bytes : 0;
        }
    }
    ls.st.n_used += used;
    ls.st.n_wasted += wasted;
    ls.ahead.clear();
    if (ls.off_left > 0) {
        ls.st.n_off_steps++;
        if (--ls.off_left == 0) {
            ls.st.enabled = 1;
        }
    }
    if (!tune) {
        return;
    }
    ls.win_used += used;
    ls.win_wasted += wasted;
    if (ls.win_used + ls.win_wasted >= TUNE_WINDOW) {
        if (ls.win_wasted > ls.win_used) {
            ls.off_left   = TUNE_OFF;
            ls.st.enabled = 0;
        }
        ls.win_used = ls.win_wasted = 0;
    }
}

void vis_moe_prefetcher::ubatch_begin(vis_moe_context & vm, const llama_ubatch &) {
    begin_ubatch(vm.ub_decode);
}

void vis_moe_prefetcher::ubatch_end(vis_moe_context & vm) {
    end_ubatch();
    for (auto & L : vm.layers) {
        if (L.managed) {
            L.slots.policy().end_step();  // speculative horizons count down; unused reads ahead go first
        }
    }
}

void vis_moe_total_prefetch_stats(const vis_moe_context & vm, llama_vis_moe_prefetch_stats & tot) {
    tot = {};
    if (!vm.prefetch) {
        return;
    }
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        const auto & s = vm.prefetch->stats((int) il);
        tot.n_steps += s.n_steps;
        tot.n_predicted += s.n_predicted;
        tot.n_pred_hits += s.n_pred_hits;
        tot.n_routed += s.n_routed;
        tot.n_issued += s.n_issued;
        tot.n_used += s.n_used;
        tot.n_wasted += s.n_wasted;
        tot.n_late += s.n_late;
        tot.n_cancelled += s.n_cancelled;
        tot.bytes_read += s.bytes_read;
        tot.bytes_wasted += s.bytes_wasted;
        tot.wait_us += s.wait_us;
        tot.n_off_steps += s.n_off_steps;
        tot.enabled += vm.layers[il].managed ? s.enabled : 0;
    }
    const auto & ab = vm.prefetch->ab_result();
    tot.ab_probes     = ab.probes;
    tot.ab_on_us      = ab.median_on_us;
    tot.ab_off_us     = ab.median_off_us;
    tot.ab_chose_on   = ab.chose_on;
    tot.ab_running_on = ab.running_on;
}

int64_t vis_moe_prefetch_saved_us(const vis_moe_context & vm, const llama_vis_moe_prefetch_stats & s) {
    return vis_moe_stall_saved_us(vm, s.bytes_read - s.bytes_wasted) - s.wait_us;
}

static void print_prefetch_row(const vis_moe_context & vm, const std::string & label, const llama_vis_moe_prefetch_stats & s) {
    std::fprintf(stderr, "vis-moe: %5s %7" PRId64 " %7.1f%% %7.1f%% %8" PRId64 " %8" PRId64 " %8" PRId64 " %6" PRId64
                         " %6" PRId64 " %9.2f %9.2f %8.2f %9.2f %6" PRId64 " %3d\n",
                 label.c_str(), s.n_steps, s.n_routed ? 100.0 * s.n_pred_hits / s.n_routed : 0.0,
                 s.n_predicted ? 100.0 * s.n_pred_hits / s.n_predicted : 0.0, s.n_issued, s.n_used, s.n_wasted, s.n_late,
                 s.n_cancelled, s.bytes_read / 1048576.0, s.bytes_wasted / 1048576.0, s.wait_us / 1000.0,
                 vis_moe_prefetch_saved_us(vm, s) / 1000.0, s.n_off_steps, s.enabled);
}

void vis_moe_prefetcher::stats_print(const vis_moe_context & vm) const {
    std::fprintf(stderr, "vis-moe: prefetch (--moe-predict %s, lookahead %d, budget %d): the next layer's prediction "
                         "and the reads ahead\n", name(), lookahead(), budget());
    std::fprintf(stderr, "vis-moe: %5s %7s %8s %8s %8s %8s %8s %6s %6s %9s %9s %8s %9s %6s %3s\n", "layer", "steps",
                 "recall", "prec", "issued", "used", "wasted", "late", "cancel", "MiB read", "MiB waste", "wait ms",
                 "saved ms", "off", "on");
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].stats.managed) {
            print_prefetch_row(vm, std::to_string(il), stats((int) il));
        }
    }
    llama_vis_moe_prefetch_stats t;
    vis_moe_total_prefetch_stats(vm, t);
    print_prefetch_row(vm, "total", t);
    if (t.ab_probes > 0) {
        std::fprintf(stderr, "vis-moe: prefetch measured: last probe %.2f ms per decode step with reads ahead, %.2f ms "
                             "without; %d of %d probes chose reads ahead; now %s\n", t.ab_on_us / 1000.0,
                     t.ab_off_us / 1000.0, t.ab_chose_on, t.ab_probes, t.ab_running_on ? "on" : "off");
    }
}

// after layer il routed (and, when managed, loaded what its ubatch needs): learn, predict the layers ahead and
// read their experts in the background.  src[0]: the routed ids; src[1]: an ordering dependency; src[1 + d]:
// the router logits of layer il + d (F32), or the ids again where the graph did not compute them;
// src[VIS_PREDICT_SRC_HIDDEN] (mlp only): layer il's FFN input [n_embd, n_tokens].
void vis_moe_predict_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto & ud = *(vis_moe_op_ud *) userdata;
    vis_moe_context & vm = *ud.vm;
    const ggml_tensor * ids_t = dst->src[0];
    vis_predict_input in;
    in.il       = ud.il;
    in.k        = (int) ids_t->ne[0];
    in.n_tokens = ids_t->ne[1];
    in.ids      = (const int32_t *) ids_t->data;
    for (int d = 1; d <= VIS_MAX_LOOKAHEAD && 1 + d < VIS_PREDICT_SRC_HIDDEN; ++d) {
        const ggml_tensor * lg = dst->src[1 + d];
        if (lg && lg->type == GGML_TYPE_F32) {
            in.logits[d] = (const float *) lg->data;
            in.stride[d] = (int64_t) (lg->nb[1] / sizeof(float));
        }
    }
    const ggml_tensor * h = VIS_PREDICT_SRC_HIDDEN < GGML_MAX_SRC ? dst->src[VIS_PREDICT_SRC_HIDDEN] : nullptr;
    if (h && h->type == GGML_TYPE_F32 && h->ne[1] == in.n_tokens && h->nb[0] == sizeof(float)) {
        in.hidden        = (const float *) h->data;
        in.n_embd        = h->ne[0];
        in.hidden_stride = (int64_t) (h->nb[1] / sizeof(float));
    }
    try {
        vm.prefetch->step(vm, in);
    } catch (const std::exception & e) {
        vm.fail(e.what());
    }
}

void vis_moe_prefetch_attach(vis_moe_context & vm, const llama_model & model, const vis_moe_settings & s, bool file_store) {
    int mode = s.predict.mode;
    if (mode == VIS_PRED_OFF || vm.n_managed == 0) {
        return;
    }
    if (mode == VIS_PRED_AUTO) {
        // docs/prediction.md (the table of modes: auto)
        LLAMA_LOG_INFO("vis-moe: --moe-predict auto: off (no predictor measured faster than none on every benchmark "
                       "yet; choose next-router, coact or freq explicitly)\n");
        return;
    }
    if (!file_store) {
        LLAMA_LOG_INFO("vis-moe: --moe-predict %s: off, the experts are not read from the file (--moe-store model, or "
                       "every managed expert loaded): there is nothing to read ahead\n", vis_predict_mode_name(mode));
        return;
    }
    std::vector<int> n_expert(vm.layers.size(), 0);
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        n_expert[il] = model.layers[il].ffn_gate_inp ? (int) model.hparams.n_expert : 0;
    }
    // --moe-predict-profile: seeds coact and freq, holds mlp's weights (docs/prediction.md#loading-a-profile); throws
    // on a bad file
    std::unique_ptr<vis_predict_profile> profile;
    std::string seeded;
    const std::string & pf = s.predict.profile;
    if (mode == VIS_PRED_MLP) {
        // the MLP's weights come from the profile: without one, or without an MLP in it, an error (the predictor)
        if (!pf.empty()) {
            profile = std::make_unique<vis_predict_profile>(vis_predict_profile_load(pf, model));
            if (profile->has_mlp() && profile->mlp_n_embd != (int) model.hparams.n_embd) {
                throw std::runtime_error("vis-moe: --moe-predict-profile " + pf + ": its MLP reads " +
                                         std::to_string(profile->mlp_n_embd) + " hidden features, this model has " +
                                         std::to_string(model.hparams.n_embd) + " (damaged file)");
            }
            seeded = ", profile " + pf + " (" + std::to_string(profile->n_tokens) + " tokens)";
            if (profile->has_mlp() && profile->mlp_lookahead < s.predict.lookahead) {
                LLAMA_LOG_INFO("vis-moe: --moe-predict-profile %s: its MLP predicts distances 1..%d, --moe-lookahead "
                               "is %d: no prediction for distances %d..%d\n", pf.c_str(), profile->mlp_lookahead,
                               s.predict.lookahead, profile->mlp_lookahead + 1, s.predict.lookahead);
            }
        }
    } else if (!pf.empty() && (mode == VIS_PRED_COACT || mode == VIS_PRED_FREQ)) {
        profile = std::make_unique<vis_predict_profile>(vis_predict_profile_load(pf, model));
        seeded = ", profile " + pf + " (" + std::to_string(profile->n_tokens) + " tokens)";
        if (mode == VIS_PRED_COACT && profile->lookahead < s.predict.lookahead) {
            LLAMA_LOG_INFO("vis-moe: --moe-predict-profile %s covers distances 1..%d, --moe-lookahead is %d: the "
                           "tables of distances %d..%d start empty and are learned online only\n", pf.c_str(),
                           profile->lookahead, s.predict.lookahead, profile->lookahead + 1, s.predict.lookahead);
        }
    } else if (!pf.empty()) {
        vis_predict_profile_load(pf, model);  // a named file is checked even when it is not used; throws on a bad one
        LLAMA_LOG_WARN("vis-moe: --moe-predict-profile %s is not used: --moe-predict %s does not learn from counts "
                       "(only coact, freq and mlp read a profile)\n", pf.c_str(), vis_predict_mode_name(mode));
    }
    const int budget = s.predict.budget > 0 ? std::min<int>(s.predict.budget, (int) model.hparams.n_expert)
                                            : vm.n_expert_used;
    vm.prefetch = vm.add(std::make_unique<vis_moe_prefetcher>(
        s.predict, vis_moe_predictor_make(mode, n_expert, s.predict.lookahead, 1234, profile.get()),
        (int) vm.layers.size(), budget));
    if (!vm.fetch) {
        vm.fetch = std::make_unique<vis_moe_fetcher>(s.tier.io_threads, s.tier.direct_io);
    }
    LLAMA_LOG_INFO("vis-moe: prefetch (exact): --moe-predict %s, lookahead %d layer%s, budget %d experts per layer and "
                   "step, self-tuning %s%s; decode steps\n", vm.prefetch->name(), s.predict.lookahead,
                   s.predict.lookahead == 1 ? "" : "s", budget, s.predict.tune ? "on" : "off", seeded.c_str());
}

void vis_moe_prefetcher::plan_collected(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                        const std::vector<vis_fetch_done> & done, int64_t waited_us, const int32_t * ids,
                                        int64_t n_pairs) {
    (void) vm;
    bool demand = false;  // a wait for a demand read is not the reads ahead's
    for (const auto & d : done) {
        demand = demand || !d.speculative;
    }
    collected(L, il, done, demand ? 0 : waited_us, ids, n_pairs);
}
