// vis-moe-profile.h - calibrated profiles of a model (GGUF sidecars written by pyvis) and the model
// fingerprint they are checked against (docs/substitution.md#profile-format).
//
// The buddy profile (pyvis calibrate buddies) holds, per MoE layer, each expert's buddy list (BuddyMoE's
// CFT lists, best first) and the percentiles of the layer's token routing entropy (TAE) on the calibration
// text.  The predictor profile (pyvis calibrate predictor; docs/prediction-calibration.md#profile-format-gguf-sidecar) holds the expert
// frequencies and the co-activation tables P_d[l][i, j] that seed --moe-predict coact / freq.  Both share one
// header and fingerprint check: a profile made for another model, of the other kind, a truncated, unreadable or
// foreign file: std::runtime_error naming the flag, the file, what differs, and the command that makes one.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

struct llama_model;
struct gguf_context;

// ---- the header every sidecar shares (profiles and shadows, docs/shadow.md) ----
// a kind of sidecar: vis.profile.kind, the flag that reads it and the command that makes one (the fix)
struct vis_profile_kind {
    const char * kind;
    const char * flag;  // a user flag (--moe-*) or an engine knob's variable (VIS_MOE_*)
    const char * make;
};
extern const vis_profile_kind VIS_PROFILE_SHADOW;    // --moe-shadow (vis-moe-shadow.h)
extern const vis_profile_kind VIS_PROFILE_MODALITY;  // VIS_MOE_CAP_PROFILE (vis-moe-modality.h)

// an open sidecar file: its GGUF contexts, and errors that name the flag, the file and the fix
struct vis_profile_file {
    const vis_profile_kind & pk;
    std::string path;
    gguf_context * g   = nullptr;
    ggml_context * ctx = nullptr;   // tensor metadata (and data, unless opened meta_only)

    vis_profile_file(const vis_profile_kind & k, const std::string & p) : pk(k), path(p) {}
    vis_profile_file(const vis_profile_file &) = delete;
    vis_profile_file & operator=(const vis_profile_file &) = delete;
    ~vis_profile_file();

    std::runtime_error error(const std::string & what) const;
    std::string str(const char * key) const;    // a string key, else error
    uint64_t    uint(const char * key) const;   // a u32 / u64 key, else error
    // tensor `name` of exactly this type and ne, else error
    const ggml_tensor * tensor(const char * name, ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2,
                               int64_t ne3 = 1) const;
};

// open f.path and check it: a GGUF, a sidecar of kind f.pk, version 1, made for `model` (architecture, layers,
// experts, router hash: the first that differs is named).  meta_only: read the header and tensor infos, not the
// tensor data (a shadow sidecar is read per expert later, never whole).
void vis_profile_open(vis_profile_file & f, const llama_model & model, bool meta_only);

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

struct vis_predict_profile {
    std::string path;
    int n_layer   = 0;
    int n_expert  = 0;
    int k         = 0;                       // top-k of the calibration routing
    uint64_t n_tokens = 0;                   // tokens the tables were fitted on
    int lookahead = 0;                       // W: the tables cover d = 1..W
    std::string weighting;                   // "conditional" or "count"
    std::vector<float> freq;                 // [n_layer][n_expert]: share of layer l's tokens that selected e
    std::vector<float> coact;                // [W][n_layer][n_expert][n_expert]: P_d[l][i, j], rows sum to 1 or 0

    // the VisMMOE lookahead MLP (--moe-predict mlp; optional: mlp_lookahead == 0 when the profile has none).
    // Source layer l (mlp_layer[l] != 0): x = [hist (n_expert); hidden (mlp_n_embd)], a = relu(w1 x + b1),
    // y = w2 a + b2, the score of expert e at layer l+d = sigmoid(y[(d-1) n_expert + e]), d = 1..mlp_lookahead.
    // hist[e] = sum_{j < mlp_history} mlp_history_decay^j [e routed at MoE layer l-j] (docs/prediction-calibration.md)
    int   mlp_lookahead = 0;
    int   mlp_hidden    = 0;                 // H
    int   mlp_n_embd    = 0;
    int   mlp_history   = 0;                 // routing-history layers (>= 1: layer l itself)
    float mlp_history_decay = 0.0f;
    std::vector<int32_t> mlp_layer;          // [n_layer]: 1 = a trained source layer
    std::vector<float> mlp_w1;               // [n_layer][H][n_expert + n_embd]
    std::vector<float> mlp_b1;               // [n_layer][H]
    std::vector<float> mlp_w2;               // [n_layer][mlp_lookahead * n_expert][H]
    std::vector<float> mlp_b2;               // [n_layer][mlp_lookahead * n_expert]
    bool has_mlp() const { return mlp_lookahead > 0; }

    float freq_at(int il, int e) const { return freq[(size_t) il * n_expert + e]; }
    // P_d[l][i, :], d = 1..lookahead
    const float * row(int d, int il, int i) const {
        return coact.data() + (((size_t) (d - 1) * n_layer + il) * n_expert + i) * n_expert;
    }
};

// load and check `path` against `model` (--moe-predict-profile)
vis_predict_profile vis_predict_profile_load(const std::string & path, const llama_model & model);
