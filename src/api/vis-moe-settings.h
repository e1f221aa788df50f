// vis-moe-settings.h - every --moe-* setting, declared once (src/api/vis-moe-settings.cpp).
//
// One table holds each flag's name, VIS_MOE_* variable, value hint, help and
// parser.  Patch 0003 registers the table's rows with common/arg.cpp in one loop;
// llama-bench (its own parser) gets the same settings from the variables.  Values
// are parsed once, strictly, into typed fields: a bad value is an error naming the
// flag (or variable) and its range, never a silent default.
//
// The settings in force on a thread: its override (llama_vis_moe_set_thread_params),
// else the process-wide ones (environment, then flags and the set_* calls).
#pragma once

#include "llama-vis.h"

#include <cstdint>
#include <string>

// --moe-substitute: the rule (docs/substitution.md); auto = the shipped setting; drop = cache-aware dropping (the
// missing low-share expert is skipped, no stand-in runs)
enum vis_sub_mode : int32_t { VIS_SUB_OFF = 0, VIS_SUB_ROUTER, VIS_SUB_BUDDY, VIS_SUB_AUTO, VIS_SUB_DROP };
enum vis_sub_tae_kind : int32_t { VIS_TAE_OFF = 0, VIS_TAE_ABSOLUTE, VIS_TAE_PERCENTILE };

// substitution on a miss and its gates (lossy; every field off by default)
struct vis_moe_sub_settings {
    int32_t     mode     = VIS_SUB_OFF;
    std::string profile;               // buddy lists and TAE quantiles (pyvis calibrate buddies), "" = none
    int32_t     tae_kind = VIS_TAE_OFF;
    double      tae      = 0;          // tau (absolute), or the percentile 0..100 of the profile's layer quantiles
    double      margin   = -1;         // gamma; < 0 = off
    double      beta     = 1;          // batch gate: bypass when the missing share of a layer's experts is > beta
    int32_t     budget   = 1;          // rho: substitutions per token per layer
    double      weight   = 1;          // substitute only experts whose share of the token's gate weight is < weight
    int32_t     rank     = 0;          // substitute only the token's `rank` lowest-ranked experts (0 = any)
    bool        prefill  = false;      // also in prefill ubatches
    double      drop_share = 0.5;      // drop: only experts whose share is < drop_share / k (a fraction of an even split)
    int32_t     renorm   = 0;          // drop: scale the token's remaining weights back to their sum before the drop
    int32_t     drop_read = 1;         // drop: read the dropped expert in the background (so later tokens may hit it)
    bool        mode_given = false;    // --moe-substitute was given (its getter shows "" when it was not)

    bool on() const { return mode != VIS_SUB_OFF; }
};

// --moe-mode: exact (the default: nothing lossy) or fast (a fixed, measured set of lossy mechanisms;
// vis-moe-mode.h, docs/mode.md)
enum vis_run_mode : int32_t { VIS_MODE_EXACT = 0, VIS_MODE_FAST };

// --moe-predict: which predictor drives prefetch (docs/prediction.md); auto = the shipped setting
// (mlp comes last so that the values of the others stay as they were)
enum vis_predict_mode : int32_t { VIS_PRED_OFF = 0, VIS_PRED_NEXT_ROUTER, VIS_PRED_COACT, VIS_PRED_FREQ, VIS_PRED_RANDOM,
                                  VIS_PRED_AUTO, VIS_PRED_MLP };
constexpr int VIS_MAX_LOOKAHEAD = 4;  // layers ahead a prediction reaches (--moe-lookahead)

// lookahead prediction and prefetch (exact: only when bytes arrive changes)
struct vis_moe_predict_settings {
    int32_t mode      = VIS_PRED_OFF;
    int32_t lookahead = 1;             // W: predict layers l+1 .. l+W
    int32_t budget    = -1;            // B: experts prefetched per layer per step, -1 = the model's top-k
    int32_t tune      = 1;             // self-tuning: switch a layer's prefetch off while it wastes more than it uses
    std::string profile;               // predictor profile: seeds coact / freq, holds mlp's weights (pyvis calibrate
                                       // predictor), "" = none

    bool on() const { return mode != VIS_PRED_OFF; }
};

// --moe-precision: when a miss may run from its low-bit shadow (docs/precision.md); all = every miss (tests, the
// worst case); auto = vision and gate under the stall controller
enum vis_prec_mode : int32_t { VIS_PREC_OFF = 0, VIS_PREC_VISION, VIS_PREC_GATE, VIS_PREC_ALL, VIS_PREC_AUTO };

