// vis-moe-substitute.cpp - substitution on a miss: gates, stand-ins, background reads (vis-moe-substitute.h).
#include "vis-moe-substitute.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-fetch-slots.h"  // vis_fetch_done

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <string>
#include <stdexcept>

double vis_sub_tae(const float * w, int64_t stride, int k, double * margin) {
    double sum = 0;
    for (int r = 0; r < k; ++r) {
        sum += (double) w[r * stride];
    }
    if (!(sum > 0) || !std::isfinite(sum)) {
        if (margin) {
            *margin = 1;
        }
        return -1;
    }
    double h = 0, p1 = 0, p2 = 0;
    for (int r = 0; r < k; ++r) {
        const double p = (double) w[r * stride] / sum;
        if (p > 0) {
            h -= p * std::log(p);
        }
        if (p > p1) {
            p2 = p1;
            p1 = p;
        } else if (p > p2) {
            p2 = p;
        }
    }
    if (margin) {
        *margin = k > 1 ? p1 - p2 : 1;
    }
    return k > 1 ? h / std::log((double) k) : 0;
}

namespace {

// where a dropped pair of a token routing ids[0..k) runs with weight 0: a resident expert the token runs, else the
// first resident expert; -1 if none is resident
int drop_host(int n_expert, const std::vector<uint8_t> & resident, const int32_t * ids, int k) {
    for (int r = 0; r < k; ++r) {
        if (resident[ids[r]]) {
            return ids[r];
        }
    }
    for (int c = 0; c < n_expert; ++c) {
        if (resident[c]) {
            return c;
        }
    }
    return -1;
}

// the stand-in for missing expert e of token t: resident, not already run by the token; -1 if none
int pick(const vis_sub_rule & rule, int n_expert, const std::vector<uint8_t> & resident, const std::vector<uint8_t> & used,
         const vis_sub_input & in, int64_t t, int e) {
    if (rule.mode == VIS_SUB_BUDDY) {
        const int32_t * b = rule.buddies + (size_t) e * rule.k_max;
        for (int i = 0; i < rule.k_max && b[i] >= 0; ++i) {
            if (b[i] != e && b[i] < n_expert && resident[b[i]] && !used[b[i]]) {
                return b[i];
            }
        }
        return -1;
    }
    const float * s = in.scores + t * in.s_tok;
    int best = -1;
    for (int c = 0; c < n_expert; ++c) {
        if (resident[c] && !used[c] && std::isfinite(s[c]) && (best < 0 || s[c] > s[best])) {
            best = c;
        }
    }
    return best;
}

} // namespace

