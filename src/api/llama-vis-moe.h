// llama-vis-moe.h - the build, expert residency and its settings table, stats, substitution, precision, capacity and prefetch.
// A section of llama-vis.h (include that), in its order; mirrored 1:1 by pyvis/runtime/capi_moe.py.
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Version of the fork, e.g. "0.1.0".
LLAMA_API const char * llama_vis_version(void);

// Pinned upstream llama.cpp commit the fork is built on, e.g. "0c1e570".
LLAMA_API const char * llama_vis_upstream_commit(void);

// Fragment appended to llama_print_system_info() by patch 0001:
// "VIS_MOE : VERSION = 0.1.0 | UPSTREAM = 0c1e570 | "
LLAMA_API const char * llama_vis_system_info(void);

// Shape of a model's Mixture-of-Experts part, as seen by the loaded model.
struct llama_vis_moe_info {
    int32_t  n_layer;          // transformer layers
    int32_t  n_moe_layers;     // layers with routed experts (*_exps tensors)
    int32_t  first_moe_layer;  // index of the first MoE layer, -1 if none
    int32_t  n_expert;         // routed experts per MoE layer
    int32_t  n_expert_used;    // experts selected per token (top-k, max over layers)
    int32_t  n_expert_shared;  // shared experts per layer (hparams; 0 if none)
    int32_t  has_shared_exp;   // 1 if any layer has *_shexp tensors
    int32_t  has_exp_bias;     // 1 if any layer has per-expert biases (*_exps_b)
    int32_t  has_gate_up_exp;  // 1 if any layer has a merged gate_up_exps tensor
    int64_t  expert_bytes;     // bytes of one routed expert in one layer (gate+up+down), max over layers
    int64_t  routed_bytes;     // bytes of all routed experts in all layers
};

// Fill *info for a loaded model. Returns 0 on success, -1 if model or info is NULL.
LLAMA_API int32_t llama_vis_model_moe_info(const struct llama_model * model, struct llama_vis_moe_info * info);


// ---------------------------------------------------------------------------
// Expert residency (src/vis-moe-*.cpp, docs/residency.md)
//
// For every MoE layer after a pinned prefix, the routed experts are served
// from a per-layer pool of n_slots expert-sized slots ("slabs") on the
// layer's compute device.  Routed expert ids are remapped to slots before
// mul_mat_id; misses are loaded from the backing store before the layer's
// experts run (exact mode).  A layer whose slots cover all its experts, and
// the pinned prefix, run upstream's graph unchanged.
//
// Settings (src/api/vis-moe-settings.cpp).  Every --moe-* flag is one row of a
// table (llama_vis_moe_flag below): name, VIS_MOE_* variable, value hint,
// range and help.  The values are kept in two layers:
//   - process-wide: the environment (read at each use, strictly: a bad value fails
//     the next model load or context with an error naming the variable), overridden
//     by the command-line flags (llama_vis_moe_cli_apply) and llama_vis_moe_set_params /
//     llama_vis_moe_set_tier_params (NULL: back to the environment);
//   - per thread: llama_vis_moe_set_thread_params overrides both structs for the
//     calling thread only (models loaded and contexts created on that thread),
//     which is how pyvis applies settings for one call without touching others.
// A model load and a context creation read the settings in force on their thread.
// ---------------------------------------------------------------------------
struct llama_vis_moe_params {
    int32_t n_slots;       // slots per managed layer; 0 = use cache_mib; both 0 = off
    int64_t cache_mib;     // alternative: total slab budget in MiB, split evenly over managed layers
    int32_t n_pinned;      // first N MoE layers stay fully resident (VisMMOE anchor layers); -1 = all
    int32_t print_stats;   // print per-layer stats (to stderr) when the context is freed
    const char * trace_path; // routing trace file (NULL = off); copied at context creation
};

