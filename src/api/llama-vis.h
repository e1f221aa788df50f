// llama-vis.h - public C API of the vis-moe fork of llama.cpp.
//
// Everything the fork adds to libllama is declared here, as new functions
// (never new fields in upstream structs, so that the ctypes mirrors in
// llama-cpp-python stay valid).  Python bindings: pyvis/_native.py.
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

// ---------------------------------------------------------------------------
// Paging tiers (src/store/vis-moe-host-cache.cpp, src/store/vis-moe-io-pool.cpp, src/plan/vis-moe-plan.cpp, docs/paging.md)
//
//   tier 1  the slabs above (device memory; host memory on CPU / Jetson)
//   tier 2  a host-RAM expert cache with its own byte budget and LRU
//   tier 3  the GGUF file: managed experts are not loaded at start; each miss
//           is one positioned read of exactly its bytes (O_DIRECT where the
//           filesystem allows it), the misses of a layer read in parallel.
// ---------------------------------------------------------------------------
struct llama_vis_moe_tier_params {
    int32_t store;       // 0 = file (tier 3; default), 1 = model (experts loaded by llama.cpp, copied from RAM/mmap)
    int64_t host_mib;    // tier-2 budget in MiB; -1 = planned by --moe-mem (else 0), 0 = none
    int64_t mem_mib;     // total memory budget of the process for --moe-mem: 0 = off, -1 = auto (cgroup, MemAvailable)
    int32_t io_threads;  // parallel expert reads (default 4)
    int32_t direct_io;   // -1 = auto (O_DIRECT where allowed), 0 = buffered reads (pages dropped after), 1 = O_DIRECT
    int32_t unified;     // -1 = auto, 0 = off, 1 = on: slabs are written straight from the file (CPU; Jetson with
                         //      GGML_CUDA_ENABLE_UNIFIED_MEMORY=1); tier 2 then never holds what a slab holds
    int32_t mlock;       // 1 = lock slabs and the host cache in memory (default), 0 = don't
};

// Defaults from VIS_MOE_STORE, VIS_MOE_HOST_MIB, VIS_MOE_MEM, VIS_MOE_IO_THREADS, VIS_MOE_DIRECT_IO,
// VIS_MOE_UNIFIED, VIS_MOE_MLOCK, else the values above.
LLAMA_API struct llama_vis_moe_tier_params llama_vis_moe_tier_default_params(void);
// in force on the calling thread (its override, else the process-wide ones)
LLAMA_API struct llama_vis_moe_tier_params llama_vis_moe_get_tier_params(void);
// For models loaded and contexts created from now on; NULL resets.  0, or -1 with llama_vis_last_error().
LLAMA_API int32_t llama_vis_moe_set_tier_params(const struct llama_vis_moe_tier_params * params);

// Override both settings structs for the calling thread only (NULL for one of them: the
// process-wide value at the time of the call).  Both NULL: drop the override, the thread
// follows the process-wide settings again.  0, or -1 with llama_vis_last_error() if out of range.
LLAMA_API int32_t llama_vis_moe_set_thread_params(const struct llama_vis_moe_params * params,
                                                  const struct llama_vis_moe_tier_params * tier);
// 1 if the calling thread has an override, else 0.
LLAMA_API int32_t llama_vis_moe_thread_params_active(void);

