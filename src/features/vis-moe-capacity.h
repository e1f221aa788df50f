// vis-moe-capacity.h - entropy-weighted capacity (lossy; --moe-capacity, docs/precision.md, issue #14 item 3).
//
// MACS on one device.  The scarce resource is not a straggler GPU but the bytes of experts that are not in memory.
// Per managed layer and ubatch with image tokens:
//   1. each token's load weight (vis-moe-modality.h): text 1, image sigmoid(-delta * z-scored entropy);
//   2. the effective visual ratio R_v = (sum of image weights) / (sum of all weights);
//   3. a capacity on the distinct missing experts that only image tokens route:
//        C = round(N * (1 + rho * (R_v - 0.5)))        N = --moe-capacity (auto: the layer's slot count)
//      (an image whose tokens are mostly flat background has a low R_v and gets less room);
//   4. those experts ranked by their entropy-weighted load L_j = sum of the weights of the image tokens routing them,
//      scaled as MACS scales capacity by the expert's modality bias m_j (+1 visual, -1 text, 0 shared; from
//      --moe-cap-profile, else 0): P_j = L_j * (1 + rho * m_j * (R_v - 0.5)); the top C are loaded;
//   5. the pairs of the other ("overflow") experts, tokens of lowest weight first, are rerouted to the expert with the
//      highest router score among those in memory for this ubatch (resident, loaded for text, or within capacity)
//      that the token does not already run: never a duplicate; the stand-in takes the pair's gate weight, as
//      substitution does;
//   6. a pair with no such expert is dropped (its gate weight set to 0, on the CPU: --moe-cap-drop on), else (GPU,
//      or --moe-cap-drop off) its expert is loaded after all ("forced").
// Experts some text token routes are always loaded, and text tokens are never rerouted: a text-only ubatch is
// unchanged (byte-identical).  Streamed ubatches (more passes than --moe-stream-passes) run upstream's graph.
#pragma once

#include "llama-vis.h"
#include "vis-moe-feature.h"
#include "vis-moe-settings.h"

#include <cstdint>
#include <memory>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;
struct ggml_tensor;
struct llama_model;

struct vis_cap_rule {
    int    base = 0;                 // N: distinct missing image-only experts per layer and ubatch
    double rho  = 1.0;
    bool   drop = true;              // a pair without a target is dropped (else its expert is forced in)
    int    max_loads = -1;           // experts it may load (within capacity and forced) at most, -1 = no bound
    const int8_t * bias = nullptr;   // [n_expert] modality bias, null = all shared
};

struct vis_cap_input {
    const int32_t * ids    = nullptr;  // [n_tokens][k] the experts the pairs run
    const float *   scores = nullptr;  // router score of expert e for token t at scores[t * s_tok + e]
    int64_t s_tok    = 0;
    int64_t n_tokens = 0;
    int     k        = 0;
    const float *   tok_w = nullptr;   // [n_tokens] load weights (text 1)
    const uint8_t * image = nullptr;   // [n_tokens] 1 = image token; null = all text (nothing to do)
};

// the decision for one layer and ubatch (pure: testable by hand).  exec [n_tokens * k]: in, the experts the pairs
// run; out, with reroutes.  dropped [n_tokens * k]: 1 for a dropped pair (its exec is left pointing at an expert in
// memory the token already runs, so its row is computed and multiplied by 0).  Adds to st; returns whether any
// pair changed.
bool vis_cap_decide(const vis_cap_rule & rule, int n_expert, const std::vector<uint8_t> & resident,
                    const vis_cap_input & in, int32_t * exec, uint8_t * dropped, llama_vis_moe_cap_stats & st);

struct vis_modality_profile;

// pass 0 of a managed layer, after substitution and before the precision policy: the capacity applied to this
// ubatch's pairs (plan.exec, plan.sub_active; dropped pairs' gate weights zeroed in `weights`).  No-op without image
// tokens.
void vis_moe_capacity_plan(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                           const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * scores);

// the capacity of a context: its rule, the experts' modality bias, per layer what it rerouted and dropped
class vis_moe_capacity : public vis_moe_feature {
public:
    vis_moe_capacity(const vis_cap_rule & rule, std::unique_ptr<vis_modality_profile> profile, int n_layer);
    ~vis_moe_capacity() override;

    const vis_cap_rule & rule() const { return cap_rule; }
    const vis_modality_profile * profile() const { return bias.get(); }
    llama_vis_moe_cap_stats & stats(int il) { return layer_stats[il]; }
    const llama_vis_moe_cap_stats & stats(int il) const { return layer_stats[il]; }

    // the feature (vis-moe-feature.h): the capacity table; an image ubatch's passes bounded (vis_moe_capacity_passes)
    const char * feature_name() const override { return "capacity"; }
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override;
    int  image_pass_bound(const vis_moe_context & vm, const vis_moe_layer & L) const override;
    void plan_route(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                    const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * scores) override {
        vis_moe_capacity_plan(vm, L, il, plan, ids, weights, scores);  // image pairs over capacity rerouted
    }
    bool wants_scores(const vis_moe_context &, int) const override { return true; }  // reroutes choose by score

private:
    vis_cap_rule cap_rule;
    std::unique_ptr<vis_modality_profile> bias;
    std::vector<llama_vis_moe_cap_stats> layer_stats;
};

// context creation: the rule of --moe-capacity (and the modality profile of --moe-cap-profile), or nothing when off.
// Throws std::runtime_error naming the flag (a bad profile).
void vis_moe_capacity_attach(vis_moe_context & vm, const llama_model & model, const vis_moe_settings & s);

// the full-precision passes the capacity bounds an image ubatch of layer L to: the hits (at most its slots) and the
// experts it may load, C at most round(N (1 + rho / 2)): 1 + ceil(C / slots).  0 when it bounds nothing (off, or
// drops impossible: a GPU layer or --moe-cap-drop off, where a pair without a target forces its expert in)
int vis_moe_capacity_passes(const vis_moe_context & vm, const vis_moe_layer & L);

// the totals of every layer
void vis_moe_total_cap_stats(const vis_moe_context & vm, llama_vis_moe_cap_stats & out);