// Defaults: VIS_MOE_SLOTS, VIS_MOE_CACHE_MIB, VIS_MOE_PINNED, VIS_MOE_STATS, VIS_MOE_TRACE
// from the environment, else everything off.  An invalid variable is skipped here and
// reported by the next model load / context creation.  trace_path: as for get_params.
LLAMA_API struct llama_vis_moe_params llama_vis_moe_default_params(void);

// The parameters in force on the calling thread (its override, else the process-wide ones).
// trace_path points into library storage valid until the next set on this thread.
LLAMA_API struct llama_vis_moe_params llama_vis_moe_get_params(void);

// Set the process-wide parameters used by contexts created from now on (NULL resets to defaults).
// Returns 0, or -1 with llama_vis_last_error() set if the values are out of range.
LLAMA_API int32_t llama_vis_moe_set_params(const struct llama_vis_moe_params * params);

// Apply one command-line flag of the table below (value NULL or "" for flags without a value)
// to the process-wide parameters.  Used by the common/arg.cpp options of every llama.cpp tool
// (patch 0003).  Returns 0, or -1 with llama_vis_last_error() naming the flag and the valid range.
LLAMA_API int32_t llama_vis_moe_cli_apply(const char * flag, const char * value);

// Apply one flag of the table to the calling thread's override (created from the process-wide settings
// if the thread has none; dropped by llama_vis_moe_set_thread_params(NULL, NULL)).  For settings without
// a struct (--moe-substitute, --moe-sub-*, --moe-stream-passes).  0, or -1 with llama_vis_last_error().
LLAMA_API int32_t llama_vis_moe_thread_apply(const char * flag, const char * value);

// Set the calling thread's override in one step: the process-wide settings with these n flags of the table applied
// in order (values[i] NULL: the row's built-in value, e.g. no file, --moe-substitute not given; a flag without a
// value takes on|off), checked once at the end (so --moe-slots 8 --moe-cache-mib 0 is fine whatever was in force).
// pyvis applies a whole configuration so (pyvis.moe.MoeConfig).  0, or -1 with llama_vis_last_error() naming the
// flag; the thread keeps what it had then.
LLAMA_API int32_t llama_vis_moe_thread_set(int32_t n, const char * const * flags, const char * const * values);

// The value of one setting, spelled as its flag takes it ("8", "auto", "on", "0.5", a path), so that applying it
// gives back the same setting: the value in force on the calling thread (builtin = 0: its override, else the
// process-wide settings), or the table's built-in default (builtin = 1).  "" when the setting is unset (a file:
// none; --moe-substitute: not given).  NULL for an unknown flag, with llama_vis_last_error().  Valid until the next
// call on this thread.
LLAMA_API const char * llama_vis_moe_get_value(const char * flag, int32_t builtin);

// Who decides a setting: a user flag, listed in every tool's --help (or only in the tools that take images), or an
// engine knob, set through its VIS_MOE_* variable and documented in docs/knobs.md with the measurement behind its
// default; a knob's old --moe-* spelling still parses for one release, with a deprecation line.
enum llama_vis_moe_scope {
    LLAMA_VIS_MOE_SCOPE_KNOB   = 0,
    LLAMA_VIS_MOE_SCOPE_USER   = 1,  // llama-cli, llama-server, llama-mtmd-cli, llama-perplexity
    LLAMA_VIS_MOE_SCOPE_VISION = 2,  // the tools that take images (upstream's --mmproj tools: llama-mtmd-cli, llama-server, llama-cli)
};