struct llama_vis_moe_io_stats {
    int64_t slab_hits;      // tier 1: routed experts found in a slab
    int64_t host_hits;      // tier 2: misses served from the host cache
    int64_t file_reads;     // tier 3: misses read from the file (experts)
    int64_t model_copies;   // misses copied from llama.cpp's own copy (store = model)
    int64_t bytes_read;     // payload bytes read from the file
    int64_t bytes_storage;  // bytes requested from storage (O_DIRECT reads are 4 KiB-aligned supersets)
    int64_t read_us;        // wall time compute waited for file reads
    int64_t host_bytes;     // tier-2 capacity in bytes
    int64_t host_used;      // bytes in tier 2 now
    int64_t host_evictions;
    int64_t slab_bytes;     // tier-1 bytes
    int32_t direct_io;      // 1 if reads use O_DIRECT
    int32_t unified;        // 1 if slabs are filled straight from the file
    int32_t locked;         // 1 if slabs and host cache are locked in memory
    int32_t io_threads;
    int64_t major_faults;   // major page faults of the process since the context was created
    int64_t rss_peak;       // peak resident set of the process (VmHWM), bytes
    int64_t streamed;       // experts a large ubatch read through the mapping instead of the slabs (prefill
                            // streaming: more passes than VIS_MOE_STREAM_PASSES), pages dropped after the layer
    int64_t bytes_streamed; // their bytes
    int64_t bytes_copied;   // payload bytes of file reads copied out of an O_DIRECT bounce buffer (the rest of each
                            // read landed in place: the slice's whole 4 KiB pages, docs/paging.md#tier-3-the-gguf-file)
};
// Stats of the paging tiers of ctx. 0, or -1 if ctx has no expert cache.
LLAMA_API int32_t llama_vis_moe_get_io_stats(const struct llama_context * ctx, struct llama_vis_moe_io_stats * out);

// Reads overlapped with compute in decode (VIS_MOE_OVERLAP, docs/paging.md#reads-overlapped-with-compute-in-decode):
// a one-pass ubatch's misses are read in the background from the moment its layer planned, while the resident
// experts compute; each miss runs in a pass of its own once its read landed.  Exact: the same misses, bytes and
// outputs as without it.
struct llama_vis_moe_overlap_stats {
    int32_t max_passes;   // miss passes a one-token step of the layer gets (0: not overlapped; totals: the most)
    int64_t n_ubatches;   // ubatch x layer evaluations whose misses were read while the layer computed
    int64_t n_reads;      // misses read so (tier 3); misses served from memory are not counted
    int64_t n_passes;     // miss passes run (an empty one included)
    int64_t wait_us;      // time the miss passes waited for their reads (the stall left)
    int64_t hidden_us;    // wall time the layer computed while its reads were under way (from the first issue
                          // to the last read's end, less the miss passes' waits inside it)
    int64_t n_late;       // reads issued after the layer's resident experts began computing (0 unless broken)
};
// Overlap stats of layer il, or totals over all layers with il = -1.  0, or -1 if ctx has no expert cache or il is
// out of range.
LLAMA_API int32_t llama_vis_moe_get_overlap_stats(const struct llama_context * ctx, int32_t il,
                                                  struct llama_vis_moe_overlap_stats * out);

// What this machine gives us.
struct llama_vis_mem_info {
    int64_t mem_total;       // MemTotal
    int64_t mem_available;   // MemAvailable
    int64_t swap_total;      // SwapTotal
    int64_t swap_free;       // SwapFree
    int64_t zram_bytes;      // memory used by zram swap devices (0 if none)
    int64_t cgroup_limit;    // tightest memory limit over our cgroup and its parents (v1 or v2), -1 if none
    int64_t cgroup_usage;    // usage of the cgroup holding that limit (page cache included), -1 if unknown
    int32_t cgroup_version;  // 2, 1, or 0 if no memory cgroup was found
    int64_t rss;             // VmRSS of this process
    int64_t rss_peak;        // VmHWM of this process
    int64_t major_faults;    // major page faults of this process so far
    int64_t limit;           // min(cgroup_limit, MemTotal): what the process may ever use
    int64_t available;       // min(cgroup_limit - cgroup_usage + rss, MemAvailable + rss): what it may use now
};
LLAMA_API int32_t llama_vis_mem_probe(struct llama_vis_mem_info * out);

