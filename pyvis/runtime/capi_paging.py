"""Part of the 1:1 ctypes mirror of src/api/llama-vis.h (:mod:`pyvis.runtime.capi`, which re-exports it): its
section src/api/llama-vis-paging.h (tier parameters, I/O stats, the memory probe and planner), in the header's order."""
from __future__ import annotations

import ctypes

from .capi_lib import ctypes_function, llama_context_p
from .capi_moe import llama_vis_moe_params

# ---------------------------------------------------------------------------
# Paging tiers
# ---------------------------------------------------------------------------
# struct llama_vis_moe_tier_params {
#     int32_t store;       // 0 = file (tier 3; default), 1 = model (experts loaded by llama.cpp, copied from RAM/mmap)
#     int64_t host_mib;    // tier-2 budget in MiB; -1 = planned by --moe-mem (else 0), 0 = none
#     int64_t mem_mib;     // total memory budget of the process for --moe-mem: 0 = off, -1 = auto (cgroup, MemAvailable)
#     int32_t io_threads;  // parallel expert reads (default 4)
#     int32_t direct_io;   // -1 = auto (O_DIRECT where allowed), 0 = buffered reads (pages dropped after), 1 = O_DIRECT
#     int32_t unified;     // -1 = auto, 0 = off, 1 = on: slabs are written straight from the file
#     int32_t mlock;       // 1 = lock slabs and the host cache in memory (default), 0 = don't
# };
class llama_vis_moe_tier_params(ctypes.Structure):
    _fields_ = [
        ("store", ctypes.c_int32),
        ("host_mib", ctypes.c_int64),
        ("mem_mib", ctypes.c_int64),
        ("io_threads", ctypes.c_int32),
        ("direct_io", ctypes.c_int32),
        ("unified", ctypes.c_int32),
        ("mlock", ctypes.c_int32),
    ]


# LLAMA_API struct llama_vis_moe_tier_params llama_vis_moe_tier_default_params(void);
@ctypes_function("llama_vis_moe_tier_default_params", [], llama_vis_moe_tier_params)
def llama_vis_moe_tier_default_params() -> llama_vis_moe_tier_params:
    """Defaults from VIS_MOE_STORE, VIS_MOE_HOST_MIB, VIS_MOE_MEM, ... else the built-in values."""


# LLAMA_API struct llama_vis_moe_tier_params llama_vis_moe_get_tier_params(void);
@ctypes_function("llama_vis_moe_get_tier_params", [], llama_vis_moe_tier_params)
def llama_vis_moe_get_tier_params() -> llama_vis_moe_tier_params:
    """In force on the calling thread (its override, else the process-wide ones)."""


# LLAMA_API int32_t llama_vis_moe_set_tier_params(const struct llama_vis_moe_tier_params * params);
@ctypes_function("llama_vis_moe_set_tier_params", [ctypes.POINTER(llama_vis_moe_tier_params)], ctypes.c_int32)
def llama_vis_moe_set_tier_params(params) -> int:
    """Process-wide, for models loaded and contexts created from now on; NULL resets. 0, or -1."""


# LLAMA_API int32_t llama_vis_moe_set_thread_params(const struct llama_vis_moe_params * params,
#                                                   const struct llama_vis_moe_tier_params * tier);
@ctypes_function("llama_vis_moe_set_thread_params",
                 [ctypes.POINTER(llama_vis_moe_params), ctypes.POINTER(llama_vis_moe_tier_params)], ctypes.c_int32)
def llama_vis_moe_set_thread_params(params, tier) -> int:
    """Override both settings structs for the calling thread only (NULL for one: the process-wide value at the
    time of the call).  Both NULL: drop the override.  0, or -1 with llama_vis_last_error()."""


# LLAMA_API int32_t llama_vis_moe_thread_params_active(void);
@ctypes_function("llama_vis_moe_thread_params_active", [], ctypes.c_int32)
def llama_vis_moe_thread_params_active() -> int:
    """1 if the calling thread has an override, else 0."""