// What a setting's value is (llama_vis_moe_get_value spells it so; pyvis.moe.MoeConfig types its field by it).
enum llama_vis_moe_value_type {
    LLAMA_VIS_MOE_VALUE_SWITCH      = 0,  // on | off (also 1/0, true/false)
    LLAMA_VIS_MOE_VALUE_INT         = 1,  // an integer in a range
    LLAMA_VIS_MOE_VALUE_REAL        = 2,  // a number in a range
    LLAMA_VIS_MOE_VALUE_WORD        = 3,  // one of the words of value_hint
    LLAMA_VIS_MOE_VALUE_INT_OR_WORD = 4,  // an integer, or one of the words of value_hint ("auto|off|MIB")
    LLAMA_VIS_MOE_VALUE_REAL_OR_WORD = 5, // a number, or one of the words of value_hint ("off|G")
    LLAMA_VIS_MOE_VALUE_TEXT        = 6,  // a form of its own, given by value_hint ("off|TAU|pN")
    LLAMA_VIS_MOE_VALUE_FILE        = 7,  // a file path
};

// One row of the settings table: every --moe-* setting.
struct llama_vis_moe_flag {
    const char * name;        // "--moe-slots"
    const char * env;         // "VIS_MOE_SLOTS"
    const char * value_hint;  // "N", "auto|MIB", ...; NULL for a flag without a value
    const char * help;        // help text (several lines, '\n'-separated; no env note)
    int32_t      scope;       // enum llama_vis_moe_scope
    int32_t      value_type;  // enum llama_vis_moe_value_type
};
LLAMA_API int32_t llama_vis_moe_n_flags(void);
// Row i (0 <= i < llama_vis_moe_n_flags()). Returns 0, or -1 if i is out of range.
LLAMA_API int32_t llama_vis_moe_get_flag(int32_t i, struct llama_vis_moe_flag * out);
// The VIS_MOE_* variables set in this process, in table order, as "flag=value" without the "--moe-" prefix,
// separated by spaces ("predict=next-router mem=2078"); "" when none.  Valid until the next call on this thread.
// llama-bench shows it as its vis_moe field (patch 0012).
LLAMA_API const char * llama_vis_moe_env_brief(void);
// VIS_MOE_REPLAY (a benchmark knob, environment only; docs/benchmarks.md#replaying-recorded-routing): the routing
// trace that contexts created now on this thread would replay in place of their routers, or NULL when it is unset (or
// when the settings are invalid: then llama_vis_last_error() says why).  llama-server refuses to start when it is set
// (patch 0013).  Valid until the next call on this thread.
LLAMA_API const char * llama_vis_moe_replay_trace(void);
// The largest --moe-slots (and --moe-shadow-slots) value the settings accept: the one limit `pyvis plan` shares.
LLAMA_API int32_t llama_vis_moe_max_slots(void);

// Message of the last failed llama_vis_* call on this thread (or of a context that
// failed to attach its expert cache), "" if none.  Every llama_vis_* call that can
// fail clears it first.
LLAMA_API const char * llama_vis_last_error(void);

struct llama_vis_moe_stats {
    int32_t n_slots;        // slots of a managed layer (0: layer not managed)
    int32_t managed;        // 1 if the layer (or, for totals, any layer) is managed
    int64_t n_routed;       // distinct experts looked up (per pass of every ubatch)
    int64_t n_hits;         // ... that were already resident
    int64_t n_misses;       // ... that had to be loaded (n_hits + n_misses == n_routed)
    int64_t bytes_loaded;   // bytes copied into slabs (n_misses * expert bytes)
    int64_t load_us;        // time spent loading (the stall of exact mode), microseconds
    int64_t n_calls;        // ubatch x layer evaluations
    int64_t n_passes;       // expert passes (> n_calls when a ubatch routed more experts than slots)
};

// Stats of layer il, or totals over all layers with il = -1.
// Returns 0, or -1 if ctx has no expert cache or il is out of range.
LLAMA_API int32_t llama_vis_moe_get_stats(const struct llama_context * ctx, int32_t il, struct llama_vis_moe_stats * out);
LLAMA_API void    llama_vis_moe_reset_stats(struct llama_context * ctx);

// Number of managed layers of ctx (0 when the cache is off or every layer fits).
LLAMA_API int32_t llama_vis_moe_n_managed(const struct llama_context * ctx);

