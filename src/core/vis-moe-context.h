// vis-moe-context.h - the state of one context's expert cache: per-layer slot
// tables and slabs, the backing tiers, stats.  Owned by llama_context::vis_moe
// (src/api/vis-owner.h), created by vis-moe-attach.cpp, destroyed with the context.
//
// Who does what (docs/architecture.md):
//   vis-moe-attach.cpp    sizing and creation (slots, slabs, tiers, locking)
//   vis-moe-graph.cpp     the graph of a managed layer (passes, merge, streaming)
//   vis-moe-ops.cpp       the CPU ops those graphs run (pass 0 makes the ubatch plan; slot ids, merge, stream advice)
//   vis-moe-apply.cpp     apply / apply_reads: the one place a ubatch plan (vis-moe-ubatch-plan.h) changes the cache
//   vis-moe-passes.cpp    pass planning and the slot table, eviction through vis-moe-policy.h
//   vis-moe-transfer.cpp  filling slots from tier 2, tier 3 or the model's copy
//   vis-moe-stats.cpp     stats API and the --moe-stats table
#pragma once

#include "llama-vis.h"
#include "vis-moe-feature.h"
#include "vis-moe-overlap-state.h"
#include "vis-moe-slot-pool.h"
#include "vis-moe-store.h"
#include "vis-moe-telemetry-types.h"
#include "vis-moe-ubatch-plan.h"
#include "vis-moe-upload.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

struct llama_model;
struct llama_layer;
struct llama_context;
class vis_moe_fetcher;
struct vis_moe_settings;
// the features (vis-moe-feature.h): the context holds typed, non-owning handles to them
class vis_moe_substitute;
class vis_moe_prefetcher;
class vis_moe_stager;
struct vis_moe_shadow;
class vis_moe_precision;
class vis_moe_capacity;
class vis_moe_lender;
class vis_moe_modality;
class vis_moe_replay;
class vis_moe_telemetry;
class vis_moe_encoder_release;
class vis_moe_borrow;
class vis_moe_trace;

// the expert tensors of a layer, in slab order
enum { VIS_T_GATE = 0, VIS_T_UP, VIS_T_DOWN, VIS_T_GATE_UP, VIS_T_COUNT };

// a model layer's routed-expert tensors in that order (null where the architecture has none; vis-moe-attach.cpp)
std::array<ggml_tensor *, VIS_T_COUNT> vis_moe_expert_tensors(const llama_layer & l);

// which custom op of a layer's graph (vis-moe-ops.h) a userdata belongs to
enum vis_op_kind { VIS_OP_PASS, VIS_OP_SELECT, VIS_OP_TRACE, VIS_OP_STREAM, VIS_OP_MERGE, VIS_OP_DROP, VIS_OP_PREDICT, VIS_OP_SHADOW,
                   VIS_OP_REPLAY_IDS, VIS_OP_REPLAY_WEIGHTS };

struct vis_moe_context;

// userdata of one custom op: which layer, pass and job
struct vis_moe_op_ud {
    vis_moe_context * vm;
    int il;
    int pass;
    vis_op_kind kind;
};

// the userdata of a context's custom ops, stable for its lifetime.  The graph holds a const context and asks for
// them (vis_moe_context::ud); each names the context it belongs to, given when the context was made: the ops
// change the cache through their userdata, never through the graph's pointer.
class vis_moe_op_uds {
public:
    explicit vis_moe_op_uds(vis_moe_context * owner) : vm(owner) {}
    vis_moe_op_ud * get(int il, int pass, vis_op_kind kind);

private:
    vis_moe_context * vm;
    std::map<std::tuple<int, int, int>, std::unique_ptr<vis_moe_op_ud>> uds;
};

struct vis_moe_layer {
    bool managed  = false;
    int  n_slots  = 0;      // cache slots; with a staging slot, slot index n_slots is it
    int  min_active = 0;    // the lowest slot limit a controller may set (the online controller, vis-moe-online.h;
                            // the encoder release until the encoder is freed), 0: none
    int  n_expert = 0;
    int64_t expert_bytes = 0;

