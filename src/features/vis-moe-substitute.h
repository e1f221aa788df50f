// vis-moe-substitute.h - substitution on a miss (lossy; --moe-substitute, docs/substitution.md).
//
// Runs in the first pass op of a managed layer, after routing and before the pass plan: a (token, expert)
// pair whose expert has no slot may run a resident stand-in instead, with the missing expert's gate weight
// (only the ids of the three mul_mat_id change).  The gates of BuddyMoE decide who may: the token's routing
// entropy (TAE, tau), its top-1/top-2 margin (gamma), the share of the ubatch's experts that are missing
// (beta), a per-token budget (rho) and the expert's share of the token's weight.  Experts all of whose
// pairs got a stand-in are read in the background (vis-moe-fetch.h) so later tokens hit.
#pragma once

#include "vis-moe-feature.h"
#include "llama-vis.h"
#include "vis-moe-profile.h"
#include "vis-moe-settings.h"

#include <cstdint>
#include <memory>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;
struct ggml_tensor;

// the rule of one layer, settings resolved (auto, percentiles)
struct vis_sub_rule {
    int     mode    = VIS_SUB_ROUTER;  // VIS_SUB_ROUTER, VIS_SUB_BUDDY or VIS_SUB_DROP
    double  tau     = -1;              // < 0: no TAE gate
    double  margin  = -1;              // < 0: no margin gate
    double  beta    = 1;
    int     budget  = 1;
    double  weight  = 1;
    int     rank    = 0;               // only the `rank` lowest-ranked of a token's k experts (0 = any)
    double  drop_share = 0.5;          // drop mode: only pairs whose share is < drop_share / k
    const int32_t * buddies = nullptr; // buddy mode: [n_expert][k_max], best first, -1 padded
    int     k_max   = 0;
};

// one layer's routing of one ubatch, as the pass op sees it
struct vis_sub_input {
    const int32_t * ids     = nullptr;  // [n_tokens][k] routed experts
    const float *   weights = nullptr;  // gate weight of (token t, rank r) at weights[t * w_tok + r * w_rank]
    int64_t w_tok = 0, w_rank = 0;
    const float *   scores  = nullptr;  // router score of expert e for token t at scores[t * s_tok + e]; router mode
    int64_t s_tok = 0;
    int64_t n_tokens = 0;
    int     k        = 0;
    bool    decode   = true;            // every sequence of the ubatch has one token
    bool    prefill_allowed = false;
};

// TAE of one token: -sum p ln p / ln k over its k gate weights renormalised to sum 1 (k = 1: 0); -1 if the
// weights do not sum to a positive finite value.  Also the margin p(1st) - p(2nd) (k = 1: 1).
double vis_sub_tae(const float * w, int64_t stride, int k, double * margin);

// The decision for one layer and ubatch (pure: no slot table, testable by hand): exec [n_tokens*k] = the
// expert each pair runs, outcome [n_tokens*k] = llama_vis_sub_outcome, background = missing experts all of
// whose pairs got a stand-in or were dropped (to read off the critical path).  Adds to st.  Returns true if any
// pair runs a stand-in or is dropped.
// Drop mode (cache-aware dropping): a missing pair that passes the gates (not the budget) and whose share of the
// token's weight is < drop_share / k is DROPPED: its exec is a resident expert the token runs (else any resident
// one), and the caller sets its gate weight to 0 (vis_sub_apply_drops).  A token always keeps its largest-share
// expert (a share >= 1/k).
bool vis_sub_decide(const vis_sub_rule & rule, int n_expert, const std::vector<uint8_t> & resident,
                    const vis_sub_input & in, int32_t * exec, uint8_t * outcome, std::vector<int32_t> & background,
                    llama_vis_moe_sub_stats & st);

// the gate weights of the dropped pairs of one ubatch set to 0 (weights as in vis_sub_input); with renorm, each
// token's remaining weights scaled so that their sum is what all k summed before
void vis_sub_apply_drops(float * weights, int64_t w_tok, int64_t w_rank, int64_t n_tokens, int k, const uint8_t * outcome,
                         bool renorm);

// the substitution state of a context: its settings, per-layer rules, the profile, per layer what it did
class vis_moe_substitute : public vis_moe_feature {
public:
    // throws std::runtime_error naming the flag on a bad combination (buddy without a profile, ...)
    vis_moe_substitute(const vis_moe_sub_settings & s, const llama_model & model, const std::vector<int> & managed);

    const vis_moe_sub_settings & settings() const { return cfg; }
    const vis_sub_rule & rule(int il) const { return rules[il]; }
    const char * mode_name() const;
    int rule_mode() const { return cfg.mode; }
    // per layer: missing pairs by outcome, background reads (llama_vis_moe_get_sub_stats)
    llama_vis_moe_sub_stats & stats(int il) { return layer_stats[il]; }
    const llama_vis_moe_sub_stats & stats(int il) const { return layer_stats[il]; }

    // the feature (vis-moe-feature.h): the substitution table of --moe-stats
    const char * feature_name() const override { return "substitution"; }
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override;
    void plan_collected(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                        const std::vector<vis_fetch_done> & done, int64_t waited_us, const int32_t * ids,
                        int64_t n_pairs) override;
    void plan_route(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                    const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * scores) override;
    void plan_reads(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan) override;
    void plan_applied(const vis_moe_context & vm, const vis_moe_layer & L, int il, const vis_ubatch_plan & plan) override;
    bool wants_scores(const vis_moe_context &, int il) const override { return rules[il].mode == VIS_SUB_ROUTER; }

private:
    std::vector<int32_t> background;  // the missing experts every pair of which runs a stand-in (plan_route)
    vis_moe_sub_settings cfg;
    std::unique_ptr<vis_buddy_profile> profile;
    std::vector<vis_sub_rule> rules;  // per layer
    std::vector<llama_vis_moe_sub_stats> layer_stats;
};

// context creation (vis-moe-attach.cpp): the substitution state of vm's managed layers, and the background
// reader when experts come from the file.  Throws std::runtime_error naming the flag (bad profile, buddy
// without a profile, ...).
void vis_moe_substitute_attach(vis_moe_context & vm, const llama_model & model, const vis_moe_settings & s, bool file_store);

// pass 0 of a managed layer, after its background reads were collected (vis_moe_fetch_collect): decide this
// ubatch's stand-ins (plan.exec, plan.outcome, plan.sub_active; a dropped pair's gate weight zeroed in weights).
// ids: [k, n_tokens]; weights [1, k, n_tokens]; scores [n_expert, n_tokens] or null.  Returns the missing experts
// every pair of which runs a stand-in (to read in the background).
std::vector<int32_t> vis_moe_substitute_plan(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                             vis_ubatch_plan & plan, const ggml_tensor * ids, const ggml_tensor * weights,
                                             const ggml_tensor * scores);
// the totals of every layer (zeros without substitution)
void vis_moe_total_sub_stats(const vis_moe_context & vm, llama_vis_moe_sub_stats & out);