// How one memory budget splits over resident weights, KV cache, compute, slabs and the host cache.
struct llama_vis_moe_plan_request {
    int64_t budget;            // bytes for the whole process; <= 0: the machine's (llama_vis_mem_probe().available);
                               // above what the process may hold (llama_vis_mem_probe().limit: cgroup, MemTotal)
                               // it is clamped to that (plan.budget says so)
    int64_t resident_bytes;    // weights that stay resident (everything but the managed experts)
    int64_t kv_bytes;          // KV cache
    int64_t reserve_bytes;     // compute buffers, runtime and slack (>= 0): llama_vis_moe_estimate_reserve()
    int64_t expert_bytes;      // one expert of one managed layer (gate + up + down)
    int32_t n_managed_layers;  // MoE layers after the pinned prefix
    int32_t n_expert;
    int32_t n_expert_used;     // top-k
    int32_t unified;           // 1: slabs live in the same memory (CPU, Jetson); 0: discrete GPU
    int64_t device_bytes;      // discrete GPU: device memory for slabs (ignored when unified)
    int64_t host_mib;          // explicit tier-2 budget; -1: plan it
    int32_t n_slots;           // explicit slots per layer; 0: plan them
    int32_t no_staging;        // 1: CPU-only run, the slabs need no staging slot (0: one per layer)
    int64_t encoder_bytes;     // the vision encoder next to the text model (llama_vis_moe_encoder_estimate's
                               // total_bytes; 0: none): anonymous memory that must fit, planned like reserve_bytes
    int64_t io_bytes;          // the expert reads' O_DIRECT bounce buffers and the slabs' in-page placement
                               // (llama_vis_moe_io_buffer_bytes; 0: none): planned like reserve_bytes
};
struct llama_vis_moe_plan {
    int32_t ok;                // 1 fits; 0 does not (reason in llama_vis_last_error())
    int32_t n_slots;           // slots per managed layer (n_expert: everything resident). Below top-k when the
                               // budget is tight: exact, a decode step then runs ceil(k / n_slots) passes per layer
    int64_t slab_bytes;        // tier 1 (including the staging slot per layer, unless no_staging)
    int64_t host_bytes;        // tier 2
    int64_t budget;            // the budget planned for (the request's, clamped; or the machine's)
    int64_t fixed_bytes;       // resident weights + KV + reserve + encoder + I/O buffers
    int64_t min_budget;        // the smallest budget that runs (KV, compute, encoder, one slot (+ staging) per layer)
    int64_t file_only_bytes;   // managed expert bytes held in neither tier 1 nor tier 2
    int64_t tight_budget;      // below this budget there are fewer than top-k slots per layer
    int64_t pageable_bytes;    // resident weights that do not fit next to the minimal slabs: left to the page
                               // cache (not locked; re-read from the file under pressure, as upstream's mmap)
    int32_t extra_slots;       // unified memory, slots planned (n_slots 0): one more slot in this many managed layers,
                               // from the bytes left after whole slot rows (< n_managed_layers; counted in slab_bytes;
                               // which layers: docs/planning.md#slots-from-the-bytes-left-over)
};
LLAMA_API int32_t llama_vis_moe_plan(const struct llama_vis_moe_plan_request * req, struct llama_vis_moe_plan * out);