# struct llama_vis_moe_io_stats {
#     int64_t slab_hits;      // tier 1: routed experts found in a slab
#     int64_t host_hits;      // tier 2: misses served from the host cache
#     int64_t file_reads;     // tier 3: misses read from the file (experts)
#     int64_t model_copies;   // misses copied from llama.cpp's own copy (store = model)
#     int64_t bytes_read;     // payload bytes read from the file
#     int64_t bytes_storage;  // bytes requested from storage (O_DIRECT reads are 4 KiB-aligned supersets)
#     int64_t read_us;        // wall time compute waited for file reads
#     int64_t host_bytes;     // tier-2 capacity in bytes
#     int64_t host_used;      // bytes in tier 2 now
#     int64_t host_evictions;
#     int64_t slab_bytes;     // tier-1 bytes
#     int32_t direct_io;      // 1 if reads use O_DIRECT
#     int32_t unified;        // 1 if slabs are filled straight from the file
#     int32_t locked;         // 1 if slabs and host cache are locked in memory
#     int32_t io_threads;
#     int64_t major_faults;   // major page faults of the process since the context was created
#     int64_t rss_peak;       // peak resident set of the process (VmHWM), bytes
#     int64_t streamed;       // experts a large ubatch read through the mapping instead of the slabs
#     int64_t bytes_streamed; // their bytes
#     int64_t bytes_copied;   // payload bytes of file reads copied out of an O_DIRECT bounce buffer
# };
class llama_vis_moe_io_stats(ctypes.Structure):
    _fields_ = [
        ("slab_hits", ctypes.c_int64),
        ("host_hits", ctypes.c_int64),
        ("file_reads", ctypes.c_int64),
        ("model_copies", ctypes.c_int64),
        ("bytes_read", ctypes.c_int64),
        ("bytes_storage", ctypes.c_int64),
        ("read_us", ctypes.c_int64),
        ("host_bytes", ctypes.c_int64),
        ("host_used", ctypes.c_int64),
        ("host_evictions", ctypes.c_int64),
        ("slab_bytes", ctypes.c_int64),
        ("direct_io", ctypes.c_int32),
        ("unified", ctypes.c_int32),
        ("locked", ctypes.c_int32),
        ("io_threads", ctypes.c_int32),
        ("major_faults", ctypes.c_int64),
        ("rss_peak", ctypes.c_int64),
        ("streamed", ctypes.c_int64),
        ("bytes_streamed", ctypes.c_int64),
        ("bytes_copied", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_moe_get_io_stats(const struct llama_context * ctx, struct llama_vis_moe_io_stats * out);
@ctypes_function("llama_vis_moe_get_io_stats", [llama_context_p, ctypes.POINTER(llama_vis_moe_io_stats)],
                 ctypes.c_int32)
def llama_vis_moe_get_io_stats(ctx, out) -> int:
    """Stats of the paging tiers of ctx. 0, or -1 if ctx has no expert cache."""


# struct llama_vis_moe_overlap_stats {
#     int32_t max_passes;   // miss passes a one-token step of the layer gets (0: not overlapped; totals: the most)
#     int64_t n_ubatches;   // ubatch x layer evaluations whose misses were read while the layer computed
#     int64_t n_reads;      // misses read so (tier 3); misses served from memory are not counted
#     int64_t n_passes;     // miss passes run (an empty one included)
#     int64_t wait_us;      // time the miss passes waited for their reads (the stall left)
#     int64_t hidden_us;    // wall time the layer computed while its reads were under way
#     int64_t n_late;       // reads issued after the layer's resident experts began computing (0 unless broken)
# };
class llama_vis_moe_overlap_stats(ctypes.Structure):
    _fields_ = [
        ("max_passes", ctypes.c_int32),
        ("n_ubatches", ctypes.c_int64),
        ("n_reads", ctypes.c_int64),
        ("n_passes", ctypes.c_int64),
        ("wait_us", ctypes.c_int64),
        ("hidden_us", ctypes.c_int64),
        ("n_late", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_moe_get_overlap_stats(const struct llama_context * ctx, int32_t il,
#                                                   struct llama_vis_moe_overlap_stats * out);
@ctypes_function("llama_vis_moe_get_overlap_stats",
                 [llama_context_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_overlap_stats)], ctypes.c_int32)
def llama_vis_moe_get_overlap_stats(ctx, il, out) -> int:
    """Overlap stats of layer il, or totals with il = -1. 0, or -1 without a cache or il out of range."""


# struct llama_vis_mem_info {
#     int64_t mem_total;       // MemTotal
#     int64_t mem_available;   // MemAvailable
#     int64_t swap_total;      // SwapTotal
#     int64_t swap_free;       // SwapFree
#     int64_t zram_bytes;      // memory used by zram swap devices (0 if none)
#     int64_t cgroup_limit;    // tightest memory limit over our cgroup and its parents (v1 or v2), -1 if none
#     int64_t cgroup_usage;    // usage of the cgroup holding that limit (page cache included), -1 if unknown
#     int32_t cgroup_version;  // 2, 1, or 0 if no memory cgroup was found
#     int64_t rss;             // VmRSS of this process
#     int64_t rss_peak;        // VmHWM of this process
#     int64_t major_faults;    // major page faults of this process so far
#     int64_t limit;           // min(cgroup_limit, MemTotal): what the process may ever use
#     int64_t available;       // min(cgroup_limit - cgroup_usage + rss, MemAvailable + rss): what it may use now
# };
class llama_vis_mem_info(ctypes.Structure):
    _fields_ = [
        ("mem_total", ctypes.c_int64),
        ("mem_available", ctypes.c_int64),
        ("swap_total", ctypes.c_int64),
        ("swap_free", ctypes.c_int64),
        ("zram_bytes", ctypes.c_int64),
        ("cgroup_limit", ctypes.c_int64),
        ("cgroup_usage", ctypes.c_int64),
        ("cgroup_version", ctypes.c_int32),
        ("rss", ctypes.c_int64),
        ("rss_peak", ctypes.c_int64),
        ("major_faults", ctypes.c_int64),
        ("limit", ctypes.c_int64),
        ("available", ctypes.c_int64),
    ]


# LLAMA_API int32_t llama_vis_mem_probe(struct llama_vis_mem_info * out);
@ctypes_function("llama_vis_mem_probe", [ctypes.POINTER(llama_vis_mem_info)], ctypes.c_int32)
def llama_vis_mem_probe(out) -> int:
    """What this machine gives us."""


# struct llama_vis_moe_plan_request {
#     int64_t budget;            // bytes for the whole process; <= 0: the machine's (llama_vis_mem_probe().available)
#     int64_t resident_bytes;    // weights that stay resident (everything but the managed experts)
#     int64_t kv_bytes;          // KV cache
#     int64_t reserve_bytes;     // compute buffers, runtime and slack
#     int64_t expert_bytes;      // one expert of one managed layer (gate + up + down)
#     int32_t n_managed_layers;  // MoE layers after the pinned prefix
#     int32_t n_expert;
#     int32_t n_expert_used;     // top-k
#     int32_t unified;           // 1: slabs live in the same memory (CPU, Jetson); 0: discrete GPU
#     int64_t device_bytes;      // discrete GPU: device memory for slabs (ignored when unified)
#     int64_t host_mib;          // explicit tier-2 budget; -1: plan it
#     int32_t n_slots;           // explicit slots per layer; 0: plan them
#     int32_t no_staging;        // 1: CPU-only run, the slabs need no staging slot (0: one per layer)
#     int64_t encoder_bytes;     // the vision encoder next to the text model (0: none), planned like reserve_bytes
#     int64_t io_bytes;          // the expert reads' O_DIRECT bounce buffers and the slabs' in-page placement
# };
class llama_vis_moe_plan_request(ctypes.Structure):
    _fields_ = [
        ("budget", ctypes.c_int64),
        ("resident_bytes", ctypes.c_int64),
        ("kv_bytes", ctypes.c_int64),
        ("reserve_bytes", ctypes.c_int64),
        ("expert_bytes", ctypes.c_int64),
        ("n_managed_layers", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("unified", ctypes.c_int32),
        ("device_bytes", ctypes.c_int64),
        ("host_mib", ctypes.c_int64),
        ("n_slots", ctypes.c_int32),
        ("no_staging", ctypes.c_int32),
        ("encoder_bytes", ctypes.c_int64),
        ("io_bytes", ctypes.c_int64),
    ]


# struct llama_vis_moe_plan {
#     int32_t ok;                // 1 fits; 0 does not (reason in llama_vis_last_error())
#     int32_t n_slots;           // slots per managed layer (n_expert: everything resident)
#     int64_t slab_bytes;        // tier 1 (including the staging slot per layer, unless no_staging)
#     int64_t host_bytes;        // tier 2
#     int64_t budget;            // the budget planned for
#     int64_t fixed_bytes;       // resident weights + KV + reserve + encoder + I/O buffers
#     int64_t min_budget;        // the smallest budget that runs (KV, compute, one slot (+ staging) per layer)
#     int64_t file_only_bytes;   // managed expert bytes held in neither tier 1 nor tier 2
#     int64_t tight_budget;      // below this budget there are fewer than top-k slots per layer
#     int64_t pageable_bytes;    // resident weights that do not fit next to the minimal slabs
#     int32_t extra_slots;       // one more slot in this many managed layers (the bytes left after whole rows)
# };
# (the struct shares its name with the function below: in Python it is struct_llama_vis_moe_plan)
class struct_llama_vis_moe_plan(ctypes.Structure):
    _fields_ = [
        ("ok", ctypes.c_int32),
        ("n_slots", ctypes.c_int32),
        ("slab_bytes", ctypes.c_int64),
        ("host_bytes", ctypes.c_int64),
        ("budget", ctypes.c_int64),
        ("fixed_bytes", ctypes.c_int64),
        ("min_budget", ctypes.c_int64),
        ("file_only_bytes", ctypes.c_int64),
        ("tight_budget", ctypes.c_int64),
        ("pageable_bytes", ctypes.c_int64),
        ("extra_slots", ctypes.c_int32),
    ]


# LLAMA_API int32_t llama_vis_moe_plan(const struct llama_vis_moe_plan_request * req, struct llama_vis_moe_plan * out);
@ctypes_function("llama_vis_moe_plan", [ctypes.POINTER(llama_vis_moe_plan_request),
                                        ctypes.POINTER(struct_llama_vis_moe_plan)], ctypes.c_int32)
def llama_vis_moe_plan(req, out) -> int:
    """How one memory budget splits over resident weights, KV cache, compute, slabs and the host cache."""


# struct llama_vis_moe_cost {
#     double  read_bps;          // bytes/s of expert reads from the model file (llama_vis_moe_cost_default)
#     double  mem_bps;           // bytes/s of reading weights from memory (a memory-bound matmul)
#     double  pass_s;            // seconds one extra pass of one managed layer costs ...
#     double  pass_token_s;      // ... plus this per token of its ubatch
#     double  token_s;           // seconds of compute per prompt token in a large batch; <= 0: from mem_bps
#     int32_t stream_passes;     // a ubatch needing more passes than this in a layer streams it (0 = never)
#     int32_t prompt_tokens;     // one request: prompt tokens (prefill) ...
#     int32_t gen_tokens;        // ... and generated tokens (decode)
#     double  token_byte_s;      // seconds per prompt token per weight byte at a large batch (the probe; 0: prior)
#     int32_t probed;            // 1: mem_bps, token_byte_s and the pass costs were timed
#     int32_t gen_tokens;        // ... and generated tokens (decode)
# };
class llama_vis_moe_cost(ctypes.Structure):
    _fields_ = [
        ("read_bps", ctypes.c_double),
        ("mem_bps", ctypes.c_double),
        ("pass_s", ctypes.c_double),
        ("pass_token_s", ctypes.c_double),
        ("token_s", ctypes.c_double),
        ("stream_passes", ctypes.c_int32),
        ("prompt_tokens", ctypes.c_int32),
        ("gen_tokens", ctypes.c_int32),
        ("token_byte_s", ctypes.c_double),
        ("probed", ctypes.c_int32),
    ]


# struct llama_vis_moe_configure_request {
#     struct llama_vis_moe_plan_request plan;  // the --moe-mem request; reserve_bytes replaced per candidate ubatch
#     int64_t n_vocab;           // the model's shape, for the reserve estimate
#     int64_t n_embd;
#     int64_t n_ff_exp;
#     int32_t n_ubatch;          // the ubatch asked for: the largest candidate
#     int32_t n_ubatch_min;      // the smallest candidate; <= 0: the runtime's, 16
#     const float * miss_curve;  // NULL: the uniform prior; else [n_managed_layers][n_expert + 1] misses per token
#     int32_t * layer_slots;     // optional out [n_managed_layers]: the slab bytes split per layer by marginal value,
#                                // then the plan's extra_slots by the same curves
#     struct llama_vis_moe_cost cost;
#     int32_t borrow;            // 1: decode priced with the plan at n_ubatch_min's estimate (VIS_MOE_BORROW); 0: off
# };
class llama_vis_moe_configure_request(ctypes.Structure):
    _fields_ = [
        ("plan", llama_vis_moe_plan_request),
        ("n_vocab", ctypes.c_int64),
        ("n_embd", ctypes.c_int64),
        ("n_ff_exp", ctypes.c_int64),
        ("n_ubatch", ctypes.c_int32),
        ("n_ubatch_min", ctypes.c_int32),
        ("miss_curve", ctypes.POINTER(ctypes.c_float)),
        ("layer_slots", ctypes.POINTER(ctypes.c_int32)),
        ("cost", llama_vis_moe_cost),
        ("borrow", ctypes.c_int32),
    ]


# struct llama_vis_moe_configuration {
#     int32_t ok;                // 1: a plan fits (else llama_vis_last_error(); plan.min_budget at n_ubatch_min)
#     int32_t n_ubatch;          // the chosen ubatch (<= the asked)
#     struct llama_vis_moe_plan plan;  // llama_vis_moe_plan at n_ubatch (with its extra_slots): what the runtime runs
#     double  decode_tps;        // predicted tokens/s of decode and prefill with this plan ...
#     double  prefill_tps;
#     double  asked_decode_tps;  // ... and with the plan at the asked ubatch
#     double  asked_prefill_tps;
#     int32_t asked_n_slots;
#     int32_t asked_extra_slots; // ... and its extra_slots
#     double  mv_slot;           // seconds saved per request per MiB by the last slot row
#     double  mv_next_slot;      // ... by the next slot row
#     double  mv_ubatch_down;    // ... by the last ubatch doubling
#     double  mv_ubatch_up;      // ... by the next ubatch doubling
#     int32_t n_pinned;          // leading managed layers that layer_slots gives every expert
#     double  layer_decode_tps;  // predicted decode tokens/s with layer_slots (0: not asked)
# };
class llama_vis_moe_configuration(ctypes.Structure):
    _fields_ = [
        ("ok", ctypes.c_int32),
        ("n_ubatch", ctypes.c_int32),
        ("plan", struct_llama_vis_moe_plan),
        ("decode_tps", ctypes.c_double),
        ("prefill_tps", ctypes.c_double),
        ("asked_decode_tps", ctypes.c_double),
        ("asked_prefill_tps", ctypes.c_double),
        ("asked_n_slots", ctypes.c_int32),
        ("asked_extra_slots", ctypes.c_int32),
        ("mv_slot", ctypes.c_double),
        ("mv_next_slot", ctypes.c_double),
        ("mv_ubatch_down", ctypes.c_double),
        ("mv_ubatch_up", ctypes.c_double),
        ("n_pinned", ctypes.c_int32),
        ("layer_decode_tps", ctypes.c_double),
    ]


# LLAMA_API int32_t llama_vis_moe_configure(const struct llama_vis_moe_configure_request * req,
#                                           struct llama_vis_moe_configuration * out);
@ctypes_function("llama_vis_moe_configure", [ctypes.POINTER(llama_vis_moe_configure_request),
                                             ctypes.POINTER(llama_vis_moe_configuration)], ctypes.c_int32)
def llama_vis_moe_configure(req, out) -> int:
    """The marginal-value configurator: the ubatch and slots with the lowest predicted latency in one budget."""


# enum llama_vis_moe_configure_verdict { ... };  whether the runtime runs a configuration, and why not
LLAMA_VIS_MOE_CONFIGURE_APPLIED = 0  # the runtime runs at conf->n_ubatch
LLAMA_VIS_MOE_CONFIGURE_OFF = 1      # mode 0: the asked ubatch
LLAMA_VIS_MOE_CONFIGURE_NOT_F32 = 2  # auto, weights not all F32: outputs differ in the last bits at another ubatch


# LLAMA_API int32_t llama_vis_moe_configure_applies(const struct llama_vis_moe_configure_request * req,
#                                                   const struct llama_vis_moe_configuration * conf, int32_t mode,
#                                                   int32_t all_f32);
@ctypes_function("llama_vis_moe_configure_applies", [ctypes.POINTER(llama_vis_moe_configure_request),
                                                     ctypes.POINTER(llama_vis_moe_configuration), ctypes.c_int32,
                                                     ctypes.c_int32], ctypes.c_int32)
def llama_vis_moe_configure_applies(req, conf, mode: int, all_f32: int) -> int:
    """Whether the runtime runs a configuration (mode: -1 auto, 1 on, 0 off): an llama_vis_moe_configure_verdict."""


# LLAMA_API int32_t llama_vis_moe_split_slots(const double * miss_curve, int32_t n_layers, int32_t n_expert,
#                                             int32_t n_expert_used, int32_t slots, const int64_t * row_bytes,
#                                             int32_t * out);
@ctypes_function("llama_vis_moe_split_slots",
                 [ctypes.POINTER(ctypes.c_double), ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                  ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)], ctypes.c_int32)
def llama_vis_moe_split_slots(miss_curve, n_layers: int, n_expert: int, n_expert_used: int, slots: int, row_bytes,
                              out) -> int:
    """Per-layer slot counts from one expert budget by the layers' miss curves (the rule VIS_MOE_SLOT_SPLIT runs)."""


# LLAMA_API int32_t llama_vis_moe_extra_slots(const double * miss_curve, int32_t n_layers, int32_t n_expert,
#                                             const int32_t * slots, int32_t extra, int32_t * out);
@ctypes_function("llama_vis_moe_extra_slots",
                 [ctypes.POINTER(ctypes.c_double), ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                  ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)], ctypes.c_int32)
def llama_vis_moe_extra_slots(miss_curve, n_layers: int, n_expert: int, slots, extra: int, out) -> int:
    """One more slot in `extra` layers (the bytes a plan leaves after whole slot rows)."""


# LLAMA_API int32_t llama_vis_moe_cost_default(const char * path, struct llama_vis_moe_cost * cost);
@ctypes_function("llama_vis_moe_cost_default", [ctypes.c_char_p, ctypes.POINTER(llama_vis_moe_cost)], ctypes.c_int32)
def llama_vis_moe_cost_default(path, cost) -> int:
    """The cost model --moe-mem configures with: probed (cached) bandwidths of the file at path and the knobs."""


# LLAMA_API int32_t llama_vis_moe_cost_probe(const char * path, int32_t type, int64_t n_embd, int64_t n_ff_exp,
#                                            int32_t n_expert_used, int32_t n_threads, struct llama_vis_moe_cost * cost);
@ctypes_function("llama_vis_moe_cost_probe", [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_cost)],
                 ctypes.c_int32)
def llama_vis_moe_cost_probe(path, type_, n_embd, n_ff_exp, n_expert_used, n_threads, cost) -> int:
    """llama_vis_moe_cost_default with the compute side timed through the ggml backend (cached per type, shape and
    threads; the VIS_MOE_MEM_MBPS / TOKEN_NS_PER_MIB / PASS_US / PASS_TOKEN_US knobs override it)."""


# LLAMA_API int64_t llama_vis_moe_estimate_reserve(int64_t n_ubatch, int64_t n_vocab, int64_t n_embd,
#                                                  int64_t n_expert_used, int64_t n_ff_exp);
@ctypes_function("llama_vis_moe_estimate_reserve",
                 [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64], ctypes.c_int64)
def llama_vis_moe_estimate_reserve(n_ubatch: int, n_vocab: int, n_embd: int, n_expert_used: int,
                                   n_ff_exp: int) -> int:
    """The one estimate of compute buffers + runtime that --moe-mem plans with (reserve_bytes): bytes."""


# LLAMA_API int64_t llama_vis_moe_io_buffer_bytes(int32_t io_threads, int64_t slice_bytes, int32_t n_slab_tensors);
@ctypes_function("llama_vis_moe_io_buffer_bytes", [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32], ctypes.c_int64)
def llama_vis_moe_io_buffer_bytes(io_threads: int, slice_bytes: int, n_slab_tensors: int) -> int:
    """The expert reads' memory that --moe-mem plans with (io_bytes): bounce buffers and slab placement, bytes."""


# LLAMA_API int64_t llama_vis_moe_context_reserve(const struct llama_context * ctx);
@ctypes_function("llama_vis_moe_context_reserve", [llama_context_p], ctypes.c_int64)
def llama_vis_moe_context_reserve(ctx) -> int:
    """The reserve the context's memory plan used; -1 if ctx has no --moe-mem plan."""


# LLAMA_API int32_t llama_vis_moe_whole_model_fits(int64_t model_bytes, int64_t budget_bytes);
@ctypes_function("llama_vis_moe_whole_model_fits", [ctypes.c_int64, ctypes.c_int64], ctypes.c_int32)
def llama_vis_moe_whole_model_fits(model_bytes: int, budget_bytes: int) -> int:
    """1 if the whole model fits the budget (<= 0: the machine's): --moe-mem alone then runs upstream's path."""


# struct llama_vis_encoder_estimate {
#     int64_t weight_bytes;      // the projector's tensors
#     int64_t compute_bytes;     // its compute buffer for an image of image_tokens (estimate)
#     int64_t image_bytes;       // host copies of that image: the preprocessed f32 image and the output embeddings
#     int64_t total_bytes;       // the sum: what --moe-mem plans for the encoder
#     int32_t image_tokens;      // the largest image planned for, in output tokens (0: no vision encoder)
#     int32_t n_patches;         // its patches
#     int32_t flash_attn;        // 1: planned with flash attention in the encoder
#     int32_t warmup_tokens;     // the image clip's warmup lays the buffer out for (0: no warmup)
#     int32_t limit_known;       // 0: image_tokens is image_size's, a guess (pass image_max_tokens)
#     char    projector[32];     // clip.projector_type
# };
class llama_vis_encoder_estimate(ctypes.Structure):
    _fields_ = [
        ("weight_bytes", ctypes.c_int64),
        ("compute_bytes", ctypes.c_int64),
        ("image_bytes", ctypes.c_int64),
        ("total_bytes", ctypes.c_int64),
        ("image_tokens", ctypes.c_int32),
        ("n_patches", ctypes.c_int32),
        ("flash_attn", ctypes.c_int32),
        ("warmup_tokens", ctypes.c_int32),
        ("limit_known", ctypes.c_int32),
        ("projector", ctypes.c_char * 32),
    ]


# LLAMA_API int32_t llama_vis_moe_encoder_estimate(const char * mmproj_path, int32_t image_max_tokens, int32_t flash_attn,
#                                                  int32_t warmup, struct llama_vis_encoder_estimate * out);
@ctypes_function("llama_vis_moe_encoder_estimate", [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                                    ctypes.POINTER(llama_vis_encoder_estimate)], ctypes.c_int32)
def llama_vis_moe_encoder_estimate(mmproj_path, image_max_tokens: int, flash_attn: int, warmup: int, out) -> int:
    """The vision encoder's bytes (weights, compute buffer, image copies) from the mmproj GGUF. 0, or -1."""


# LLAMA_API int32_t llama_vis_moe_plan_encoder(const char * mmproj_path, int32_t image_max_tokens, int32_t flash_attn,
#                                              int32_t warmup);
@ctypes_function("llama_vis_moe_plan_encoder", [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32],
                 ctypes.c_int32)
def llama_vis_moe_plan_encoder(mmproj_path, image_max_tokens: int, flash_attn: int, warmup: int) -> int:
    """Plan that encoder with every model and context created from now on (NULL: none). 0, or -1."""


# LLAMA_API int64_t llama_vis_moe_planned_encoder(struct llama_vis_encoder_estimate * out);
@ctypes_function("llama_vis_moe_planned_encoder", [ctypes.POINTER(llama_vis_encoder_estimate)], ctypes.c_int64)
def llama_vis_moe_planned_encoder(out) -> int:
    """The encoder planned now (out may be NULL): its total_bytes, 0 if none."""


# LLAMA_API int32_t llama_vis_moe_encoder_releasable(const struct llama_context * ctx);
@ctypes_function("llama_vis_moe_encoder_releasable", [llama_context_p], ctypes.c_int32)
def llama_vis_moe_encoder_releasable(ctx) -> int:
    """1 if ctx's plan gives the encoder's bytes to the slots once the tool frees its encoder
    (VIS_MOE_ENCODER_RELEASE=on), else 0."""


# LLAMA_API int32_t llama_vis_moe_encoder_freed(struct llama_context * ctx);
@ctypes_function("llama_vis_moe_encoder_freed", [llama_context_p], ctypes.c_int32)
def llama_vis_moe_encoder_freed(ctx) -> int:
    """The tool has freed its encoder: ctx's expert slots grow by its bytes. 0, or -1."""
