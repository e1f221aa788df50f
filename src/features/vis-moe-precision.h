// vis-moe-precision.h - the precision policy (lossy; --moe-precision, docs/precision.md, issue #14 item 2).
//
// ReaLB computes vision-heavy experts at lower precision when they would make the step wait; on one device the
// wait is for expert bytes from storage.  Here a managed layer's miss may run from its low-bit shadow (a shadow slot,
// vis-moe-shadow-slots.h) instead of waiting for the full-precision expert, which is then read in the background
// (the substitution machinery's reader, vis-moe-fetch.h) so later tokens hit it.  Who may, per layer and ubatch:
//   vision  experts routed only by image tokens, in a ubatch whose image-token share is >= --moe-prec-vision
//   gate    in a decode step, experts whose share of the token's gate weight is < --moe-prec-gate for every token
//           (HOBBIT's rule on the share, which does not depend on how a model scales its gate weights)
//   all     every miss (the worst case; the tests' reference)
//   auto    vision or gate, and a controller (AIMD on the measured stall share) decides how many of the eligible
//           misses, lowest gate weight first, actually run from shadows
// The choice is per expert, never per pair: an expert some text token routes is loaded in full precision for every
// token of the ubatch (text keeps full precision without an extra pass; the image tokens that share it gain
// nothing from a shadow, the expert is read anyway).  Hits always run in full precision.
#pragma once

#include "llama-vis.h"
#include "vis-moe-feature.h"
#include "vis-moe-settings.h"

#include <cstdint>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;
struct ggml_tensor;

// the rule of a ubatch, the controller's share resolved
struct vis_prec_rule {
    int    mode   = VIS_PREC_OFF;
    double vision = 0.5;
    double gate   = 0.1;
    double share  = 1;  // the share of the eligible misses served from shadows (lowest gate-weight share first)
};

// one layer's routing of one ubatch, as pass 0 sees it
struct vis_prec_input {
    const int32_t * ids     = nullptr;  // [n_tokens][k] the experts the pairs run
    const float *   weights = nullptr;  // gate weight of (token t, rank r) at weights[t * w_tok + r * w_rank]
    int64_t w_tok = 0, w_rank = 0;
    int64_t n_tokens = 0;
    int     k        = 0;
    const uint8_t * image = nullptr;    // per token: 1 = an image embedding; null = every token is text
    bool    decode   = false;           // every sequence of the ubatch has one token
};

// The decision for one layer and ubatch (pure: testable by hand).  serve[e] = 1 for each routed expert that is not
// resident (resident[e] == 0) and runs from its shadow.  Adds the eligible and served counts to st.  Returns the
// number served.
int vis_prec_decide(const vis_prec_rule & rule, int n_expert, const std::vector<uint8_t> & resident,
                    const vis_prec_input & in, std::vector<uint8_t> & serve, llama_vis_moe_prec_stats & st);

// Additive increase, multiplicative decrease of the served share on the measured stall share of each ubatch that
// had eligible misses: above the target, share += STEP (more shadows, less waiting); at or below it, share *= 1/2
// (back to precision while the reads keep up).  Starts at 1.
class vis_prec_controller {
public:
    static constexpr double STEP = 0.125;
    explicit vis_prec_controller(double target_) : target(target_) {}
    double  share() const { return s; }
    int64_t n_switches() const { return switches; }
    void update(int64_t stall_us, int64_t ubatch_us);

private:
    double  target;
    double  s = 1;
    int64_t switches = 0;
};

// the precision state of a context: its settings, the controller, per layer what the shadow slots served
class vis_moe_precision : public vis_moe_feature {
public:
    vis_moe_precision(const vis_moe_prec_settings & s, int n_layer) : cfg(s), ctl(s.target), layer_stats(n_layer) {}
    const vis_moe_prec_settings & settings() const { return cfg; }
    const char * mode_name() const;
    vis_prec_rule rule() const;

    void begin_ubatch() { eligible_seen = false; }
    // after the ubatch: the controller sees its stall share (auto only)
    void end_ubatch(vis_moe_context & vm, int64_t ubatch_us);
    const vis_prec_controller & controller() const { return ctl; }
    bool eligible_seen = false;  // some layer of the running ubatch had eligible misses
    // per layer: misses served from shadows (llama_vis_moe_get_prec_stats)
    llama_vis_moe_prec_stats & stats(int il) { return layer_stats[il]; }
    const llama_vis_moe_prec_stats & stats(int il) const { return layer_stats[il]; }

    // the feature (vis-moe-feature.h): the controller sees each ubatch's stall share; the precision table
    const char * feature_name() const override { return "precision"; }
    void ubatch_begin(vis_moe_context &, const llama_ubatch &) override { begin_ubatch(); }
    void ubatch_end(vis_moe_context & vm) override;
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override;
    void plan_serve(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                    const ggml_tensor * ids, const ggml_tensor * weights) override;
    void plan_reads(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan) override;
    void plan_applied(const vis_moe_context & vm, const vis_moe_layer & L, int il, const vis_ubatch_plan & plan) override;

    std::vector<uint8_t> staged_serve;  // the stream op's decision for a layer staged from its shadows (scratch)

private:
    vis_moe_prec_settings cfg;
    vis_prec_controller   ctl;
    int64_t               stall0_us = 0;  // the layers' load time at the start of the ubatch
    std::vector<llama_vis_moe_prec_stats> layer_stats;
};

// context creation, after the slabs and --moe-shadow's loader: the shadow slots and the precision state, or nothing
// when --moe-precision is off.  Throws std::runtime_error naming the flag (no --moe-shadow, ...).
void vis_moe_precision_attach(vis_moe_context & vm, const vis_moe_settings & s, int n_shadow_slots, bool file_store);

// pass 0 of a managed layer, before the full-precision passes: which of the ubatch's misses run from shadows
// (serve[e] = 1; plan.shadow_serve).  ids: the experts the pairs run [k, n_tokens]; weights [1, k, n_tokens].
void vis_moe_precision_plan(const vis_moe_context & vm, const vis_moe_layer & L, const int32_t * ids,
                            const ggml_tensor * ids_t, const ggml_tensor * weights, std::vector<uint8_t> & serve);

// graph build of a streamed ubatch: does it run every routed expert of a layer from its shadow, so that staged
// streaming reads the layers' shadows (vis-moe-stage.h)?  Yes for `all`, and for an image ubatch (libmtmd: every
// token an embedding, so vision-dominated at any --moe-prec-vision and no expert routed by text) under vision, or
// auto at the controller's full share; else the layer is staged in full precision.
bool vis_moe_precision_stages_shadows(const vis_moe_context & vm, bool image_ubatch);
// the stream op of a layer staged from its shadows: the policy's decision (every routed expert a served miss, the
// slots being empty) and the stats: pairs, shadows read, bytes read and saved
void vis_moe_precision_staged(vis_moe_context & vm, vis_moe_layer & L, const ggml_tensor * ids_t,
                              const ggml_tensor * weights, int64_t n_routed);
// the totals of every layer, with the controller's state
void vis_moe_total_prec_stats(const vis_moe_context & vm, llama_vis_moe_prec_stats & out);