    std::array<ggml_tensor *, VIS_T_COUNT> orig = {};  // the model's expert tensors
    std::array<ggml_tensor *, VIS_T_COUNT> slab = {};  // [ne0, ne1, n_slots (+ staging)]
    std::array<const vis_deferred_tensor *, VIS_T_COUNT> file = {};  // tier 3 (deferred at load), else null
    std::array<size_t, VIS_T_COUNT> part_off = {};  // offset of each tensor's slice in a packed expert
    bool deferred     = false;  // experts come from the file
    bool direct_write = false;  // slabs are CPU-writable: read straight into them
    bool bg_staged    = false;  // background reads go through a staging block: device slabs, or managed memory
                                // that the CPU may write only between kernels (Jetson, vis-moe-fetch.h)
    vis_moe_uploader * upload = nullptr;  // discrete GPU: the upload stream of the slabs' device, else null
    bool cpu_passes   = false;  // CPU-only layer: pairs of other passes are skipped (id -1, patch 0006)
                                // and passes merge in place, instead of staging slot + concat

    // the slot table and eviction policy of the slabs (vis-moe-slot-pool.h: its only writer)
    vis_slot_pool slots;

    // the ubatch plan it runs (vis-moe-ubatch-plan.h: route, serve, passes, reads), swapped in by
    // vis_moe_context::apply; the ops of its passes read it
    vis_ubatch_plan ubatch_plan;

    llama_vis_moe_stats stats = {};

    // the shadow slots (--moe-precision; the second slot pool, vis-moe-slot-pool.h)
    vis_shadow_slots shadow;

    // decode misses read while the layer computes (VIS_MOE_OVERLAP, vis-moe-overlap.h)
    vis_overlap_layer overlap;

    // the ids the passes of the running ubatch use: exec with stand-ins, else the routed ids
    const int32_t * run_ids(const int32_t * routed) const { return ubatch_plan.run_ids(routed); }

    // the first slab tensor (every managed layer has one)
    ggml_tensor * any_slab() const {
        for (ggml_tensor * t : slab) {
            if (t) {
                return t;
            }
        }
        return nullptr;
    }
    // the mapped file of the layer's deferred experts, or null
    const vis_gguf_file * any_file() const {
        for (const auto * f : file) {
            if (f) {
                return f->file.get();
            }
        }
        return nullptr;
    }
    // prefill streaming can serve it (docs/paging.md#prefill-streaming): its experts come from the file and it runs
    // on the CPU only (with a GPU, a host-weight mul_mat_id would be copied to the device whole)
    bool can_stream() const { return managed && deferred && cpu_passes; }
    // the id a pair of another pass gets: skipped on CPU (-1), else the staging slot (made distinct per token by
    // vis_moe_distinct_foreign, vis-moe-passes.h)
    int32_t foreign_id() const { return cpu_passes ? -1 : n_slots; }
    // this layer's share of `slots` per layer when its slabs hold n_slots of the average layer's `of` (a per-layer
    // split scales with the even count), at least one: the slot limit every controller sets (online, encoder
    // release, borrowed slots)
    int share(int slots, int of) const {
        return std::clamp((int) ((int64_t) n_slots * slots / std::max(1, of)), 1, n_slots);
    }
};

struct vis_moe_context {
    const llama_model * model = nullptr;
    llama_vis_moe_params params = {};
    llama_vis_moe_tier_params tier = {};

    std::vector<vis_moe_layer> layers;  // indexed by layer
    int n_managed     = 0;
    int n_expert_used = 0;  // experts each token runs: the model's k, or N under --moe-topk
    int topk          = 0;  // --moe-topk N (vis-moe-topk.h), 0 = off

    std::vector<ggml_context *>        ctxs;
    std::vector<ggml_backend_buffer_t> bufs;
    std::unique_ptr<vis_moe_op_uds>    op_uds = std::make_unique<vis_moe_op_uds>(this);  // never null
    // host bytes between a tier and a slab that the CPU cannot write: expert-sized blocks, pinned on a discrete GPU
    std::unique_ptr<vis_staging_pool> staging;
    vis_pin_budget pin;  // pinned host memory this context may hold (tier 2 + staging)
    std::vector<std::unique_ptr<vis_moe_uploader>> uploads;  // one per discrete device holding slabs

