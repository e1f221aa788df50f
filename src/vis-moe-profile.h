// vis-moe-profile.h - calibrated profiles of a model (GGUF sidecars written by pyvis) and the model
// fingerprint they are checked against (docs/substitution.md#profile-format).
//
// The buddy profile (pyvis calibrate buddies) holds, per MoE layer, each expert's buddy list (BuddyMoE's
// CFT lists, best first) and the percentiles of the layer's token routing entropy (TAE) on the calibration
// text.  A profile made for another model, a truncated or foreign file: std::runtime_error naming the file,
// what differs, and the fix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct llama_model;

// llama_vis_moe_router_hash (llama-vis.h): the hash of the routers' bytes; throws when unreadable
uint64_t vis_moe_router_hash(const llama_model & model);

struct vis_buddy_profile {
    int n_layer  = 0;
    int n_expert = 0;
    int k_max    = 0;
    int k        = 0;                        // top-k of the calibration run
    std::vector<int32_t> ids;                // [n_layer][n_expert][k_max], -1 padded
    std::vector<float>   q;                  // q(j|i) of each buddy
    std::vector<double>  tae_quantiles;      // [n_layer][101], NaN for layers without experts

    const int32_t * buddies(int il, int e) const { return ids.data() + ((size_t) il * n_expert + e) * k_max; }
    // the TAE at percentile pct (0..100) of layer il, linearly interpolated; NaN if the layer has none
    double tae_percentile(int il, double pct) const;
};

// load and check `path` against `model`
vis_buddy_profile vis_buddy_profile_load(const std::string & path, const llama_model & model);