bool vis_sub_decide(const vis_sub_rule & rule, int n_expert, const std::vector<uint8_t> & resident,
                    const vis_sub_input & in, int32_t * exec, uint8_t * outcome, std::vector<int32_t> & background,
                    llama_vis_moe_sub_stats & st) {
    const int k = in.k;
    const int64_t n_pairs = in.n_tokens * k;
    background.clear();
    std::vector<uint8_t> routed(n_expert, 0), missing(n_expert, 0);
    int n_routed = 0, n_missing = 0;
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = in.ids[j];
        exec[j]    = e;
        outcome[j] = LLAMA_VIS_SUB_RESIDENT;
        if (!routed[e]) {
            routed[e] = 1;
            n_routed++;
            if (!resident[e]) {
                missing[e] = 1;
                n_missing++;
            }
        }
        st.n_missing += resident[e] ? 0 : 1;
    }
    st.n_tokens += in.n_tokens;
    auto block_all = [&](uint8_t why) {
        for (int64_t j = 0; j < n_pairs; ++j) {
            if (!resident[in.ids[j]]) {
                outcome[j] = why;
                st.outcomes[why]++;
            }
        }
        return false;
    };
    if (n_missing == 0) {
        return false;
    }
    if (!in.decode && !in.prefill_allowed) {
        return block_all(LLAMA_VIS_SUB_NOT_ELIGIBLE);
    }
    if ((double) n_missing / n_routed > rule.beta) {
        return block_all(LLAMA_VIS_SUB_BLOCKED_BETA);
    }

    std::vector<uint8_t> used(n_expert, 0);
    std::vector<std::pair<double, int>> order;  // (share of the token's weight, rank) of its missing pairs
    for (int64_t t = 0; t < in.n_tokens; ++t) {
        const int32_t * ids = in.ids + t * k;
        order.clear();
        for (int r = 0; r < k; ++r) {
            if (!resident[ids[r]]) {
                order.emplace_back(0.0, r);
            }
        }
        if (order.empty()) {
            continue;
        }
        const float * w = in.weights + t * in.w_tok;
        double margin = 1;
        const double tae = vis_sub_tae(w, in.w_rank, k, &margin);
        uint8_t gate = LLAMA_VIS_SUB_RESIDENT;
        if (tae < 0 || (rule.tau >= 0 && tae <= rule.tau)) {
            gate = LLAMA_VIS_SUB_BLOCKED_TAE;  // also: weights that do not sum to a positive value
        } else if (rule.margin >= 0 && margin >= rule.margin) {
            gate = LLAMA_VIS_SUB_BLOCKED_MARGIN;
        }
        if (gate != LLAMA_VIS_SUB_RESIDENT) {
            for (const auto & o : order) {
                outcome[t * k + o.second] = gate;
            }
            continue;
        }
        double sum = 0;
        for (int r = 0; r < k; ++r) {
            sum += (double) w[r * in.w_rank];
        }
        for (auto & o : order) {
            o.first = (double) w[o.second * in.w_rank] / sum;
        }
        // lowest share first; equal shares: the lower-ranked pair first
        std::sort(order.begin(), order.end(), [](const auto & a, const auto & b) {
            return a.first != b.first ? a.first < b.first : a.second > b.second;
        });
        for (int r = 0; r < k; ++r) {
            used[ids[r]] = 1;
        }
        int n_sub = 0;
        for (const auto & [share, r] : order) {
            const int64_t j = t * k + r;
            if (rule.rank > 0 && r < k - rule.rank) {
                outcome[j] = LLAMA_VIS_SUB_BLOCKED_RANK;  // the routing order is the router's ranking
            } else if (!(share < rule.weight)) {
                outcome[j] = LLAMA_VIS_SUB_BLOCKED_WEIGHT;
            } else if (rule.mode == VIS_SUB_DROP) {
                const int host = drop_host(n_expert, resident, ids, k);
                if (!(share < rule.drop_share / k)) {
                    outcome[j] = LLAMA_VIS_SUB_BLOCKED_WEIGHT;
                } else if (host < 0) {
                    outcome[j] = LLAMA_VIS_SUB_NO_CANDIDATE;
                } else {
                    exec[j]    = host;  // computed and multiplied by a gate weight of 0
                    outcome[j] = LLAMA_VIS_SUB_DROPPED;
                }
            } else if (n_sub >= rule.budget) {
                outcome[j] = LLAMA_VIS_SUB_BLOCKED_BUDGET;
            } else {
                const int c = pick(rule, n_expert, resident, used, in, t, ids[r]);
                if (c < 0) {
                    outcome[j] = LLAMA_VIS_SUB_NO_CANDIDATE;
                } else {
                    exec[j]    = c;
                    outcome[j] = LLAMA_VIS_SUB_SUBSTITUTED;
                    used[c]    = 1;
                    n_sub++;
                }
            }
        }
        for (int64_t r = 0; r < k; ++r) {
            used[ids[r]] = 0;
            used[exec[t * k + r]] = 0;
        }
    }

    // a missing expert some pair still runs is loaded for the pass anyway: its other pairs go back to it
    auto replaced = [&](int64_t j) {
        return outcome[j] == LLAMA_VIS_SUB_SUBSTITUTED || outcome[j] == LLAMA_VIS_SUB_DROPPED;
    };
    std::vector<uint8_t> loaded(n_expert, 0);
    for (int64_t j = 0; j < n_pairs; ++j) {
        if (!resident[in.ids[j]] && !replaced(j)) {
            loaded[in.ids[j]] = 1;
        }
    }
    bool any = false;
    std::vector<uint8_t> tok_sub(in.n_tokens, 0);
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = in.ids[j];
        if (replaced(j) && loaded[e]) {
            exec[j]    = e;
            outcome[j] = LLAMA_VIS_SUB_NEEDED_ANYWAY;
        }
        if (replaced(j)) {
            any = true;
            tok_sub[j / k] = 1;
        }
        if (!resident[e]) {
            st.outcomes[outcome[j]]++;
        }
    }
    for (int e = 0; e < n_expert; ++e) {
        if (missing[e] && !loaded[e]) {
            background.push_back(e);
        }
    }
    for (uint8_t s : tok_sub) {
        st.n_tokens_substituted += s;
    }
    return any;
}

void vis_sub_apply_drops(float * weights, int64_t w_tok, int64_t w_rank, int64_t n_tokens, int k, const uint8_t * outcome,
                         bool renorm) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        float * w = weights + t * w_tok;
        double before = 0, after = 0;
        bool any = false;
        for (int r = 0; r < k; ++r) {
            before += (double) w[r * w_rank];
            if (outcome[t * k + r] == LLAMA_VIS_SUB_DROPPED) {
                w[r * w_rank] = 0.0f;
                any = true;
            }
            after += (double) w[r * w_rank];
        }
        if (renorm && any && after > 0) {
            const double f = before / after;
            for (int r = 0; r < k; ++r) {
                w[r * w_rank] = (float) ((double) w[r * w_rank] * f);
            }
        }
    }
}