// Decodes the expert cache failed (an expert read error, a trace write error), and the message of the
// last decode's failure ("" if the last decode did not fail in the cache).  For tools that must report
// it: llama-server sends it to the client, llama-perplexity exits non-zero (patch 0007).
LLAMA_API int64_t     llama_vis_moe_n_failures(const struct llama_context * ctx);
LLAMA_API const char * llama_vis_moe_last_failure(const struct llama_context * ctx);

// Print the stats table (as at exit with --moe-stats) to stderr.
LLAMA_API void    llama_vis_moe_print_stats(const struct llama_context * ctx);

// Telemetry of every expert cache of the process (src/api/vis-moe-metrics.cpp, docs/telemetry.md), for llama-server
// (patch 0014); safe to call from any thread (each context publishes a snapshot at the end of every ubatch).
// Prometheus text exposition of the counters since the process started (llamacpp:vis_moe_* families, HELP and TYPE
// lines, a freed context's counts kept), "" when no context with an expert cache was created.  Valid until the next
// call on this thread.
LLAMA_API const char * llama_vis_moe_metrics_text(void);
// A JSON object: the mode ("exact" or "lossy" and the lossy mechanisms) and the memory plan (budget, slots per
// layer, managed and resident MoE layers, KV cache, slab and host-cache bytes) of the context created last; "null"
// when there was none.  Valid until the next call on this thread.
LLAMA_API const char * llama_vis_moe_props_json(void);

// ---------------------------------------------------------------------------
// Substitution on a miss (lossy, off by default; src/features/vis-moe-substitute.cpp, docs/substitution.md)
//
// With --moe-substitute router|buddy|auto, a (token, expert) pair of a managed layer whose expert is not
// resident may run a resident stand-in instead, with the missing expert's gate weight.  Gates: TAE (token
// routing entropy), margin, batch residency (beta), a per-token budget and a gate-weight share.  The
// missing expert is read in the background so later tokens hit.  Settings: the --moe-sub-* flags.
// ---------------------------------------------------------------------------

// what happened to one missing (token, expert) pair; also the outcome byte of the trace's SUB1 records
enum llama_vis_sub_outcome {
    LLAMA_VIS_SUB_RESIDENT       = 0, // the routed expert ran (it was resident, or was loaded)
    LLAMA_VIS_SUB_SUBSTITUTED    = 1, // a resident stand-in ran in its place
    LLAMA_VIS_SUB_BLOCKED_TAE    = 2, // the token's routing entropy is at or below tau (sensitive token)
    LLAMA_VIS_SUB_BLOCKED_MARGIN = 3, // its top-1 / top-2 weight margin is at or above gamma
    LLAMA_VIS_SUB_BLOCKED_BETA   = 4, // too many of the ubatch's experts in this layer are missing (> beta)
    LLAMA_VIS_SUB_BLOCKED_BUDGET = 5, // the token already had its budget of substitutions in this layer
    LLAMA_VIS_SUB_BLOCKED_WEIGHT = 6, // the expert's share of the token's gate weight is not below the threshold
    LLAMA_VIS_SUB_NO_CANDIDATE   = 7, // no resident expert qualifies (buddy list exhausted, all already chosen)
    LLAMA_VIS_SUB_NEEDED_ANYWAY  = 8, // another token of the ubatch loads this expert: no reason to substitute
    LLAMA_VIS_SUB_NOT_ELIGIBLE   = 9, // prefill ubatch without --moe-sub-prefill
    LLAMA_VIS_SUB_BLOCKED_RANK   = 10, // not among the token's --moe-sub-rank lowest-ranked experts
    LLAMA_VIS_SUB_DROPPED        = 11, // --moe-substitute drop: skipped (gate weight 0; exec = an expert the token runs)
    LLAMA_VIS_SUB_N_OUTCOMES     = 12,
};