    // paging tiers (vis-moe-store.h)
    std::unique_ptr<vis_io_pool>    io;
    std::unique_ptr<vis_host_cache> host;
    // background reads into slots (vis-moe-fetch.h): substitution, precision refetches, prefetch, read-ahead
    std::unique_ptr<vis_moe_fetcher> fetch;
    bool    host_exclusive = false;  // unified memory: tier 2 never holds what a slab holds
    bool    unified        = false;
    bool    locked         = false;
    int64_t slab_bytes     = 0;
    int64_t majflt0        = 0, majflt_last = 0;
    bool    warned_faults  = false;
    int64_t n_host_hits = 0, n_file_reads = 0, n_model_copies = 0;  // slab hits: the layers' stats.n_hits
    // prefill streaming (docs/paging.md#prefill-streaming)
    int64_t n_streamed = 0, bytes_streamed = 0;
    int     stream_passes = 8;      // a ubatch that would need more passes than this in a layer streams it
    bool    ub_streamed   = false;  // the current ubatch streamed a layer
    bool    stream_ahead  = false;  // a streamed layer has the next managed layer read ahead (through `fetch`)
    int64_t n_stream_ahead = 0, bytes_stream_ahead = 0;  // layers (bytes) read ahead so
    int64_t n_stream_routed = 0, n_stream_seq = 0;  // layers streamed through the mapping: their routed experts read
                                                    // (they fit the page cache's room), or sequential read-ahead
    int     overlap       = 0;      // VIS_MOE_OVERLAP: most miss passes of a one-pass ubatch (0: off; vis-moe-overlap.h)
    bool    ub_decode     = false;  // every sequence of the current ubatch has one token
    bool    ub_image      = false;  // the current ubatch is image embeddings (the modality feature says so)
    // time to first token of the last prompt: the compute time of its ubatches (the prompt ubatches since the last
    // decode step), without the time between them
    int64_t ub_t0_us = 0, ttft_us = -1, n_prompt_ubatches = 0;
    bool    in_prompt = false;

    // the ubatch plan pass 0 of a managed layer is making (one layer at a time); apply() swaps it with the layer's
    vis_ubatch_plan planning;

    // the features (vis-moe-feature.h), in attach order: the lifetime hooks loop over them
    std::vector<std::unique_ptr<vis_moe_feature>> features;
    // typed handles to them, null when off, for the graph and its ops (owned by `features`)
    vis_moe_replay *     replay    = nullptr;  // VIS_MOE_REPLAY (vis-moe-replay.h): a benchmark knob
    vis_moe_trace *      trace     = nullptr;  // --moe-trace (vis-moe-trace.h)
    vis_moe_substitute * sub       = nullptr;  // --moe-substitute (vis-moe-substitute.h)
    vis_moe_prefetcher * prefetch  = nullptr;  // --moe-predict (vis-moe-prefetch.h): reads ahead through `fetch`
    vis_moe_shadow *     shadow    = nullptr;  // --moe-shadow: the sidecar (vis-moe-shadow.h)
    vis_moe_precision *  precision = nullptr;  // --moe-precision (vis-moe-precision.h): misses from the shadow slots
    vis_moe_modality *   modality  = nullptr;  // the running ubatch's image tokens (vis-moe-modality.h)
    vis_moe_capacity *   capacity  = nullptr;  // --moe-capacity (vis-moe-capacity.h)
    vis_moe_stager *     stage     = nullptr;  // staged streaming (vis-moe-stage.h)
    vis_moe_lender *     lend      = nullptr;  // slab lending (vis-moe-lend.h)
    vis_moe_telemetry *  telemetry = nullptr;  // --moe-csv, the status line, /metrics (vis-moe-telemetry.h)
    vis_moe_encoder_release * encoder_release = nullptr;  // VIS_MOE_ENCODER_RELEASE (vis-moe-encoder-release.h)
    vis_moe_borrow *     borrow    = nullptr;  // VIS_MOE_BORROW: borrowed slots (vis-moe-borrow.h)
    int64_t shadow_slab_bytes = 0;             // bytes of the layers' shadow slabs

    // memory plan (--moe-mem)
    int64_t     plan_budget   = 0;   // the budget planned for
    int64_t     plan_reserve  = -1;  // compute/runtime reserve it used
    int64_t     plan_encoder  = 0;   // the vision encoder's bytes it counted (llama_vis_moe_plan_encoder)
    int64_t     plan_free     = 0;   // budget bytes it left unplaced (page cache for streaming, slack)
    std::string plan_source;
    std::vector<std::string> notes;  // what a tight budget costs: logged at attach, repeated in the stats
    // bumped whenever a layer's slot limit changes (the online controller): a graph built before is not reused,
    // since its pass counts were planned at the old limits (patch 0016, llm_graph_params::allow_reuse)
    uint64_t graph_epoch = 0;