// The marginal-value configurator (src/plan/vis-moe-configure.cpp, docs/planning.md): within one budget, the ubatch
// size and the expert slots that give the lowest predicted latency of a request, with KV held at the admission
// floor (the asked context x parallel sequences: plan.kv_bytes).  Each candidate ubatch (the asked one, halved down
// to n_ubatch_min) is planned by llama_vis_moe_plan with its compute-buffer estimate; the cost model below prices
// each plan, so the chosen one is where a byte moved between compute buffer and slots saves no more latency.
struct llama_vis_moe_cost {
    double  read_bps;          // bytes/s of expert reads from the model file (llama_vis_moe_cost_default)
    double  mem_bps;           // bytes/s of reading weights from memory (a memory-bound matmul)
    double  pass_s;            // seconds one extra pass of one managed layer costs ...
    double  pass_token_s;      // ... plus this per token of its ubatch (a pass re-runs the layer's element-wise ops
                               // over every pair of the ubatch)
    double  token_s;           // seconds of compute per prompt token in a large batch (all layers); <= 0: from mem_bps
    int32_t stream_passes;     // a ubatch needing more passes than this in a layer streams it (VIS_MOE_STREAM_PASSES;
                               // 0 = never): its experts are read once, sequentially, with no passes
    int32_t prompt_tokens;     // one request: prompt tokens (prefill) ...
    int32_t gen_tokens;        // ... and generated tokens (decode)
    double  token_byte_s;      // seconds of compute per prompt token per byte of weights a token runs through, at a
                               // large batch (llama_vis_moe_cost_probe); used where token_s <= 0 (0: the prior)
    int32_t probed;            // 1: mem_bps, token_byte_s and the pass costs come from llama_vis_moe_cost_probe's timing
};
struct llama_vis_moe_configure_request {
    struct llama_vis_moe_plan_request plan;  // the --moe-mem request; reserve_bytes is replaced by the estimate at
                                             // each candidate ubatch (llama_vis_moe_estimate_reserve)
    int64_t n_vocab;           // the model's shape, for the reserve estimate
    int64_t n_embd;
    int64_t n_ff_exp;
    int32_t n_ubatch;          // the ubatch asked for: the largest candidate
    int32_t n_ubatch_min;      // the smallest candidate; <= 0: the runtime's, 16 (whether outputs stay bit-identical
                               // at another ubatch depends on the weight types: docs/planning.md#outputs)
    const float * miss_curve;  // NULL: the uniform prior k (1 - s / n); else [n_managed_layers][n_expert + 1]: expected
                               // misses per decode token of each managed layer with s = 0..n_expert slots (a trace)
    int32_t * layer_slots;     // optional out [n_managed_layers]: the same slots split per layer (llama_vis_moe_split_slots)
    struct llama_vis_moe_cost cost;
};
struct llama_vis_moe_configuration {
    int32_t ok;                // 1: a plan fits (else the reason is in llama_vis_last_error(), plan.min_budget says
                               // the smallest budget at n_ubatch_min)
    int32_t n_ubatch;          // the chosen ubatch (<= the asked)
    struct llama_vis_moe_plan plan;  // llama_vis_moe_plan at n_ubatch: equal slots per layer, what the runtime runs
    double  decode_tps;        // predicted tokens/s of decode and prefill with this plan ...
    double  prefill_tps;
    double  asked_decode_tps;  // ... and with the plan at the asked ubatch (today's fixed-rule plan)
    double  asked_prefill_tps;
    int32_t asked_n_slots;
    double  mv_slot;           // seconds saved per request per MiB by the last slot row (one slot in every layer)
    double  mv_next_slot;      // ... that the next slot row would save (0: every expert has a slot)
    double  mv_ubatch_down;    // ... that the last ubatch doubling (n_ubatch / 2 -> n_ubatch) saves (0: none)
    double  mv_ubatch_up;      // ... that the next doubling would save (0: at the asked ubatch)
    int32_t n_pinned;          // leading managed layers that layer_slots gives every expert (--moe-pinned-layers)
    double  layer_decode_tps;  // predicted decode tokens/s with layer_slots (0: not asked)
};
LLAMA_API int32_t llama_vis_moe_configure(const struct llama_vis_moe_configure_request * req,
                                          struct llama_vis_moe_configuration * out);
