// llama-vis-paging.h - paging tiers, I/O stats, the memory probe, the planner and the configurator.
// A section of llama-vis.h (include that), in its order; mirrored 1:1 by pyvis/runtime/capi_paging.py.
#pragma once

#include "llama-vis-moe.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

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
    int32_t * layer_slots;     // optional out [n_managed_layers]: the same slots split per layer (llama_vis_moe_split_slots),
                               // then the plan's extra_slots by the same curves (llama_vis_moe_extra_slots)
    struct llama_vis_moe_cost cost;
    int32_t borrow;            // 1: the runtime borrows slots (VIS_MOE_BORROW, docs/planning.md#borrowed-slots): a
                               // candidate's decode is priced with the plan at n_ubatch_min's compute estimate where
                               // that plan holds more slots and leaves no resident weight pageable; 0: off
};
struct llama_vis_moe_configuration {
    int32_t ok;                // 1: a plan fits (else the reason is in llama_vis_last_error(), plan.min_budget says
                               // the smallest budget at n_ubatch_min)
    int32_t n_ubatch;          // the chosen ubatch (<= the asked)
    struct llama_vis_moe_plan plan;  // llama_vis_moe_plan at n_ubatch: equal slots per layer and its extra_slots,
                                     // what the runtime runs (the tok/s below price the extra slots spread over depth)
    double  decode_tps;        // predicted tokens/s of decode and prefill with this plan ...
    double  prefill_tps;
    double  asked_decode_tps;  // ... and with the plan at the asked ubatch (today's fixed-rule plan)
    double  asked_prefill_tps;
    int32_t asked_n_slots;
    int32_t asked_extra_slots; // ... and its extra_slots (llama_vis_moe_plan)
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

#ifdef __cplusplus
}
#endif