// shadow experts and the precision policy (lossy; off by default)
struct vis_moe_prec_settings {
    std::string shadow;               // --moe-shadow: shadow-expert sidecar (pyvis shadow), "" = none
    int32_t mode         = VIS_PREC_OFF;
    double  vision       = 0.5;       // a ubatch whose share of image tokens is >= this is vision-dominated
    double  gate         = 0.1;       // gate rule: a missing expert whose gate weight is < this for every token
    double  target       = 0.25;      // auto: the stall share the controller keeps the ubatches under
    int32_t refetch      = 1;         // read the full-precision expert of a shadow hit in the background
    int32_t shadow_slots = -1;        // shadow slots per managed layer, -1 = as many as full slots

    bool on() const { return mode != VIS_PREC_OFF; }
};

// entropy-weighted capacity (lossy; off by default): --moe-capacity, --moe-cap-*
struct vis_moe_cap_settings {
    int32_t capacity = -1;            // distinct missing image-only experts per layer and ubatch; -1 off, 0 auto (slots)
    double  rho      = 1.0;           // adaptation strength
    double  delta    = 1.0;           // entropy sensitivity of the image tokens' weights
    int32_t drop     = 1;             // drop a pair with no reroute target (CPU), else load its expert
    std::string profile;              // modality profile (pyvis calibrate modality), "" = no bias

    bool on() const { return capacity >= 0; }
};

// the --moe-mem configurator (vis-moe-configure.cpp, docs/planning.md): its switch and its cost model's knobs
struct vis_moe_plan_settings {
    int32_t configure = -1;           // VIS_MOE_CONFIGURE: under --moe-mem, lower the ubatch where it buys slots:
                                      // -1 auto (only where outputs stay bit-identical: F32 weights), 1 on, 0 off
    double  read_mbps = 0;            // VIS_MOE_READ_MBPS: expert read bandwidth, MiB/s (0 = probed and cached)
    double  mem_mbps  = 0;            // VIS_MOE_MEM_MBPS: weight MiB/s of a matmul at one token (0 = probed and cached)
    double  token_ns_per_mib = -1;    // VIS_MOE_TOKEN_NS_PER_MIB: prefill compute, ns per token per MiB of weights (-1 = probed)
    double  pass_us   = -1;           // VIS_MOE_PASS_US: cost of one extra pass of one layer, microseconds (-1 = probed) ...
    double  pass_token_us = -1;       // VIS_MOE_PASS_TOKEN_US: ... plus this per token of the ubatch (docs/planning.md)
    int32_t probe_cache = -1;         // VIS_MOE_PROBE_CACHE: cache the compute probe: -1 auto (not on a busy machine),
                                      // 1 always, 0 never (probed at every start)
    int32_t prompt    = 512;          // VIS_MOE_PLAN_PROMPT: prompt tokens of the request the plan is priced for
    int32_t gen       = 128;          // VIS_MOE_PLAN_GEN: generated tokens of that request
    std::string slot_split;           // VIS_MOE_SLOT_SPLIT: a split file, per-layer slot counts at attach ("" = equal)
    int32_t online    = 0;            // VIS_MOE_ONLINE: the online controller (features/vis-moe-online.h), 1 on, 0 off
    int32_t borrow    = -1;           // VIS_MOE_BORROW: decode ubatches borrow the compute buffer's idle bytes as
                                      // expert slots (features/vis-moe-borrow.h), -1 auto (where it applies, silent
                                      // where it does not), 1 on (the plan line says why where it does not), 0 off
    int32_t encoder_release = 0;      // VIS_MOE_ENCODER_RELEASE: the encoder's bytes become slots once a single-turn
                                      // VLM tool has freed it (features/vis-moe-encoder-release.h), 1 on, 0 off
};

struct vis_moe_settings {
    llama_vis_moe_params      params = {};  // params.trace_path is not used here: see trace_path
    llama_vis_moe_tier_params tier   = {};
    std::string trace_path;                 // routing trace file, "" = off
    std::string csv_path;                   // --moe-csv: per-ubatch telemetry rows (vis-moe-csv.h), "" = off
    std::string replay_path;                // VIS_MOE_REPLAY: a recorded routing trace replayed (benchmarks), "" = off
    int32_t     stream_passes = 8;          // a ubatch needing more passes than this in a layer streams it (0 = never)
    int32_t     stream_ahead  = 0;          // a streamed layer has the next managed layer's experts read ahead
    int32_t     stream_lend   = -1;         // a streamed ubatch lends the slabs to the page cache (-1 auto, 0, 1)
    int32_t     stream_stage  = 1;          // streamed layers are read into staging buffers in the slabs when they fit
    int32_t     overlap       = -1;         // decode misses read while the layer computes: -1 on (up to k miss passes), 0 off, N
    int64_t     pin_mib = -1;               // discrete GPU: cap on pinned host memory, MiB (-1 = 25 % of MemTotal, 0 = none)
    int32_t     policy  = 2;                // eviction policy of the full slots (vis_policy_kind: 0 lru, 1 lfu, 2 lfu-adapt; default lfu-adapt: docs/policies.md)
    vis_moe_sub_settings sub;               // --moe-substitute and --moe-sub-*
    vis_moe_predict_settings predict;       // --moe-predict*, --moe-lookahead, --moe-prefetch-*
    vis_moe_prec_settings prec;             // --moe-shadow, --moe-precision, --moe-prec-*, --moe-shadow-slots
    vis_moe_cap_settings  cap;              // --moe-capacity, --moe-cap-*
    int32_t     topk = 0;                   // --moe-topk: experts each token runs (lossy), 0 = the model's k
    int32_t     mode = VIS_MODE_EXACT;      // --moe-mode (resolved into the fields above at context creation)
    vis_moe_plan_settings plan;             // VIS_MOE_CONFIGURE, VIS_MOE_READ_MBPS, VIS_MOE_PASS_US, VIS_MOE_PLAN_*