    std::mutex  err_mutex;
    bool        failed = false;
    std::string failure;
    int64_t     n_failures = 0;   // ubatches failed by the cache (read errors, trace write errors)
    std::string last_failure;     // message of the last ubatch's failure, "" if it succeeded

    ~vis_moe_context();

    // own a feature (null: off, nothing added) and return its typed handle
    template <typename T> T * add(std::unique_ptr<T> f) {
        T * p = f.get();
        if (p) {
            features.push_back(std::move(f));
        }
        return p;
    }
    // the one place a ubatch plan changes the cache (vis-moe-apply.cpp): layer il takes `plan` (it gets the layer's
    // last one back, for its buffers), pass 0's experts are loaded (the ids of its pairs written to out) and the
    // plan's background reads started, in order.  Throws when the plan has more passes than the graph, or on a read
    // failure (vis_io_error, the slot table left consistent).
    void apply(int il, vis_ubatch_plan & plan, const int32_t * routed, int32_t * out);
    // background reads into layer il's slots, in order (apply's second half; prefetch's reads ahead): each read's
    // `done` written (vis-moe-ubatch-plan.h)
    void apply_reads(int il, std::vector<vis_plan_read> & reads);
    // the one place a layer's slot limit changes (the online controller, the encoder release; vis-moe-apply.cpp): on a
    // shrink its background reads are collected first; the slots at and above n are emptied and their pages released
    // (vis-pages.h), and graph_epoch is bumped.  Between ubatches only.  Returns the bytes released.
    int64_t limit_slots(int il, int n);
    // drop the pages of layer il's slot s in every slab tensor held in host memory (the slot's contents are not
    // needed: it is above the limit, or emptied); returns the bytes released
    int64_t drop_slot_pages(int il, int s);
    // the index of layer L in `layers`
    int index_of(const vis_moe_layer & L) const { return (int) (&L - layers.data()); }
    // the full-precision passes of an image ubatch of L bounded by a feature (0: no bound)
    int image_pass_bound(const vis_moe_layer & L) const;

    // userdata of a custom op, stable for the context's lifetime
    vis_moe_op_ud * ud(int il, int pass, vis_op_kind kind) const { return op_uds->get(il, pass, kind); }
    // what a tight budget costs: a warning now, repeated in the --moe-stats footer
    void note(const std::string & msg);
    // a load failed inside a graph op: the ubatch is reported as failed (first message kept)
    void fail(const std::string & msg);
};

// the expert cache of a context, or nullptr
vis_moe_context * vis_moe_of(const llama_context * lctx);

// stats (vis-moe-stats.cpp): totals over all layers; the --moe-stats table on stderr
void vis_moe_total_stats(const vis_moe_context & vm, llama_vis_moe_stats & out);
void vis_moe_print_stats(const vis_moe_context & vm);
// what a tight budget or a lossy setting costs (vis_moe_context::note), one line each: the footer of the stats table,
// alone for a context without managed layers (--moe-topk without the cache)
void vis_moe_print_notes(const vis_moe_context & vm);
// bytes not read before a layer could run, at the file read rate this context measured (0 before any read)
int64_t vis_moe_stall_saved_us(const vis_moe_context & vm, int64_t bytes_saved);

// what telemetry reads out of the cache (vis-moe-telemetry-probe.cpp; vis-moe-telemetry.h): the counters now, the
// lossy mechanisms on (space-separated, "" = exact), the mode and memory plan /props shows (JSON), the bytes of a
// context's KV cache, the files the run reads that --moe-csv must never overwrite
vis_moe_counters vis_moe_counters_now(const vis_moe_context & vm);
std::string vis_moe_lossy_what(const vis_moe_context & vm);
std::string vis_moe_props_json(const vis_moe_context & vm, int64_t kv_bytes);
int64_t vis_moe_kv_bytes(const llama_context * lctx);
std::vector<vis_input_file> vis_moe_run_inputs(const vis_moe_context & vm, const vis_moe_settings & s);