// Whether the runtime runs a configuration (the one rule --moe-mem and `pyvis plan` share, docs/planning.md#outputs):
// mode is VIS_MOE_CONFIGURE's (-1 auto, 1 on, 0 off), all_f32 whether every weight is F32 (the CPU backend's outputs
// are then bit-identical at any ubatch).  `on` applies it; auto applies it only on all-F32 weights (req and conf
// are not read: the cheapest priced plan is run wherever outputs stay the same).
// Where nothing fits (conf->ok 0) "applied" means: run at conf->n_ubatch, the smallest, whose refusal names the budget.
enum llama_vis_moe_configure_verdict {
    LLAMA_VIS_MOE_CONFIGURE_APPLIED = 0, // the runtime runs at conf->n_ubatch
    LLAMA_VIS_MOE_CONFIGURE_OFF     = 1, // mode 0: the asked ubatch
    LLAMA_VIS_MOE_CONFIGURE_NOT_F32 = 2, // auto, weights not all F32: outputs differ in the last bits at another ubatch
};
LLAMA_API int32_t llama_vis_moe_configure_applies(const struct llama_vis_moe_configure_request * req,
                                                  const struct llama_vis_moe_configuration * conf, int32_t mode,
                                                  int32_t all_f32);
// Per-layer slot counts from one expert budget (docs/planning.md#per-layer-slot-counts): n_layers x slots slots
// split by the layers' miss curves (miss_curve [n_layers][n_expert + 1]: misses with s = 0..n_expert slots).
// From the even split, a slot moves from the layer whose misses rise least by giving one up to the layer whose
// misses fall most by getting one, while the fall beats the rise by 10 %; every layer stays within
// min(n_expert_used, slots) .. min(n_expert, 2 slots), and a layer gives a slot only to one whose slot is no larger
// (row_bytes: bytes of one slot per layer; NULL: all equal), so the bytes never exceed the even split's.
// out [n_layers].  VIS_MOE_SLOT_SPLIT applies it at attach, llama_vis_moe_configure to its profile's curves, and
// pyvis.runtime.cachesim_split.split_slots is the same rule in Python (tested equal).  0 on success.
LLAMA_API int32_t llama_vis_moe_split_slots(const double * miss_curve, int32_t n_layers, int32_t n_expert,
                                            int32_t n_expert_used, int32_t slots, const int64_t * row_bytes,
                                            int32_t * out);
// One more slot in `extra` layers (the bytes a plan leaves after whole slot rows: llama_vis_moe_plan's extra_slots,
// docs/planning.md#slots-from-the-bytes-left-over): out[l] = slots[l] + 1 in the chosen layers, slots[l] in the others,
// at most one each and none to a layer already at n_expert.  With miss curves (miss_curve [n_layers][n_expert + 1], as
// llama_vis_moe_split_slots reads them) the layers whose next slot saves the most misses (the first on ties); without
// (NULL) the layers below n_expert spread evenly over depth: the j-th of E of them for j = floor((i + 0.5) E / extra),
// i < extra.  extra is capped at the layers that can take one.  pyvis.runtime.cachesim_split.extra_slots is the same
// rule in Python (tested equal).  0 on success.
LLAMA_API int32_t llama_vis_moe_extra_slots(const double * miss_curve, int32_t n_layers, int32_t n_expert,
                                            const int32_t * slots, int32_t extra, int32_t * out);