struct llama_vis_moe_sub_stats {
    int64_t n_tokens;              // (token, managed layer) evaluations the substitution step saw
    int64_t n_tokens_substituted;  // ... with at least one substitution
    int64_t n_missing;             // (token, expert) pairs whose expert was not resident
    int64_t outcomes[LLAMA_VIS_SUB_N_OUTCOMES]; // of the missing pairs, by outcome (sum == n_missing)
    int64_t bytes_saved;           // expert bytes not read before the layer could run
    int64_t stall_saved_us;        // estimate: bytes_saved at this context's measured file read rate
    int64_t bg_fetches;            // substituted-away experts read in the background
    int64_t bg_wait_us;            // time compute waited for a background read still in flight (late)
};
// Layer il, or totals with il = -1.  0, or -1 if ctx has no expert cache or il is out of range.
LLAMA_API int32_t llama_vis_moe_get_sub_stats(const struct llama_context * ctx, int32_t il,
                                              struct llama_vis_moe_sub_stats * out);

// ---------------------------------------------------------------------------
// Shadow experts and the precision policy (lossy; src/features/vis-moe-precision.cpp, docs/precision.md)
//
// With --moe-shadow FILE and --moe-precision vision|gate|all|auto, a missing expert the policy allows runs from its
// low-bit shadow (a shadow slot of the layer, read from the sidecar on a shadow miss) while the full-precision
// expert is read in the background (--moe-prec-refetch).  Off (the default): nothing changes.
// ---------------------------------------------------------------------------
struct llama_vis_moe_prec_stats {
    int64_t n_eligible;      // missing experts the policy allowed to run from their shadow (per layer and ubatch)
    int64_t n_shadow;        // ... that ran from it (auto: the controller's share of the eligible ones)
    int64_t n_shadow_pairs;  // (token, expert) pairs computed from a shadow
    int64_t n_shadow_hits;   // shadow experts found in a shadow slot
    int64_t n_shadow_reads;  // ... read from the sidecar
    int64_t bytes_shadow;    // shadow bytes read
    int64_t bytes_saved;     // full-precision bytes the critical path did not read (less the shadow bytes read)
    int64_t n_refetch;       // full-precision experts of shadow-served misses queued for a background read
    int64_t load_us;         // time spent filling shadow slots
    int64_t n_vision_ubatches;  // ubatches of this layer counted vision-dominated
    int64_t n_switches;      // totals only: changes of the served share by the auto controller
    int32_t share_pct;       // totals only: the share of eligible misses the controller serves from shadows now, %
};
// Layer il, or totals with il = -1.  0, or -1 if ctx has no expert cache or il is out of range.
LLAMA_API int32_t llama_vis_moe_get_prec_stats(const struct llama_context * ctx, int32_t il,
                                               struct llama_vis_moe_prec_stats * out);

// Entropy-weighted capacity (lossy; --moe-capacity, src/features/vis-moe-capacity.cpp, docs/precision.md): per managed layer
// and ubatch with image tokens, at most C distinct missing experts that only image tokens route are loaded; the other
// image pairs are rerouted to experts in memory, or dropped as a last resort.
struct llama_vis_moe_cap_stats {
    int64_t n_ubatches;   // (layer, ubatch) evaluations with image tokens the capacity rule saw
    int64_t capacity;     // sum of their capacities C
    double  rv_sum;       // sum of their effective visual ratios R_v (mean: rv_sum / n_ubatches)
    int64_t n_missing;    // distinct missing experts only image tokens routed
    int64_t n_loaded;     // ... loaded within the capacity
    int64_t n_overflow;   // ... over it
    int64_t n_forced;     // overflow experts loaded after all (a pair had no target and could not be dropped)
    int64_t n_rerouted;   // (token, expert) pairs rerouted to an expert in memory
    int64_t n_dropped;    // pairs dropped (gate weight 0)
    int64_t bytes_saved;  // expert bytes not read: (n_overflow - n_forced) experts
};
// Layer il, or totals with il = -1.  0, or -1 if ctx has no expert cache or il is out of range.
LLAMA_API int32_t llama_vis_moe_get_cap_stats(const struct llama_context * ctx, int32_t il,
                                              struct llama_vis_moe_cap_stats * out);