vis_moe_substitute::vis_moe_substitute(const vis_moe_sub_settings & s, const llama_model & model,
                                       const std::vector<int> & managed)
    : cfg(s), layer_stats(model.hparams.n_layer()) {
    const int n_layer = (int) model.hparams.n_layer();
    if (!s.profile.empty()) {
        profile = std::make_unique<vis_buddy_profile>(vis_buddy_profile_load(s.profile, model));
    }
    int mode = s.mode;
    vis_sub_rule base;
    GGML_ASSERT(mode != VIS_SUB_AUTO && "auto is resolved by vis_moe_substitute_attach");
    if (mode == VIS_SUB_BUDDY && !profile) {
        throw std::runtime_error("vis-moe: --moe-substitute buddy needs buddy lists: set VIS_MOE_SUB_PROFILE=FILE "
                                 "(make it with: pyvis calibrate buddies -m MODEL --out FILE)");
    }
    if (s.tae_kind == VIS_TAE_PERCENTILE && !profile) {
        throw std::runtime_error("vis-moe: --moe-sub-tae p" + std::to_string(s.tae) + " is a percentile of the "
                                 "calibrated entropy: set VIS_MOE_SUB_PROFILE=FILE, or give an absolute TAU in 0..1");
    }
    base.mode   = mode;
    base.tau    = s.tae_kind == VIS_TAE_ABSOLUTE ? s.tae : -1;
    base.margin = s.margin;
    base.beta   = s.beta;
    base.budget = s.budget;
    base.weight = s.weight;
    base.rank   = s.rank;
    base.drop_share = s.drop_share;
    rules.assign(n_layer, base);
    for (int il : managed) {
        vis_sub_rule & r = rules[il];
        if (profile) {
            r.buddies = profile->buddies(il, 0);
            r.k_max   = profile->k_max;
        }
        if (s.tae_kind == VIS_TAE_PERCENTILE) {
            r.tau = profile->tae_percentile(il, s.tae);
            if (!std::isfinite(r.tau)) {
                throw std::runtime_error("vis-moe: VIS_MOE_SUB_PROFILE=" + s.profile + " has no entropy percentiles for "
                                         "layer " + std::to_string(il) + "; re-run pyvis calibrate buddies on text "
                                         "that reaches every layer");
            }
        }
    }
}

const char * vis_moe_substitute::mode_name() const {
    switch (cfg.mode) {
        case VIS_SUB_ROUTER: return "router";
        case VIS_SUB_BUDDY:  return "buddy";
        case VIS_SUB_DROP:   return "drop";
        case VIS_SUB_AUTO:   return "auto";
        default:             return "off";
    }
}

void vis_moe_substitute_attach(vis_moe_context & vm, const llama_model & model, const vis_moe_settings & s, bool file_store) {
    std::vector<int> managed;
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].managed) {
            managed.push_back((int) il);
        }
    }
    if (managed.empty()) {
        LLAMA_LOG_INFO("vis-moe: --moe-substitute: every MoE layer is resident, nothing to substitute (exact)\n");
        return;
    }
    if (s.sub.mode == VIS_SUB_AUTO) {
        // docs/substitution.md#the-shipped-default: on the real-weights testbed no setting was both faster than
        // exact and within 1 % perplexity at every measured point, so the one-switch setting is exact
        LLAMA_LOG_INFO("vis-moe: --moe-substitute auto: exact (no substitution setting measured both faster and "
                       "within 1 %% perplexity on the testbed; choose router or buddy and its gates explicitly)\n");
        return;
    }
    vm.sub = vm.add(std::make_unique<vis_moe_substitute>(s.sub, model, managed));
    if (file_store) {
        vm.fetch = std::make_unique<vis_moe_fetcher>(1, s.tier.direct_io);
    }
    const auto & u = s.sub;
    if (u.mode == VIS_SUB_DROP) {
        bool gpu = false;
        for (int il : managed) {
            gpu = gpu || !vm.layers[il].cpu_passes;
        }
        LLAMA_LOG_INFO("vis-moe: cache-aware dropping (lossy): --moe-substitute drop: a decode token skips a missing "
                       "expert whose share of its gate weight is < %g x 1/k, renorm %s, prefill %s; the expert is %s%s\n",
                       u.drop_share, u.renorm ? "on" : "off", u.prefill ? "on" : "off",
                       u.drop_read ? "read in the background" : "not read (--moe-sub-drop-read off)",
                       gpu ? " (managed layers computed off the CPU never drop: their gate weights are not ours to zero)"
                           : "");
        return;
    }
    char tae[48];
    if (u.tae_kind == VIS_TAE_OFF) {
        std::snprintf(tae, sizeof(tae), "off");
    } else {
        std::snprintf(tae, sizeof(tae), u.tae_kind == VIS_TAE_PERCENTILE ? "p%g" : "%g", u.tae);
    }
    LLAMA_LOG_INFO("vis-moe: substitution on a miss (lossy): --moe-substitute %s, tae %s, margin %s, beta %g, budget %d, "
                   "weight < %g, rank %d, prefill %s%s%s\n", vm.sub->mode_name(), tae,
                   u.margin < 0 ? "off" : std::to_string(u.margin).c_str(), u.beta, u.budget, u.weight, u.rank,
                   u.prefill ? "on" : "off", u.profile.empty() ? "" : ", profile ", u.profile.c_str());
}