// The bandwidth half of the cost model: expert-sized O_DIRECT reads of the file at path by --moe-io-threads threads
// at once (page-cache reads with the pages dropped where O_DIRECT is refused) and a memcpy, probed once per device
// and I/O thread count and cached in ~/.cache/vis-moe/bandwidth (XDG_CACHE_HOME respected); VIS_MOE_READ_MBPS
// overrides the read number, VIS_MOE_PASS_US / VIS_MOE_PASS_TOKEN_US the pass cost (unset: the former fitted
// 10000 us + 2000 us), VIS_MOE_PLAN_PROMPT / VIS_MOE_PLAN_GEN the request priced; token_s 0 and token_byte_s 0
// (the prior).  --moe-mem runs llama_vis_moe_cost_probe below.  0 on success; a VIS_MOE_* variable that does not
// parse is an error naming it.
LLAMA_API int32_t llama_vis_moe_cost_default(const char * path, struct llama_vis_moe_cost * cost);
// The cost model with its compute side measured (src/plan/vis-moe-compute-probe.cpp, docs/planning.md#cost-model):
// llama_vis_moe_cost_default, then mem_bps, token_byte_s, pass_s and pass_token_s timed through the ggml backend API
// on the CPU device with n_threads threads, for weights of ggml type `type` with rows of n_embd, experts of n_ff_exp
// and top-n_expert_used (a pass's element-wise ops).  Probed once per (type, shape, threads) and cached in
// ~/.cache/vis-moe/compute (a line that does not parse: probed again, with a warning); VIS_MOE_MEM_MBPS,
// VIS_MOE_TOKEN_NS_PER_MIB, VIS_MOE_PASS_US and VIS_MOE_PASS_TOKEN_US override each number (all four set: no
// probe, probed = 0).  About a second: a matmul over 48 MiB at 1 and 64 tokens, and a pass's ops at 1 and 64;
// a probe timed while the load average exceeds the CPUs is not cached (VIS_MOE_PROBE_CACHE).
LLAMA_API int32_t llama_vis_moe_cost_probe(const char * path, int32_t type, int64_t n_embd, int64_t n_ff_exp,
                                           int32_t n_expert_used, int32_t n_threads, struct llama_vis_moe_cost * cost);

// The one estimate of compute buffers + runtime that --moe-mem plans with (reserve_bytes),
// from the model's shape: bytes.  pyvis plan calls it too, so plan and runtime agree.
LLAMA_API int64_t llama_vis_moe_estimate_reserve(int64_t n_ubatch, int64_t n_vocab, int64_t n_embd,
                                                 int64_t n_expert_used, int64_t n_ff_exp);
// The memory of the expert reads (src/store/vis-moe-io-pool.cpp) that --moe-mem plans with (io_bytes): the
// O_DIRECT bounce buffers, one 4 KiB-aligned region per reading thread, each as large as the aligned superset of the
// largest expert slice (one expert of one tensor) read, for io_threads demand readers and as many fetch workers
// (background reads, staged streaming); and up to one page per slab tensor (n_slab_tensors), which is placed at its
// file tensor's offset within a page so that reads land in place.  Bytes; pyvis plan calls it too.
LLAMA_API int64_t llama_vis_moe_io_buffer_bytes(int32_t io_threads, int64_t slice_bytes, int32_t n_slab_tensors);
// The reserve the context's memory plan used; -1 if ctx has no --moe-mem plan.
LLAMA_API int64_t llama_vis_moe_context_reserve(const struct llama_context * ctx);

// 1 if a model of model_bytes (all its tensors) fits a budget of budget_bytes whole (<= 0: the machine's,
// llama_vis_mem_probe().available; clamped as a plan's), with the runtime floor of the reserve estimate and 10 % left for KV cache
// and compute.  With --moe-mem alone such a model is loaded and run by upstream's path: nothing deferred or paged.
LLAMA_API int32_t llama_vis_moe_whole_model_fits(int64_t model_bytes, int64_t budget_bytes);