// MACS's weight of each of n_tokens embedding rows (n_embd floats each): w = sigmoid(-delta * z), z the z-scored
// Shannon entropy of softmax(row) over the rows (the capacity rule's image-token weights).  0, or -1 on bad arguments.
LLAMA_API int32_t llama_vis_moe_macs_weights(const float * embd, int64_t n_tokens, int64_t n_embd, float delta,
                                             float * out);

// ---------------------------------------------------------------------------
// Lookahead prediction and prefetch (exact; src/features/vis-moe-prefetch.cpp, docs/prediction.md)
//
// With --moe-predict next-router|coact|freq|mlp|random, layer l predicts the experts of layers l+1 .. l+W
// (--moe-lookahead) and the best --moe-prefetch-budget of them that are not resident are read in the
// background into free or expired slots while layer l computes.  Only when bytes arrive changes: outputs are
// byte-identical with prediction on or off.  Decode steps with the file store.
// ---------------------------------------------------------------------------
struct llama_vis_moe_prefetch_stats {
    int64_t n_steps;        // steps (ubatches) the layer was predicted for
    int64_t n_predicted;    // experts predicted for the layer from the layer before it (top-B, d = 1)
    int64_t n_pred_hits;    // ... that the layer then routed (precision = n_pred_hits / n_predicted)
    int64_t n_routed;       // distinct experts the layer routed in those steps (recall = n_pred_hits / n_routed)
    int64_t n_issued;       // experts made resident ahead of need (background reads and host-cache copies)
    int64_t n_used;         // ... that the step they were read for routed
    int64_t n_wasted;       // ... that it did not route
    int64_t n_late;         // used ones still being read when the layer needed them (a partial stall)
    int64_t n_cancelled;    // background reads dropped before they started (the layer came first)
    int64_t bytes_read;     // bytes read ahead (issued and not cancelled)
    int64_t bytes_wasted;   // ... of wasted ones
    int64_t wait_us;        // time the layer waited for reads ahead still in flight
    int64_t saved_us;       // estimate: used reads at this context's measured read rate, minus wait_us
    int64_t n_off_steps;    // steps the self-tuning kept the layer's prefetch off (it wasted more than it used)
    int32_t enabled;        // prefetch is on for the layer now
    // totals only (il = -1): the measured on/off choice of --moe-prefetch-tune (median decode step time of the
    // last probe with reads ahead on and off; probes decided, and how many chose on; the setting now)
    int32_t ab_probes;
    int64_t ab_on_us;
    int64_t ab_off_us;
    int32_t ab_chose_on;
    int32_t ab_running_on;
};
// Layer il, or totals with il = -1.  0, or -1 if ctx has no expert cache or il is out of range.
LLAMA_API int32_t llama_vis_moe_get_prefetch_stats(const struct llama_context * ctx, int32_t il,
                                                   struct llama_vis_moe_prefetch_stats * out);

// The fingerprint a profile (buddy lists, ...) must match: the routers' bytes, hashed as
//   h = 0xcbf29ce484222325; for each layer il in order with a router blk.<il>.ffn_gate_inp.weight:
//     t = nbytes + sum_i (w_i + 1) * (2 i + 1)   over its bytes as little-endian u32 words w_i
//                                                 (zero-padded to a multiple of 4), mod 2^64
//     h = h * 0x100000001b3 + t                   mod 2^64
// 0, or -1 with llama_vis_last_error() (no routers, or routers the host cannot read as stored).
LLAMA_API int32_t llama_vis_moe_router_hash(const struct llama_model * model, uint64_t * out);

#ifdef __cplusplus
}
#endif
