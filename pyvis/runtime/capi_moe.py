"""Part of the 1:1 ctypes mirror of src/api/llama-vis.h (:mod:`pyvis.runtime.capi`, which re-exports it): its
section src/api/llama-vis-moe.h (the build, expert residency and its settings table, stats, substitution, precision,
capacity, prefetch), in the header's order."""
from __future__ import annotations

import ctypes

from .capi_lib import ctypes_function, llama_context_p, llama_model_p


# LLAMA_API const char * llama_vis_version(void);
@ctypes_function("llama_vis_version", [], ctypes.c_char_p)
def llama_vis_version() -> bytes:
    """Version of the fork, e.g. "0.1.0"."""


# LLAMA_API const char * llama_vis_upstream_commit(void);
@ctypes_function("llama_vis_upstream_commit", [], ctypes.c_char_p)
def llama_vis_upstream_commit() -> bytes:
    """Pinned upstream llama.cpp commit the fork is built on, e.g. "0c1e570"."""


# LLAMA_API const char * llama_vis_system_info(void);
@ctypes_function("llama_vis_system_info", [], ctypes.c_char_p)
def llama_vis_system_info() -> bytes:
    """Fragment appended to llama_print_system_info() by patch 0001."""


# struct llama_vis_moe_info {
#     int32_t  n_layer;          // transformer layers
#     int32_t  n_moe_layers;     // layers with routed experts (*_exps tensors)
#     int32_t  first_moe_layer;  // index of the first MoE layer, -1 if none
#     int32_t  n_expert;         // routed experts per MoE layer
#     int32_t  n_expert_used;    // experts selected per token (top-k, max over layers)
#     int32_t  n_expert_shared;  // shared experts per layer (hparams; 0 if none)
#     int32_t  has_shared_exp;   // 1 if any layer has *_shexp tensors
#     int32_t  has_exp_bias;     // 1 if any layer has per-expert biases (*_exps_b)
#     int32_t  has_gate_up_exp;  // 1 if any layer has a merged gate_up_exps tensor
#     int64_t  expert_bytes;     // bytes of one routed expert in one layer (gate+up+down), max over layers
#     int64_t  routed_bytes;     // bytes of all routed experts in all layers
# };
class llama_vis_moe_info(ctypes.Structure):
    _fields_ = [
        ("n_layer", ctypes.c_int32),
        ("n_moe_layers", ctypes.c_int32),
        ("first_moe_layer", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("n_expert_shared", ctypes.c_int32),
        ("has_shared_exp", ctypes.c_int32),
        ("has_exp_bias", ctypes.c_int32),
        ("has_gate_up_exp", ctypes.c_int32),
        ("expert_bytes", ctypes.c_int64),
        ("routed_bytes", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_model_moe_info(const struct llama_model * model, struct llama_vis_moe_info * info);
@ctypes_function("llama_vis_model_moe_info", [llama_model_p, ctypes.POINTER(llama_vis_moe_info)], ctypes.c_int32)
def llama_vis_model_moe_info(model, info) -> int:
    """Fill *info for a loaded model. Returns 0 on success, -1 if model or info is NULL."""


# ---------------------------------------------------------------------------
# Expert residency
# ---------------------------------------------------------------------------
# struct llama_vis_moe_params {
#     int32_t n_slots;       // slots per managed layer; 0 = use cache_mib; both 0 = off
#     int64_t cache_mib;     // alternative: total slab budget in MiB, split evenly over managed layers
#     int32_t n_pinned;      // first N MoE layers stay fully resident (VisMMOE anchor layers); -1 = all
#     int32_t print_stats;   // print per-layer stats (to stderr) when the context is freed
#     const char * trace_path; // routing trace file (NULL = off); copied at context creation
# };
class llama_vis_moe_params(ctypes.Structure):
    _fields_ = [
        ("n_slots", ctypes.c_int32),
        ("cache_mib", ctypes.c_int64),
        ("n_pinned", ctypes.c_int32),
        ("print_stats", ctypes.c_int32),
        ("trace_path", ctypes.c_char_p),
    ]


# LLAMA_API struct llama_vis_moe_params llama_vis_moe_default_params(void);
@ctypes_function("llama_vis_moe_default_params", [], llama_vis_moe_params)
def llama_vis_moe_default_params() -> llama_vis_moe_params:
    """Defaults: VIS_MOE_SLOTS, VIS_MOE_CACHE_MIB, VIS_MOE_PINNED, VIS_MOE_STATS, VIS_MOE_TRACE, else off."""


# LLAMA_API struct llama_vis_moe_params llama_vis_moe_get_params(void);
@ctypes_function("llama_vis_moe_get_params", [], llama_vis_moe_params)
def llama_vis_moe_get_params() -> llama_vis_moe_params:
    """The parameters in force on the calling thread (its override, else the process-wide ones).
    trace_path points into library storage valid until the next set on this thread."""


# LLAMA_API int32_t llama_vis_moe_set_params(const struct llama_vis_moe_params * params);
@ctypes_function("llama_vis_moe_set_params", [ctypes.POINTER(llama_vis_moe_params)], ctypes.c_int32)
def llama_vis_moe_set_params(params) -> int:
    """Set the process-wide parameters (NULL resets to defaults). 0, or -1 with llama_vis_last_error()."""


# LLAMA_API int32_t llama_vis_moe_cli_apply(const char * flag, const char * value);
@ctypes_function("llama_vis_moe_cli_apply", [ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int32)
def llama_vis_moe_cli_apply(flag: bytes, value: bytes | None) -> int:
    """Apply one command-line flag of the settings table to the process-wide parameters.
    0, or -1 with llama_vis_last_error() naming the flag and the valid range."""


# LLAMA_API int32_t llama_vis_moe_thread_apply(const char * flag, const char * value);
@ctypes_function("llama_vis_moe_thread_apply", [ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int32)
def llama_vis_moe_thread_apply(flag: bytes, value: bytes | None) -> int:
    """Apply one flag of the table to the calling thread's override (created from the process-wide settings if the
    thread has none; dropped by llama_vis_moe_set_thread_params(NULL, NULL)).  For settings without a struct
    (--moe-substitute, --moe-sub-*, --moe-stream-passes).  0, or -1 with llama_vis_last_error()."""


# LLAMA_API int32_t llama_vis_moe_thread_set(int32_t n, const char * const * flags, const char * const * values);
@ctypes_function("llama_vis_moe_thread_set", [ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p),
                                              ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int32)
def llama_vis_moe_thread_set(n: int, flags, values) -> int:
    """Set the calling thread's override in one step: the process-wide settings with these n flags applied in order
    (values[i] NULL: the row's built-in value), checked once at the end.  0, or -1 with llama_vis_last_error() naming
    the flag; the thread keeps what it had then."""


# LLAMA_API const char * llama_vis_moe_get_value(const char * flag, int32_t builtin);
@ctypes_function("llama_vis_moe_get_value", [ctypes.c_char_p, ctypes.c_int32], ctypes.c_char_p)
def llama_vis_moe_get_value(flag: bytes, builtin: int) -> bytes | None:
    """One setting spelled as its flag takes it: in force on the calling thread (builtin = 0) or the table's built-in
    default (builtin = 1); "" when unset (no file, --moe-substitute not given); NULL for an unknown flag."""


# enum llama_vis_moe_scope { ... };  who decides a setting
LLAMA_VIS_MOE_SCOPE_KNOB = 0    # an engine knob: its VIS_MOE_* variable (docs/knobs.md)
LLAMA_VIS_MOE_SCOPE_USER = 1    # a user flag of every tool
LLAMA_VIS_MOE_SCOPE_VISION = 2  # a user flag of the tools that take images


# enum llama_vis_moe_value_type { ... };  what a setting's value is
LLAMA_VIS_MOE_VALUE_SWITCH = 0        # on | off
LLAMA_VIS_MOE_VALUE_INT = 1           # an integer in a range
LLAMA_VIS_MOE_VALUE_REAL = 2          # a number in a range
LLAMA_VIS_MOE_VALUE_WORD = 3          # one of the words of value_hint
LLAMA_VIS_MOE_VALUE_INT_OR_WORD = 4   # an integer, or one of the words of value_hint
LLAMA_VIS_MOE_VALUE_REAL_OR_WORD = 5  # a number, or one of the words of value_hint
LLAMA_VIS_MOE_VALUE_TEXT = 6          # a form of its own, given by value_hint
LLAMA_VIS_MOE_VALUE_FILE = 7          # a file path


# struct llama_vis_moe_flag {
#     const char * name;        // "--moe-slots"
#     const char * env;         // "VIS_MOE_SLOTS"
#     const char * value_hint;  // "N", "auto|MIB", ...; NULL for a flag without a value
#     const char * help;        // help text (several lines, '\n'-separated; no env note)
#     int32_t      scope;       // enum llama_vis_moe_scope
#     int32_t      value_type;  // enum llama_vis_moe_value_type
# };
class llama_vis_moe_flag(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("env", ctypes.c_char_p),
        ("value_hint", ctypes.c_char_p),
        ("help", ctypes.c_char_p),
        ("scope", ctypes.c_int32),
        ("value_type", ctypes.c_int32),
    ]


# LLAMA_API int32_t llama_vis_moe_n_flags(void);
@ctypes_function("llama_vis_moe_n_flags", [], ctypes.c_int32)
def llama_vis_moe_n_flags() -> int:
    """Rows of the settings table: every --moe-* flag."""


# LLAMA_API int32_t llama_vis_moe_get_flag(int32_t i, struct llama_vis_moe_flag * out);
@ctypes_function("llama_vis_moe_get_flag", [ctypes.c_int32, ctypes.POINTER(llama_vis_moe_flag)], ctypes.c_int32)
def llama_vis_moe_get_flag(i: int, out) -> int:
    """Row i (0 <= i < llama_vis_moe_n_flags()). Returns 0, or -1 if i is out of range."""


# LLAMA_API int32_t llama_vis_moe_max_slots(void);
@ctypes_function("llama_vis_moe_max_slots", [], ctypes.c_int32)
def llama_vis_moe_max_slots() -> int:
    """The largest --moe-slots / --moe-shadow-slots value the settings accept (`pyvis plan` shares it)."""


# LLAMA_API const char * llama_vis_moe_env_brief(void);
@ctypes_function("llama_vis_moe_env_brief", [], ctypes.c_char_p)
def llama_vis_moe_env_brief() -> bytes:
    """The VIS_MOE_* variables set in this process, as "flag=value" without "--moe-", space-separated; "" if none."""


# LLAMA_API const char * llama_vis_moe_replay_trace(void);
@ctypes_function("llama_vis_moe_replay_trace", [], ctypes.c_char_p)
def llama_vis_moe_replay_trace() -> bytes | None:
    """VIS_MOE_REPLAY (benchmark knob): the routing trace new contexts on this thread would replay, or None."""


# LLAMA_API const char * llama_vis_last_error(void);
@ctypes_function("llama_vis_last_error", [], ctypes.c_char_p)
def llama_vis_last_error() -> bytes:
    """Message of the last failed llama_vis_* call on this thread, "" if none; every fallible call clears it first."""


# struct llama_vis_moe_stats {
#     int32_t n_slots;        // slots of a managed layer (0: layer not managed)
#     int32_t managed;        // 1 if the layer (or, for totals, any layer) is managed
#     int64_t n_routed;       // distinct experts looked up (per pass of every ubatch)
#     int64_t n_hits;         // ... that were already resident
#     int64_t n_misses;       // ... that had to be loaded (n_hits + n_misses == n_routed)
#     int64_t bytes_loaded;   // bytes copied into slabs (n_misses * expert bytes)
#     int64_t load_us;        // time spent loading (the stall of exact mode), microseconds
#     int64_t n_calls;        // ubatch x layer evaluations
#     int64_t n_passes;       // expert passes (> n_calls when a ubatch routed more experts than slots)
# };
class llama_vis_moe_stats(ctypes.Structure):
    _fields_ = [
        ("n_slots", ctypes.c_int32),
        ("managed", ctypes.c_int32),
        ("n_routed", ctypes.c_int64),
        ("n_hits", ctypes.c_int64),
        ("n_misses", ctypes.c_int64),
        ("bytes_loaded", ctypes.c_int64),
        ("load_us", ctypes.c_int64),
        ("n_calls", ctypes.c_int64),
        ("n_passes", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_moe_get_stats(const struct llama_context * ctx, int32_t il, struct llama_vis_moe_stats * out);
@ctypes_function("llama_vis_moe_get_stats", [llama_context_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_stats)],
                 ctypes.c_int32)
def llama_vis_moe_get_stats(ctx, il: int, out) -> int:
    """Stats of layer il, or totals with il = -1. 0, or -1 if ctx has no expert cache or il is out of range."""


# LLAMA_API void    llama_vis_moe_reset_stats(struct llama_context * ctx);
@ctypes_function("llama_vis_moe_reset_stats", [llama_context_p], None)
def llama_vis_moe_reset_stats(ctx) -> None:
    ...


# LLAMA_API int32_t llama_vis_moe_n_managed(const struct llama_context * ctx);
@ctypes_function("llama_vis_moe_n_managed", [llama_context_p], ctypes.c_int32)
def llama_vis_moe_n_managed(ctx) -> int:
    """Number of managed layers of ctx (0 when the cache is off or every layer fits)."""


# LLAMA_API int64_t     llama_vis_moe_n_failures(const struct llama_context * ctx);
@ctypes_function("llama_vis_moe_n_failures", [llama_context_p], ctypes.c_int64)
def llama_vis_moe_n_failures(ctx) -> int:
    """Decodes the expert cache failed (an expert read error, a trace write error)."""


# LLAMA_API const char * llama_vis_moe_last_failure(const struct llama_context * ctx);
@ctypes_function("llama_vis_moe_last_failure", [llama_context_p], ctypes.c_char_p)
def llama_vis_moe_last_failure(ctx) -> bytes:
    """Message of the last decode's failure in the cache ("" if the last decode did not fail there)."""


# LLAMA_API void    llama_vis_moe_print_stats(const struct llama_context * ctx);
@ctypes_function("llama_vis_moe_print_stats", [llama_context_p], None)
def llama_vis_moe_print_stats(ctx) -> None:
    """Print the stats table (as at exit with --moe-stats) to stderr."""


# LLAMA_API const char * llama_vis_moe_metrics_text(void);
@ctypes_function("llama_vis_moe_metrics_text", [], ctypes.c_char_p)
def llama_vis_moe_metrics_text() -> bytes:
    """Prometheus text of every expert cache of the process (llamacpp:vis_moe_*), "" when none was created."""


# LLAMA_API const char * llama_vis_moe_props_json(void);
@ctypes_function("llama_vis_moe_props_json", [], ctypes.c_char_p)
def llama_vis_moe_props_json() -> bytes:
    """JSON: the mode and memory plan of the context created last ("null" when none)."""


# ---------------------------------------------------------------------------
# Substitution on a miss (lossy, off by default; docs/substitution.md)
# ---------------------------------------------------------------------------
# enum llama_vis_sub_outcome { ... };  what happened to one missing (token, expert) pair; also the outcome
# byte of the trace's SUB1 records (pyvis.runtime.trace.SUB_OUTCOMES names them)
LLAMA_VIS_SUB_RESIDENT = 0        # the routed expert ran (it was resident, or was loaded)
LLAMA_VIS_SUB_SUBSTITUTED = 1     # a resident stand-in ran in its place
LLAMA_VIS_SUB_BLOCKED_TAE = 2     # the token's routing entropy is at or below tau (sensitive token)
LLAMA_VIS_SUB_BLOCKED_MARGIN = 3  # its top-1 / top-2 weight margin is at or above gamma
LLAMA_VIS_SUB_BLOCKED_BETA = 4    # too many of the ubatch's experts in this layer are missing (> beta)
LLAMA_VIS_SUB_BLOCKED_BUDGET = 5  # the token already had its budget of substitutions in this layer
LLAMA_VIS_SUB_BLOCKED_WEIGHT = 6  # the expert's share of the token's gate weight is not below the threshold
LLAMA_VIS_SUB_NO_CANDIDATE = 7    # no resident expert qualifies (buddy list exhausted, all already chosen)
LLAMA_VIS_SUB_NEEDED_ANYWAY = 8   # another token of the ubatch loads this expert: no reason to substitute
LLAMA_VIS_SUB_NOT_ELIGIBLE = 9    # prefill ubatch without --moe-sub-prefill
LLAMA_VIS_SUB_BLOCKED_RANK = 10   # not among the token's --moe-sub-rank lowest-ranked experts
LLAMA_VIS_SUB_DROPPED = 11        # --moe-substitute drop: skipped (gate weight 0; exec = an expert the token runs)
LLAMA_VIS_SUB_N_OUTCOMES = 12


# struct llama_vis_moe_sub_stats {
#     int64_t n_tokens;              // (token, managed layer) evaluations the substitution step saw
#     int64_t n_tokens_substituted;  // ... with at least one substitution
#     int64_t n_missing;             // (token, expert) pairs whose expert was not resident
#     int64_t outcomes[LLAMA_VIS_SUB_N_OUTCOMES]; // of the missing pairs, by outcome (sum == n_missing)
#     int64_t bytes_saved;           // expert bytes not read before the layer could run
#     int64_t stall_saved_us;        // estimate: bytes_saved at this context's measured file read rate
#     int64_t bg_fetches;            // substituted-away experts read in the background
#     int64_t bg_wait_us;            // time compute waited for a background read still in flight (late)
# };
class llama_vis_moe_sub_stats(ctypes.Structure):
    _fields_ = [
        ("n_tokens", ctypes.c_int64),
        ("n_tokens_substituted", ctypes.c_int64),
        ("n_missing", ctypes.c_int64),
        ("outcomes", ctypes.c_int64 * LLAMA_VIS_SUB_N_OUTCOMES),
        ("bytes_saved", ctypes.c_int64),
        ("stall_saved_us", ctypes.c_int64),
        ("bg_fetches", ctypes.c_int64),
        ("bg_wait_us", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_moe_get_sub_stats(const struct llama_context * ctx, int32_t il,
#                                               struct llama_vis_moe_sub_stats * out);
@ctypes_function("llama_vis_moe_get_sub_stats",
                 [llama_context_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_sub_stats)], ctypes.c_int32)
def llama_vis_moe_get_sub_stats(ctx, il: int, out) -> int:
    """Substitution stats of layer il, or totals with il = -1. 0, or -1 if ctx has no expert cache or il is out
    of range."""


# ---------------------------------------------------------------------------
# Shadow experts and the precision policy (lossy; src/features/vis-moe-precision.cpp, docs/precision.md)
# ---------------------------------------------------------------------------
# struct llama_vis_moe_prec_stats {
#     int64_t n_eligible;      // missing experts the policy allowed to run from their shadow (per layer and ubatch)
#     int64_t n_shadow;        // ... that ran from it (auto: the controller's share of the eligible ones)
#     int64_t n_shadow_pairs;  // (token, expert) pairs computed from a shadow
#     int64_t n_shadow_hits;   // shadow experts found in a shadow slot
#     int64_t n_shadow_reads;  // ... read from the sidecar
#     int64_t bytes_shadow;    // shadow bytes read
#     int64_t bytes_saved;     // full-precision bytes the critical path did not read (less the shadow bytes read)
#     int64_t n_refetch;       // full-precision experts of shadow-served misses queued for a background read
#     int64_t load_us;         // time spent filling shadow slots
#     int64_t n_vision_ubatches;  // ubatches of this layer counted vision-dominated
#     int64_t n_switches;      // totals only: changes of the served share by the auto controller
#     int32_t share_pct;       // totals only: the share of eligible misses the controller serves from shadows now, %
# };
class llama_vis_moe_prec_stats(ctypes.Structure):
    _fields_ = [
        ("n_eligible", ctypes.c_int64),
        ("n_shadow", ctypes.c_int64),
        ("n_shadow_pairs", ctypes.c_int64),
        ("n_shadow_hits", ctypes.c_int64),
        ("n_shadow_reads", ctypes.c_int64),
        ("bytes_shadow", ctypes.c_int64),
        ("bytes_saved", ctypes.c_int64),
        ("n_refetch", ctypes.c_int64),
        ("load_us", ctypes.c_int64),
        ("n_vision_ubatches", ctypes.c_int64),
        ("n_switches", ctypes.c_int64),
        ("share_pct", ctypes.c_int32),
    ]


# LLAMA_API int32_t llama_vis_moe_get_prec_stats(const struct llama_context * ctx, int32_t il,
#                                                struct llama_vis_moe_prec_stats * out);
@ctypes_function("llama_vis_moe_get_prec_stats",
                 [llama_context_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_prec_stats)], ctypes.c_int32)
def llama_vis_moe_get_prec_stats(ctx, il: int, out) -> int:
    """Shadow-expert stats of layer il, or totals with il = -1. 0, or -1 if ctx has no expert cache or il is out
    of range."""


# // Entropy-weighted capacity (lossy; --moe-capacity, src/features/vis-moe-capacity.cpp, docs/precision.md): per managed layer
# // and ubatch with image tokens, at most C distinct missing experts that only image tokens route are loaded; the other
# // image pairs are rerouted to experts in memory, or dropped as a last resort.
# struct llama_vis_moe_cap_stats {
#     int64_t n_ubatches;   // (layer, ubatch) evaluations with image tokens the capacity rule saw
#     int64_t capacity;     // sum of their capacities C
#     double  rv_sum;       // sum of their effective visual ratios R_v (mean: rv_sum / n_ubatches)
#     int64_t n_missing;    // distinct missing experts only image tokens routed
#     int64_t n_loaded;     // ... loaded within the capacity
#     int64_t n_overflow;   // ... over it
#     int64_t n_forced;     // overflow experts loaded after all (a pair had no target and could not be dropped)
#     int64_t n_rerouted;   // (token, expert) pairs rerouted to an expert in memory
#     int64_t n_dropped;    // pairs dropped (gate weight 0)
#     int64_t bytes_saved;  // expert bytes not read: (n_overflow - n_forced) experts
# };
class llama_vis_moe_cap_stats(ctypes.Structure):
    _fields_ = [
        ("n_ubatches", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
        ("rv_sum", ctypes.c_double),
        ("n_missing", ctypes.c_int64),
        ("n_loaded", ctypes.c_int64),
        ("n_overflow", ctypes.c_int64),
        ("n_forced", ctypes.c_int64),
        ("n_rerouted", ctypes.c_int64),
        ("n_dropped", ctypes.c_int64),
        ("bytes_saved", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_moe_get_cap_stats(const struct llama_context * ctx, int32_t il,
#                                               struct llama_vis_moe_cap_stats * out);
@ctypes_function("llama_vis_moe_get_cap_stats",
                 [llama_context_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_cap_stats)], ctypes.c_int32)
def llama_vis_moe_get_cap_stats(ctx, il: int, out) -> int:
    """Capacity stats of layer il, or totals with il = -1. 0, or -1 if ctx has no expert cache or il is out of
    range."""


# LLAMA_API int32_t llama_vis_moe_macs_weights(const float * embd, int64_t n_tokens, int64_t n_embd, float delta,
#                                              float * out);
@ctypes_function("llama_vis_moe_macs_weights",
                 [ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                  ctypes.POINTER(ctypes.c_float)], ctypes.c_int32)
def llama_vis_moe_macs_weights(embd, n_tokens: int, n_embd: int, delta: float, out) -> int:
    """MACS's weight of each of n_tokens embedding rows: sigmoid(-delta * z-scored softmax entropy). 0, or -1 on
    bad arguments."""


# struct llama_vis_moe_prefetch_stats {
#     int64_t n_steps;        // steps (ubatches) the layer was predicted for
#     int64_t n_predicted;    // experts predicted for the layer from the layer before it (top-B, d = 1)
#     int64_t n_pred_hits;    // ... that the layer then routed (precision = n_pred_hits / n_predicted)
#     int64_t n_routed;       // distinct experts the layer routed in those steps (recall = n_pred_hits / n_routed)
#     int64_t n_issued;       // experts made resident ahead of need (background reads and host-cache copies)
#     int64_t n_used;         // ... that the step they were read for routed
#     int64_t n_wasted;       // ... that it did not route
#     int64_t n_late;         // used ones still being read when the layer needed them (a partial stall)
#     int64_t n_cancelled;    // background reads dropped before they started (the layer came first)
#     int64_t bytes_read;     // bytes read ahead (issued and not cancelled)
#     int64_t bytes_wasted;   // ... of wasted ones
#     int64_t wait_us;        // time the layer waited for reads ahead still in flight
#     int64_t saved_us;       // estimate: used reads at this context's measured read rate, minus wait_us
#     int64_t n_off_steps;    // steps the self-tuning kept the layer's prefetch off (it wasted more than it used)
#     int32_t enabled;        // prefetch is on for the layer now
#     // totals only (il = -1): the measured on/off choice of --moe-prefetch-tune (median decode step time of the
#     // last probe with reads ahead on and off; probes decided, and how many chose on; the setting now)
#     int32_t ab_probes;
#     int64_t ab_on_us;
#     int64_t ab_off_us;
#     int32_t ab_chose_on;
#     int32_t ab_running_on;
# };
class llama_vis_moe_prefetch_stats(ctypes.Structure):
    _fields_ = [
        ("n_steps", ctypes.c_int64),
        ("n_predicted", ctypes.c_int64),
        ("n_pred_hits", ctypes.c_int64),
        ("n_routed", ctypes.c_int64),
        ("n_issued", ctypes.c_int64),
        ("n_used", ctypes.c_int64),
        ("n_wasted", ctypes.c_int64),
        ("n_late", ctypes.c_int64),
        ("n_cancelled", ctypes.c_int64),
        ("bytes_read", ctypes.c_int64),
        ("bytes_wasted", ctypes.c_int64),
        ("wait_us", ctypes.c_int64),
        ("saved_us", ctypes.c_int64),
        ("n_off_steps", ctypes.c_int64),
        ("enabled", ctypes.c_int32),
        ("ab_probes", ctypes.c_int32),
        ("ab_on_us", ctypes.c_int64),
        ("ab_off_us", ctypes.c_int64),
        ("ab_chose_on", ctypes.c_int32),
        ("ab_running_on", ctypes.c_int32),
    ]


# LLAMA_API int32_t llama_vis_moe_get_prefetch_stats(const struct llama_context * ctx, int32_t il,
#                                                    struct llama_vis_moe_prefetch_stats * out);
@ctypes_function("llama_vis_moe_get_prefetch_stats",
                 [llama_context_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_prefetch_stats)], ctypes.c_int32)
def llama_vis_moe_get_prefetch_stats(ctx, il: int, out) -> int:
    """Prefetch stats of layer il, or totals with il = -1. 0, or -1 if ctx has no expert cache or il is out of
    range."""


# LLAMA_API int32_t llama_vis_moe_router_hash(const struct llama_model * model, uint64_t * out);
@ctypes_function("llama_vis_moe_router_hash", [llama_model_p, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int32)
def llama_vis_moe_router_hash(model, out) -> int:
    """The fingerprint a profile must match: the routers' stored bytes hashed as in docs/substitution.md
    (pyvis.runtime.profile.router_hash computes the same from the GGUF). 0, or -1 with llama_vis_last_error()
    (no routers, or routers the host cannot read as stored)."""