// The vision encoder in the same budget (src/vis-moe-encoder.cpp, docs/planning.md#the-vision-encoder).  A VLM tool
// loads its projector (--mmproj) after the text context, so it hands the mmproj over first; every --moe-mem plan
// made after that (the whole-model check at load, the context's plan, its refusal) counts the encoder's bytes.
struct llama_vis_encoder_estimate {
    int64_t weight_bytes;      // the projector's tensors (clip loads all of them into memory)
    int64_t compute_bytes;     // its compute buffer for an image of image_tokens, or of warmup_tokens if larger
                               // (estimate from the mmproj's hparams), + libmtmd's runtime
    int64_t image_bytes;       // host copies of that image: the preprocessed f32 image and the output embeddings
    int64_t total_bytes;       // the sum: what --moe-mem plans for the encoder
    int32_t image_tokens;      // the largest image planned for, in output tokens: image_max_tokens if > 0, else the
                               // projector's limit (the Qwen-VL mergers 4096, clip.vision.image_max_pixels, else
                               // the fixed image_size); 0: no vision encoder (an audio projector: weights only)
    int32_t n_patches;         // its patches (image_tokens x merge^2)
    int32_t flash_attn;        // 1: planned with flash attention in the encoder (0: with the attention scores)
    int32_t warmup_tokens;     // the image clip's warmup lays the buffer out for (0: no warmup)
    int32_t limit_known;       // 0: image_tokens is image_size's, a guess for a dynamic-resolution projector that
                               // is not a Qwen-VL merger (pass image_max_tokens)
    char    projector[32];     // clip.projector_type
};
// The estimate for the mmproj GGUF at path (metadata and tensor table only).  image_max_tokens: the tool's
// --image-max-tokens (<= 0: the projector's limit); flash_attn: -1 auto (on, as the CPU backend runs it), 0, 1;
// warmup: 1 if libmtmd warms the encoder up (the tools' default; mtmd_context_params.warmup), 0 if not.
// 0, or -1 with llama_vis_last_error() (a file that is not an mmproj, bad arguments).
LLAMA_API int32_t llama_vis_moe_encoder_estimate(const char * mmproj_path, int32_t image_max_tokens, int32_t flash_attn,
                                                 int32_t warmup, struct llama_vis_encoder_estimate * out);
// Plan the encoder at mmproj_path with every text model and context created from now on in this process (NULL
// or "": none).  0, or -1 with llama_vis_last_error() (the plan is then unchanged).
LLAMA_API int32_t llama_vis_moe_plan_encoder(const char * mmproj_path, int32_t image_max_tokens, int32_t flash_attn,
                                             int32_t warmup);
// The encoder planned now (out may be NULL): its total_bytes, 0 if none.
LLAMA_API int64_t llama_vis_moe_planned_encoder(struct llama_vis_encoder_estimate * out);
// VIS_MOE_ENCODER_RELEASE=on (src/features/vis-moe-encoder-release.h): 1 if ctx's plan gives the encoder's bytes
// to the expert slots once the tool has freed its encoder, so a tool that needs the encoder no more (a single-turn
// run, after the prompt's images are decoded) should free it and call llama_vis_moe_encoder_freed; else 0.
LLAMA_API int32_t llama_vis_moe_encoder_releasable(const struct llama_context * ctx);
// The tool has freed its encoder (mtmd_free): ctx's expert slots grow by its bytes, between ubatches.  0, or -1
// with llama_vis_last_error() if ctx has no such plan (llama_vis_moe_encoder_releasable returned 0).
LLAMA_API int32_t llama_vis_moe_encoder_freed(struct llama_context * ctx);
// Visual-token pruning support (issue #4, docs/vlm-native-api.md)
// ---------------------------------------------------------------------------
struct mtmd_context;

// -- encoder saliency (src/vlm/vis-mtmd-saliency.cpp, patch 0010) --
//
// "Attention received" of each image token: for each of the last k encoder
// layers, the softmax attention A[h, q, j] is averaged over heads h and query
// patches q (per-patch score, sums to 1 over patches), averaged over the patches
// merged into each output token (2x2 merge) and over the k layers.

// Ask for saliency. ctx == NULL sets the process-wide default for every mtmd
// context (initially VIS_MTMD_SALIENCY from the environment, else 0); a non-NULL
// ctx overrides the default for that context.  n_layers: 0 = off (the encoder
// graph is upstream's, unchanged), k >= 1 = average over the last k layers.
// Returns 0, or -1 with llama_vis_last_error() if n_layers < 0.
LLAMA_API int32_t llama_vis_mtmd_saliency_enable(const struct mtmd_context * ctx, int32_t n_layers);