std::vector<int32_t> vis_moe_substitute_plan(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                             vis_ubatch_plan & plan, const ggml_tensor * ids, const ggml_tensor * weights,
                                             const ggml_tensor * scores) {
    plan.sub_active = false;
    std::vector<int32_t> background;
    if (!vm.sub) {
        return background;
    }
    const vis_sub_rule & rule = vm.sub->rule(il);
    vis_sub_input in;
    in.k        = (int) ids->ne[0];
    in.n_tokens = ids->ne[1];
    in.ids      = (const int32_t *) ids->data;
    in.weights  = (const float *) weights->data;
    in.w_rank   = (int64_t) (weights->nb[1] / sizeof(float));
    in.w_tok    = (int64_t) (weights->nb[2] / sizeof(float));
    if (scores) {
        in.scores = (const float *) scores->data;
        in.s_tok  = (int64_t) (scores->nb[1] / sizeof(float));
    }
    const bool drop    = rule.mode == VIS_SUB_DROP;
    // a drop zeroes the pair's gate weight in the CPU's copy: on a layer computed elsewhere nothing is eligible
    in.decode          = vm.ub_decode && (!drop || L.cpu_passes);
    in.prefill_allowed = vm.sub->settings().prefill && (!drop || L.cpu_passes);
    const int64_t n_pairs = in.n_tokens * in.k;
    plan.exec.resize(n_pairs);
    plan.outcome.resize(n_pairs);
    std::vector<uint8_t> resident(L.n_expert);
    for (int e = 0; e < L.n_expert; ++e) {
        resident[e] = L.slots.resident(e) ? 1 : 0;
    }
    if (rule.mode == VIS_SUB_ROUTER && !in.scores) {
        throw std::runtime_error("vis-moe: router substitution without router scores (graph bug)");
    }
    plan.sub_active = vis_sub_decide(rule, L.n_expert, resident, in, plan.exec.data(), plan.outcome.data(), background,
                                     vm.sub->stats(il));
    if (plan.sub_active && drop) {
        vis_sub_apply_drops((float *) weights->data, in.w_tok, in.w_rank, in.n_tokens, in.k, plan.outcome.data(),
                            vm.sub->settings().renorm != 0);
    }
    vm.sub->stats(il).bytes_saved += (int64_t) background.size() * L.expert_bytes;
    return background;
}

void vis_moe_substitute::plan_collected(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                        const std::vector<vis_fetch_done> & done, int64_t waited_us, const int32_t * ids,
                                        int64_t n_pairs) {
    (void) vm;
    (void) L;
    (void) ids;
    (void) n_pairs;
    for (const auto & d : done) {
        if (!d.speculative) {  // a demand background read was late (stand-ins' experts, precision's refetch)
            layer_stats[il].bg_wait_us += waited_us;
            return;
        }
    }
}

void vis_moe_substitute::plan_route(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                                    const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * scores) {
    background = vis_moe_substitute_plan(vm, L, il, plan, ids, weights, scores);
}

void vis_moe_substitute::plan_reads(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan) {
    (void) L;
    (void) il;
    // several passes: every slot may serve a later pass of this ubatch.  --moe-sub-drop-read off: a dropped
    // expert's bytes are saved, not read later
    if (!background.empty() && vm.fetch && plan.passes.size() <= 1 && (cfg.mode != VIS_SUB_DROP || cfg.drop_read)) {
        for (int e : background) {
            plan.read(e, VIS_READ_STAND_IN, false);  // into slots no pair uses; the first without one ends them
        }
    }
    background.clear();
}

void vis_moe_substitute::plan_applied(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                      const vis_ubatch_plan & plan) {
    (void) vm;
    (void) L;
    for (const auto & r : plan.reads) {
        layer_stats[il].bg_fetches += r.why == VIS_READ_STAND_IN && r.done == VIS_READ_QUEUED ? 1 : 0;
    }
}