    // is the expert cache asked for (any of slots, cache budget, memory budget)?
    bool cache_on() const { return params.n_slots > 0 || params.cache_mib > 0 || tier.mem_mib != 0; }
};

// ---- the table (vis-moe-settings-table.cpp) ----------------------------------
// one --moe-* setting: its flag, variable, value hint (nullptr: a flag without a value, its variable takes on/off),
// help, the strict parser that applies a value (throws std::invalid_argument naming `what` and the range), and who
// decides it (llama-vis.h, LLAMA_VIS_MOE_SCOPE_*): a user flag shown in the tools' --help, or an engine knob set by
// its VIS_MOE_* variable (docs/knobs.md; its old flag spelling still parses, with a deprecation line); what its value
// is (LLAMA_VIS_MOE_VALUE_*); the value of a settings value spelled as the flag takes it (apply(show(s)) gives the
// same setting; "" = unset); and, for a row whose value may be unset (a file, --moe-substitute not given), what makes
// it unset
struct vis_moe_flag_row {
    const char * name;
    const char * env;
    const char * hint;
    const char * help;
    void (*apply)(vis_moe_settings & s, const std::string & what, const std::string & value);
    int32_t scope;
    int32_t type;
    std::string (*show)(const vis_moe_settings & s);
    void (*clear)(vis_moe_settings & s) = nullptr;
};
const vis_moe_flag_row * vis_moe_flag_rows(int & n);
// a variable without a flag (benchmark knobs: never on a command line, so no tool parses them as options;
// llama-server refuses VIS_MOE_REPLAY): its value hint, help and strict parser
struct vis_moe_env_row {
    const char * env;
    const char * hint;
    const char * help;
    void (*apply)(vis_moe_settings & s, const std::string & what, const std::string & value);
};
const vis_moe_env_row * vis_moe_env_rows(int & n);
// [+-]digits and nothing else, within [lo, hi]: the value; else std::invalid_argument
// "WHAT: expected an integer in LO..HI<note>, got 'V'" (the table's parser, shared with other variables)
long long vis_parse_int(const std::string & what, const std::string & v, long long lo, long long hi,
                        const char * note = "");
vis_moe_settings vis_moe_settings_builtin();
// every field in range (the C API takes structs, the CLI strings); throws std::invalid_argument naming the flag
void vis_moe_settings_validate(const vis_moe_settings & s);

// The settings in force on the calling thread.  Throws std::runtime_error naming the
// variable when they come from an environment with an invalid VIS_MOE_* value.
vis_moe_settings vis_moe_settings_current();

// Model load (patch 0004): defer the routed experts of managed layers to the file tier?
// true, with n_pinned = the pinned prefix, when the cache with the file store is on and
// n_expert experts would not all fit the slots.
bool vis_moe_settings_deferral(int & n_pinned, int64_t n_expert);

// --moe-mem sizes the cache (no --moe-slots / --moe-cache-mib, store = file) and a model of
// model_bytes fits the budget whole (with the runtime floor of llama_vis_moe_estimate_reserve and
// 10 % left for KV cache and compute): then nothing is deferred or managed, and upstream's path runs.
bool vis_moe_settings_model_fits(int64_t model_bytes);
// Model load (patch 0004): --moe-mem with flags that keep every expert resident (--moe-pinned-layers -1,
// --moe-slots >= n_expert) defers nothing, so the whole model must fit the budget: throws std::runtime_error
// naming the flags, the budget and the smallest one that fits, before anything is loaded.
void vis_moe_settings_check_resident(int64_t model_bytes, int64_t n_expert);
// the same settings, at context creation: a model loaded without deferral runs upstream's path
bool vis_moe_settings_mem_only(const vis_moe_settings & s);