// Scores of the last image chunk encoded by ctx, one per output token (the
// chunk's token order), min-max normalised to [0, 1] (a constant map gives 1.0).
// Writes min(count, n_max) values to out (out may be NULL).  Returns the count,
// or -1 with llama_vis_last_error() when the last encode had saliency off, failed,
// or used a projector without saliency support.
LLAMA_API int32_t llama_vis_mtmd_get_saliency(const struct mtmd_context * ctx, float * out, int32_t n_max);

// Same scores before normalisation: sum over the tokens * merge factor == 1.
LLAMA_API int32_t llama_vis_mtmd_get_saliency_raw(const struct mtmd_context * ctx, float * out, int32_t n_max);

// Hooks called by libmtmd (patch 0010); not for applications.  The state is owned by the
// mtmd context (mtmd_context::vis_saliency, src/api/vis-owner.h) and freed with it.  libmtmd
// links libllama, not the reverse, so the functions above cannot look inside an mtmd_context:
// attach hands over libmtmd's accessor of a context's state (one function for every context).
struct vis_saliency_state;
typedef struct vis_saliency_state * (*llama_vis_mtmd_saliency_of)(const struct mtmd_context * ctx);
LLAMA_API struct vis_saliency_state * llama_vis_mtmd_saliency_attach(llama_vis_mtmd_saliency_of state_of);
LLAMA_API void llama_vis_mtmd_saliency_begin(struct vis_saliency_state * st);
LLAMA_API void llama_vis_mtmd_saliency_end(struct vis_saliency_state * st, bool ok);
LLAMA_API bool llama_vis_clip_saliency_active(void);
LLAMA_API bool llama_vis_clip_saliency_layer(const char * projector, int il, int n_layer);
LLAMA_API void llama_vis_clip_saliency_collect(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * kq, int il);
LLAMA_API void llama_vis_clip_saliency_attn(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * q,
                                            struct ggml_tensor * k, struct ggml_tensor * kq_mask, float kq_scale,
                                            struct ggml_tensor * sinks, int il);
LLAMA_API void llama_vis_clip_saliency_fetch(struct ggml_cgraph * gf, int n_tokens_out);

// -- prefix-layer evaluation and routing capture (src/vlm/vis-moe-capture.cpp, patch 0011) --

// From the next llama_decode on, evaluate only layers 0..n_layers-1 (0 = off).
// Every token runs through every evaluated layer; the graph stops after layer
// n_layers-1: no logits or embeddings are produced, and only the evaluated layers'
// KV is written (the KV cells are still taken: llama_memory_seq_rm them before the
// real decode).  Returns 0, or -1 with llama_vis_last_error() for a NULL ctx,
// n_layers outside 0..n_layer, or an architecture that does not support it.
LLAMA_API int32_t llama_vis_set_layer_limit(struct llama_context * ctx, int32_t n_layers);
LLAMA_API int32_t llama_vis_get_layer_limit(const struct llama_context * ctx);

// on = 1: capture the routed expert ids of every MoE layer of every decoded ubatch
// (clears earlier captures); on = 0: stop and free.  Returns 0, or -1 (NULL ctx,
// model without experts).
LLAMA_API int32_t llama_vis_moe_capture(struct llama_context * ctx, int32_t on);
LLAMA_API void    llama_vis_moe_capture_reset(struct llama_context * ctx);

// Routes of layer il since the last reset: row-major [n_rows][k] expert ids, rows
// in ubatch order.  Writes min(n_rows * k, n_max) ids (ids may be NULL).  Returns
// n_rows (0 if the layer has no experts or was not evaluated), or -1 when capture
// is off or il is out of range.  In a full decode the last layer routes only the
// output rows.
LLAMA_API int32_t llama_vis_moe_get_routes(const struct llama_context * ctx, int32_t il, int32_t * ids, int32_t n_max);

// k (ids per row) of layer il's capture; 0 if nothing was captured.
LLAMA_API int32_t llama_vis_moe_routes_k(const struct llama_context * ctx, int32_t il);

#ifdef __cplusplus
}
#endif
