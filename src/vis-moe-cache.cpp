// vis-moe-cache.cpp - expert residency: per-layer slot pools ("slabs"), the
// expert->slot remap that runs before mul_mat_id, LRU eviction, stats and the
// routing trace.  Design and flags: docs/residency.md.
//
// Exactness.  A managed layer's three mul_mat_id read a slab [ne0, ne1,
// n_slots + 1] holding byte-identical copies of resident experts, with ids
// remapped to slots.  Output column (i, t) of mul_mat_id depends only on the
// matrix bytes and the input column, and - on CPU - the kernel chosen per
// expert depends on the rows routed to it, never on n_as.  When a ubatch
// routes more distinct experts than there are slots, its experts are split
// into passes of at most n_slots experts; every pass runs the *whole* ubatch,
// pairs whose expert belongs to another pass point at a dedicated staging slot
// (the "+ 1", never holding a real expert, so no real expert gains rows), and
// a final get_rows copies each pair from the pass that owned its expert.  Each
// real expert therefore sees exactly the rows it sees upstream.
#include "vis-moe.h"
#include "vis-moe-store.h"
#include "vis-vlm.h"  // vis_set_last_error

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"
#include "llama-batch.h"

#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <mutex>
#include <stdexcept>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

// ---------------------------------------------------------------------------
// errors and process-wide parameters
// ---------------------------------------------------------------------------
static thread_local std::string g_last_error;

const char * llama_vis_last_error(void) {
    return g_last_error.c_str();
}

void vis_moe_set_last_error(const std::string & msg) {
    g_last_error = msg;
}

void vis_set_last_error(const std::string & msg) {  // for the other vis-*.cpp (vis-vlm.h)
    g_last_error = msg;
}

static std::mutex           g_params_mutex;
static bool                 g_params_set = false;
static llama_vis_moe_params g_params;
static std::string          g_trace_path;

static long long env_ll(const char * name, long long def) {
    const char * v = std::getenv(name);
    if (v == nullptr || *v == '\0') {
        return def;
    }
    char * end = nullptr;
    const long long r = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0') {
        LLAMA_LOG_WARN("vis-moe: ignoring %s=%s (not an integer)\n", name, v);
        return def;
    }
    return r;
}

llama_vis_moe_params llama_vis_moe_default_params(void) {
    llama_vis_moe_params p = {};
    p.n_slots     = (int32_t) env_ll("VIS_MOE_SLOTS", 0);
    p.cache_mib   = (int64_t) env_ll("VIS_MOE_CACHE_MIB", 0);
    p.n_pinned    = (int32_t) env_ll("VIS_MOE_PINNED", 0);
    p.print_stats = (int32_t) env_ll("VIS_MOE_STATS", 0);
    const char * tr = std::getenv("VIS_MOE_TRACE");
    p.trace_path  = (tr && *tr) ? tr : nullptr;
    return p;
}

static bool validate_params(const llama_vis_moe_params & p, std::string & err) {
    if (p.n_slots < 0) {
        err = "--moe-slots must be >= 0 (0 = off), got " + std::to_string(p.n_slots);
        return false;
    }
    if (p.cache_mib < 0) {
        err = "--moe-cache-mib must be >= 0 (0 = off), got " + std::to_string(p.cache_mib);
        return false;
    }
    if (p.n_slots > 0 && p.cache_mib > 0) {
        err = "--moe-slots and --moe-cache-mib are alternatives: give one of them";
        return false;
    }
    if (p.n_pinned < -1) {
        err = "--moe-pinned-layers must be >= 0, or -1 for all, got " + std::to_string(p.n_pinned);
        return false;
    }
    return true;
}

int32_t llama_vis_moe_set_params(const llama_vis_moe_params * params) {
    llama_vis_moe_params p = params ? *params : llama_vis_moe_default_params();
    std::string err;
    if (!validate_params(p, err)) {
        g_last_error = err;
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_params_mutex);
    g_trace_path = p.trace_path ? p.trace_path : "";
    p.trace_path = g_trace_path.empty() ? nullptr : g_trace_path.c_str();
    g_params     = p;
    g_params_set = true;
    return 0;
}

// ---- paging tiers (docs/paging.md) ----
static bool                      g_tier_set = false;
static llama_vis_moe_tier_params g_tier;

static int32_t env_switch(const char * name, int32_t def) {
    const char * v = std::getenv(name);
    if (v == nullptr || *v == '\0') {
        return def;
    }
    const std::string s = v;
    if (s == "auto") return -1;
    if (s == "on" || s == "1" || s == "true") return 1;
    if (s == "off" || s == "0" || s == "false") return 0;
    LLAMA_LOG_WARN("vis-moe: ignoring %s=%s (expected auto, on or off)\n", name, v);
    return def;
}

llama_vis_moe_tier_params llama_vis_moe_tier_default_params(void) {
    llama_vis_moe_tier_params t = {};
    const char * st = std::getenv("VIS_MOE_STORE");
    t.store      = (st && std::string(st) == "model") ? 1 : 0;
    t.host_mib   = (int64_t) env_ll("VIS_MOE_HOST_MIB", -1);
    const char * mem = std::getenv("VIS_MOE_MEM");
    t.mem_mib    = (mem && std::string(mem) == "auto") ? -1 : (int64_t) env_ll("VIS_MOE_MEM", 0);
    t.io_threads = (int32_t) env_ll("VIS_MOE_IO_THREADS", 4);
    t.direct_io  = env_switch("VIS_MOE_DIRECT_IO", -1);
    t.unified    = env_switch("VIS_MOE_UNIFIED", -1);
    t.mlock      = env_switch("VIS_MOE_MLOCK", 1) != 0 ? 1 : 0;
    return t;
}

static bool validate_tier(const llama_vis_moe_tier_params & t, std::string & err) {
    if (t.store != 0 && t.store != 1) {
        err = "--moe-store must be file or model";
        return false;
    }
    if (t.host_mib < -1) {
        err = "--moe-host-mib must be >= 0 (0 = no host cache), got " + std::to_string(t.host_mib);
        return false;
    }
    if (t.mem_mib < -1) {
        err = "--moe-mem must be auto or a number of MiB > 0, got " + std::to_string(t.mem_mib);
        return false;
    }
    if (t.io_threads < 1 || t.io_threads > 64) {
        err = "--moe-io-threads must be in 1..64, got " + std::to_string(t.io_threads);
        return false;
    }
    for (int32_t v : { t.direct_io, t.unified }) {
        if (v < -1 || v > 1) {
            err = "--moe-direct-io / --moe-unified take auto, on or off";
            return false;
        }
    }
    return true;
}

llama_vis_moe_tier_params llama_vis_moe_get_tier_params(void) {
    std::lock_guard<std::mutex> lock(g_params_mutex);
    return g_tier_set ? g_tier : llama_vis_moe_tier_default_params();
}

int32_t llama_vis_moe_set_tier_params(const llama_vis_moe_tier_params * params) {
    const llama_vis_moe_tier_params t = params ? *params : llama_vis_moe_tier_default_params();
    std::string err;
    if (!validate_tier(t, err)) {
        g_last_error = err;
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_params_mutex);
    g_tier     = t;
    g_tier_set = true;
    return 0;
}

static llama_vis_moe_params current_params(std::string & trace_path) {
    std::lock_guard<std::mutex> lock(g_params_mutex);
    llama_vis_moe_params p = g_params_set ? g_params : llama_vis_moe_default_params();
    trace_path = p.trace_path ? p.trace_path : "";
    return p;
}

// Called by the model loader (patch 0004) for routed-expert tensors: defer them to the file tier?
bool vis_moe_store_deferral(int & n_pinned, int64_t n_expert) {
    std::string trace;
    const llama_vis_moe_params      p = current_params(trace);
    const llama_vis_moe_tier_params t = llama_vis_moe_get_tier_params();
    const bool cache_on = p.n_slots > 0 || p.cache_mib > 0 || t.mem_mib != 0;
    if (!cache_on || t.store != 0 || p.n_pinned < 0) {
        return false;
    }
    if (p.n_slots > 0 && p.n_slots >= n_expert) {
        return false;  // everything fits: upstream loads it
    }
    n_pinned = p.n_pinned;
    return true;
}

// CLI flags (registered in common/arg.cpp by patch 0003)
static bool vis_moe_tier_cli_apply(const std::string & flag, const std::string & value) {
    llama_vis_moe_tier_params t = llama_vis_moe_get_tier_params();
    auto as_int = [&](long long lo, long long hi) {
        char * end = nullptr;
        const long long v = std::strtoll(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || v < lo || v > hi) {
            throw std::invalid_argument(flag + ": expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                                        ", got '" + value + "'");
        }
        return v;
    };
    auto as_switch = [&](bool allow_auto) -> int32_t {
        if (allow_auto && value == "auto") return -1;
        if (value == "on" || value == "1") return 1;
        if (value == "off" || value == "0") return 0;
        throw std::invalid_argument(flag + ": expected " + (allow_auto ? "auto, " : "") + "on or off, got '" + value + "'");
    };
    if (flag == "--moe-store") {
        if (value != "file" && value != "model") {
            throw std::invalid_argument("--moe-store: expected file or model, got '" + value + "'");
        }
        t.store = value == "model" ? 1 : 0;
    } else if (flag == "--moe-host-mib") {
        t.host_mib = as_int(0, 1ll << 40);
    } else if (flag == "--moe-mem") {
        t.mem_mib = value == "auto" ? -1 : as_int(1, 1ll << 40);
    } else if (flag == "--moe-io-threads") {
        t.io_threads = (int32_t) as_int(1, 64);
    } else if (flag == "--moe-direct-io") {
        t.direct_io = as_switch(true);
    } else if (flag == "--moe-unified") {
        t.unified = as_switch(true);
    } else if (flag == "--moe-mlock") {
        t.mlock = as_switch(false);
    } else {
        return false;
    }
    if (llama_vis_moe_set_tier_params(&t) != 0) {
        throw std::invalid_argument(g_last_error);
    }
    return true;
}

static void vis_moe_cli_apply(const std::string & flag, const std::string & value) {
    std::string trace;
    llama_vis_moe_params p = current_params(trace);
    auto as_int = [&](long long lo) {
        char * end = nullptr;
        const long long v = std::strtoll(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || v < lo) {
            throw std::invalid_argument(flag + ": expected an integer >= " + std::to_string(lo) + ", got '" + value + "'");
        }
        return v;
    };
    if (flag == "--moe-slots") {
        p.n_slots = (int32_t) as_int(0);
    } else if (flag == "--moe-cache-mib") {
        p.cache_mib = as_int(0);
    } else if (flag == "--moe-pinned-layers") {
        p.n_pinned = (int32_t) as_int(-1);
    } else if (flag == "--moe-stats") {
        p.print_stats = 1;
    } else if (flag == "--moe-trace") {
        trace = value;
    } else if (flag.rfind("--moe-", 0) == 0 && vis_moe_tier_cli_apply(flag, value)) {
        // a paging-tier flag
    } else {
        throw std::invalid_argument("unknown vis-moe flag " + flag);
    }
    p.trace_path = trace.empty() ? nullptr : trace.c_str();
    if (llama_vis_moe_set_params(&p) != 0) {
        throw std::invalid_argument(g_last_error);
    }
}

int32_t llama_vis_moe_cli_apply(const char * flag, const char * value) {
    try {
        vis_moe_cli_apply(flag ? flag : "", value ? value : "");
    } catch (const std::exception & e) {
        g_last_error = e.what();
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------
// the cache
// ---------------------------------------------------------------------------
enum { VIS_T_GATE = 0, VIS_T_UP, VIS_T_DOWN, VIS_T_GATE_UP, VIS_T_COUNT };
static const char * const VIS_T_NAME[VIS_T_COUNT] = { "gate", "up", "down", "gate_up" };

enum vis_op_kind { VIS_OP_PASS, VIS_OP_SELECT, VIS_OP_TRACE, VIS_OP_MERGE, VIS_OP_STREAM, VIS_OP_DROP };

struct vis_moe_op_ud {
    vis_moe_context * vm;
    int il;
    int pass;
    vis_op_kind kind;
};

struct vis_moe_layer {
    bool managed  = false;
    int  n_slots  = 0;      // cache slots; slot index n_slots is the staging slot
    int  n_expert = 0;
    int64_t expert_bytes = 0;

    std::array<ggml_tensor *, VIS_T_COUNT> orig = {};
    std::array<ggml_tensor *, VIS_T_COUNT> slab = {};
    std::array<const vis_deferred_tensor *, VIS_T_COUNT> file = {};  // tier 3 (deferred at load), else null
    std::array<size_t, VIS_T_COUNT> part_off = {};  // offset of each tensor's slice in a packed expert
    bool deferred     = false;  // experts come from the file
    bool direct_write = false;  // slabs are CPU-writable: read straight into them
    bool cpu_passes   = false;  // CPU-only layer: pairs of other passes are skipped (id -1, patch 0006)
                                // and passes merge in place, instead of staging slot + concat

    std::vector<int32_t>  slot_of;    // expert -> slot, -1 if not resident
    std::vector<int32_t>  expert_of;  // slot -> expert, -1 if empty
    std::vector<uint64_t> last_use;   // slot -> tick of last use

    // plan of the ubatch being computed
    std::vector<int32_t> pass_of;     // expert -> pass, -1 if not routed
    int n_plan_passes = 0;
    std::vector<std::vector<int32_t>> passes;

    llama_vis_moe_stats stats = {};
};

struct vis_moe_context {
    const llama_context * lctx  = nullptr;
    const llama_model   * model = nullptr;
    llama_vis_moe_params  params = {};
    std::string           trace_path;
    FILE *                trace = nullptr;
    int32_t               ubatch_index = -1;

    std::vector<vis_moe_layer> layers;  // indexed by layer
    int n_managed = 0;
    int n_expert_used = 0;

    std::vector<ggml_context *>          ctxs;
    std::vector<ggml_backend_buffer_t>   bufs;
    std::map<std::tuple<int, int, int>, std::unique_ptr<vis_moe_op_ud>> uds;
    std::vector<uint8_t>                 staging;
    uint64_t tick = 0;

    // paging tiers (vis-moe-store.h)
    llama_vis_moe_tier_params       tier = {};
    std::unique_ptr<vis_io_pool>    io;
    std::unique_ptr<vis_host_cache> host;
    bool    host_exclusive = false;  // unified memory: tier 2 never holds what a slab holds
    bool    unified        = false;
    bool    locked         = false;
    int64_t slab_bytes     = 0;
    int64_t majflt0        = 0, majflt_last = 0;
    bool    warned_faults  = false;
    int64_t n_slab_hits = 0, n_host_hits = 0, n_file_reads = 0, n_model_copies = 0;
    int64_t n_streamed = 0, bytes_streamed = 0;
    int     stream_passes = 8;  // a ubatch that would need more passes than this in a layer streams it
    bool    ub_streamed   = false;  // the current ubatch streamed a layer
    int64_t     plan_budget = 0;  // --moe-mem: the budget planned for
    std::string plan_source;
    std::vector<std::string> notes;  // what a tight budget costs: logged at attach, repeated in the stats

    // current ubatch (trace)
    std::vector<int32_t> ub_pos;
    std::vector<int32_t> ub_seq;
    std::vector<int32_t> ub_out;   // rows of the output tokens (the last layer only computes those)
    uint8_t              ub_image = 0;

    std::mutex err_mutex;
    bool        failed = false;
    std::string failure;

    vis_moe_op_ud * ud(int il, int pass, vis_op_kind kind) {
        auto & p = uds[{il, pass, (int) kind}];
        if (!p) {
            p.reset(new vis_moe_op_ud{this, il, pass, kind});
        }
        return p.get();
    }

    // what a tight budget costs: a warning now, repeated in the --moe-stats footer
    void note(const std::string & msg) {
        notes.push_back(msg);
        LLAMA_LOG_WARN("vis-moe: %s\n", msg.c_str());
    }

    void fail(const std::string & msg) {
        std::lock_guard<std::mutex> lock(err_mutex);
        if (!failed) {
            failed  = true;
            failure = msg;
        }
    }

    ~vis_moe_context() {
        if (trace) {
            fclose(trace);
        }
        for (auto * b : bufs) {
            ggml_backend_buffer_free(b);
        }
        for (auto * c : ctxs) {
            ggml_free(c);
        }
    }
};

static std::mutex g_registry_mutex;
static std::map<const llama_context *, std::unique_ptr<vis_moe_context>> g_registry;

vis_moe_context * vis_moe_context_get(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = g_registry.find(lctx);
    return it == g_registry.end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------------------
// trace: docs/residency.md#routing-trace
// ---------------------------------------------------------------------------
static const char     VIS_TRACE_MAGIC[8]  = { 'V', 'I', 'S', 'T', 'R', 'A', 'C', 'E' };
static const uint32_t VIS_TRACE_VERSION   = 1;
static const uint32_t VIS_TRACE_REC_TAG   = 0x31434552; // "REC1"

static void trace_open(vis_moe_context & vm) {
    vm.trace = std::fopen(vm.trace_path.c_str(), "wb");
    if (!vm.trace) {
        throw std::runtime_error("--moe-trace: cannot open '" + vm.trace_path + "' for writing: " + std::strerror(errno));
    }
    const auto & hp = vm.model->hparams;
    const uint32_t hdr[4] = { VIS_TRACE_VERSION, hp.n_layer(), hp.n_expert, (uint32_t) vm.n_expert_used };
    std::fwrite(VIS_TRACE_MAGIC, 1, sizeof(VIS_TRACE_MAGIC), vm.trace);
    std::fwrite(hdr, sizeof(uint32_t), 4, vm.trace);
}

static void trace_record(vis_moe_context & vm, int il, const ggml_tensor * ids, const ggml_tensor * weights) {
    const int32_t k        = (int32_t) ids->ne[0];
    const int32_t n_tokens = (int32_t) ids->ne[1];
    const int32_t rec[5]   = { (int32_t) VIS_TRACE_REC_TAG, vm.ubatch_index, il, n_tokens, k };
    std::fwrite(rec, sizeof(int32_t), 5, vm.trace);
    std::vector<int32_t> seq(n_tokens, -1), pos(n_tokens, -1);
    std::vector<uint8_t> mod(n_tokens, vm.ub_image);
    // a layer sees every token of the ubatch, or (the last layer) only the output tokens
    const bool all_rows = n_tokens == (int) vm.ub_pos.size();
    for (int t = 0; t < n_tokens; ++t) {
        const int row = all_rows ? t : (t < (int) vm.ub_out.size() ? vm.ub_out[t] : -1);
        if (row >= 0 && row < (int) vm.ub_pos.size()) {
            pos[t] = vm.ub_pos[row];
            seq[t] = vm.ub_seq[row];
        }
    }
    std::fwrite(seq.data(), sizeof(int32_t), n_tokens, vm.trace);
    std::fwrite(pos.data(), sizeof(int32_t), n_tokens, vm.trace);
    std::fwrite(mod.data(), 1, n_tokens, vm.trace);
    std::fwrite(ids->data, sizeof(int32_t), (size_t) k * n_tokens, vm.trace);  // contiguous
    std::vector<float> w((size_t) k * n_tokens, 0.0f);
    if (weights && weights->type == GGML_TYPE_F32 && ggml_nelements(weights) == (int64_t) w.size()) {
        if (ggml_is_contiguous(weights)) {
            std::memcpy(w.data(), weights->data, w.size() * sizeof(float));
        } else {  // [1, k, n_tokens] with strides
            for (int t = 0; t < n_tokens; ++t) {
                for (int i = 0; i < k; ++i) {
                    w[(size_t) t * k + i] = *(const float *) ((const char *) weights->data + i * weights->nb[1] + t * weights->nb[2]);
                }
            }
        }
    }
    std::fwrite(w.data(), sizeof(float), w.size(), vm.trace);
}

// ---------------------------------------------------------------------------
// residency
// ---------------------------------------------------------------------------
// copy expert slice ti of a packed expert buffer into slot s (or back)
static void slab_write(vis_moe_layer & L, int s, const uint8_t * packed) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        ggml_tensor * dst = L.slab[ti];
        if (!dst) {
            continue;
        }
        const size_t nb = dst->nb[2];
        if (ggml_backend_buffer_is_host(dst->buffer)) {
            std::memcpy((char *) dst->data + (size_t) s * nb, packed + L.part_off[ti], nb);
        } else {
            ggml_backend_tensor_set(dst, packed + L.part_off[ti], (size_t) s * nb, nb);
        }
    }
}

static void slab_read(const vis_moe_layer & L, int s, uint8_t * packed) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        const ggml_tensor * src = L.slab[ti];
        if (!src) {
            continue;
        }
        const size_t nb = src->nb[2];
        if (ggml_backend_buffer_is_host(src->buffer)) {
            std::memcpy(packed + L.part_off[ti], (const char *) src->data + (size_t) s * nb, nb);
        } else {
            ggml_backend_tensor_get(src, packed + L.part_off[ti], (size_t) s * nb, nb);
        }
    }
}

// store = model: copy expert e from llama.cpp's own copy of the weights
static void model_copy(vis_moe_context & vm, vis_moe_layer & L, int e, int s) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        ggml_tensor * src = L.orig[ti];
        ggml_tensor * dst = L.slab[ti];
        if (!src) {
            continue;
        }
        const size_t nb   = src->nb[2];
        const size_t soff = (size_t) e * nb;
        const size_t doff = (size_t) s * nb;
        const bool src_host = ggml_backend_buffer_is_host(src->buffer);
        const bool dst_host = ggml_backend_buffer_is_host(dst->buffer);
        if (src_host && dst_host) {
            std::memcpy((char *) dst->data + doff, (const char *) src->data + soff, nb);
        } else if (src_host) {
            ggml_backend_tensor_set(dst, (const char *) src->data + soff, doff, nb);
        } else {
            vm.staging.resize(nb);
            ggml_backend_tensor_get(src, vm.staging.data(), soff, nb);
            if (dst_host) {
                std::memcpy((char *) dst->data + doff, vm.staging.data(), nb);
            } else {
                ggml_backend_tensor_set(dst, vm.staging.data(), doff, nb);
            }
        }
    }
}

// Fill the slots of this pass's misses: tier 2 first, then the file (in parallel), or the model's copy.
static void fill_misses(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<std::pair<int, int>> & misses) {
    std::vector<vis_read_req> reqs;
    std::vector<std::pair<int, size_t>> staged;  // (slot, offset in vm.staging) to copy after the reads
    std::vector<int> staged_expert;
    if (L.deferred && !L.direct_write) {
        vm.staging.resize(std::max<size_t>(vm.staging.size(), misses.size() * (size_t) L.expert_bytes));
    }
    size_t stage_off = 0;
    for (const auto & [e, s] : misses) {
        if (vm.host) {
            if (const uint8_t * h = vm.host->find(il, e)) {
                slab_write(L, s, h);
                if (vm.host_exclusive) {
                    vm.host->erase(il, e);
                }
                vm.n_host_hits++;
                continue;
            }
        }
        if (!L.deferred) {
            model_copy(vm, L, e, s);
            vm.n_model_copies++;
            continue;
        }
        vm.n_file_reads++;
        if (L.direct_write) {
            for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
                if (L.file[ti]) {
                    reqs.push_back({ L.file[ti], il, e, (char *) L.slab[ti]->data + (size_t) s * L.slab[ti]->nb[2] });
                }
            }
        } else {
            uint8_t * buf = vm.staging.data() + stage_off;
            for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
                if (L.file[ti]) {
                    reqs.push_back({ L.file[ti], il, e, buf + L.part_off[ti] });
                }
            }
            staged.emplace_back(s, stage_off);
            staged_expert.push_back(e);
            stage_off += (size_t) L.expert_bytes;
        }
    }
    if (reqs.empty()) {
        return;
    }
    reqs.front().src->file->check_unchanged();
    vm.io->read(reqs);
    for (size_t i = 0; i < staged.size(); ++i) {
        const uint8_t * buf = vm.staging.data() + staged[i].second;
        slab_write(L, staged[i].first, buf);
        if (vm.host && !vm.host_exclusive) {
            // discrete GPU: tier 2 keeps a pinned-host copy of what went to the device
            if (uint8_t * h = vm.host->insert(il, staged_expert[i])) {
                std::memcpy(h, buf, (size_t) L.expert_bytes);
            }
        }
    }
}

// make the experts of pass p resident and write the slot ids for that pass
static void run_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs, int32_t * out) {
    const auto t0 = std::chrono::steady_clock::now();
    // every touch gets its own tick, in the pass's order (hits first, then misses): LRU with exact recency, the
    // order pyvis.cachesim.lru_misses simulates; ticks from pass_start on mark slots this pass needs
    const uint64_t pass_start = vm.tick + 1;
    const std::vector<int32_t> empty;
    const std::vector<int32_t> & experts = p < (int) L.passes.size() ? L.passes[p] : empty;
    L.stats.n_passes++;

    // hits first: protect them from eviction by this pass
    for (int e : experts) {
        const int s = L.slot_of[e];
        if (s >= 0) {
            L.last_use[s] = ++vm.tick;
            L.stats.n_hits++;
            vm.n_slab_hits++;
        }
    }
    // misses: an empty slot, else the least recently used slot not needed by this pass
    std::vector<std::pair<int, int>> misses;
    for (int e : experts) {
        if (L.slot_of[e] >= 0) {
            continue;
        }
        int victim = -1;
        for (int s = 0; s < L.n_slots; ++s) {
            if (L.expert_of[s] < 0) {
                victim = s;
                break;
            }
            if (L.last_use[s] >= pass_start) {
                continue;  // used by this pass
            }
            if (victim < 0 || L.last_use[s] < L.last_use[victim]) {
                victim = s;
            }
        }
        GGML_ASSERT(victim >= 0 && "vis-moe: a pass needs more experts than slots (plan bug)");
        const int old = L.expert_of[victim];
        if (old >= 0) {
            L.slot_of[old] = -1;
            if (vm.host && vm.host_exclusive && L.deferred) {
                // unified memory: the evicted expert moves down to tier 2 instead of being dropped
                if (uint8_t * h = vm.host->insert(il, old)) {
                    slab_read(L, victim, h);
                }
            }
        }
        L.expert_of[victim] = e;
        L.slot_of[e]        = victim;
        L.last_use[victim]  = ++vm.tick;
        misses.emplace_back(e, victim);
        L.stats.n_misses++;
        L.stats.bytes_loaded += L.expert_bytes;
    }
    L.stats.n_routed += (int64_t) experts.size();

    try {
        fill_misses(vm, L, il, misses);
    } catch (...) {
        // never leave a slot marked as holding an expert it does not hold
        for (const auto & [e, s] : misses) {
            L.slot_of[e]  = -1;
            L.expert_of[s] = -1;
        }
        L.stats.load_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
        throw;
    }

    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = ids[j];
        // pairs of other passes: not computed on CPU (-1), else sent to the staging slot
        out[j] = L.pass_of[e] == p ? L.slot_of[e] : (L.cpu_passes ? -1 : L.n_slots);
    }
    L.stats.load_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

// split the experts routed by this ubatch into passes of at most n_slots (hits first)
static void plan_ubatch(vis_moe_layer & L, const int32_t * ids, int64_t n_pairs) {
    for (int e = 0; e < L.n_expert; ++e) {
        L.pass_of[e] = -1;
    }
    std::vector<int32_t> hits, misses;
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = ids[j];
        GGML_ASSERT(e >= 0 && e < L.n_expert);
        if (L.pass_of[e] == -1) {
            L.pass_of[e] = -2;  // seen
            (L.slot_of[e] >= 0 ? hits : misses).push_back(e);
        }
    }
    L.passes.clear();
    std::vector<int32_t> order = hits;
    order.insert(order.end(), misses.begin(), misses.end());
    for (size_t i = 0; i < order.size(); i += L.n_slots) {
        const size_t end = std::min(order.size(), i + (size_t) L.n_slots);
        L.passes.emplace_back(order.begin() + i, order.begin() + end);
        for (size_t x = i; x < end; ++x) {
            L.pass_of[order[x]] = (int32_t) L.passes.size() - 1;
        }
    }
    L.stats.n_calls++;
}

// in place: copy the rows of the pairs pass p owns from b (that pass's expert outputs) into a
static void vis_merge_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, const ggml_tensor * c, int ith,
                         int nth, void * userdata) {
    auto * ud = (vis_moe_op_ud *) userdata;
    const vis_moe_layer & L = ud->vm->layers[ud->il];
    const int64_t n_pairs = ggml_nelements(c);
    const auto * ids = (const int32_t *) c->data;
    const size_t row = b->nb[1];
    GGML_ASSERT(dst->data == a->data && ggml_is_contiguous(a) && ggml_is_contiguous(b) && a->nb[1] == row);
    for (int64_t j = ith; j < n_pairs; j += nth) {
        if (L.pass_of[ids[j]] == ud->pass) {
            std::memcpy((char *) dst->data + j * row, (const char *) b->data + j * row, row);
        }
    }
}

// Prefill streaming: the mapped expert tensors of layer L.  Before the layer: sequential read-ahead (the loader
// marks lazy ranges MADV_RANDOM, i.e. 4 KiB faults).  After it: drop the pages from our mapping and from the page
// cache, so the streamed experts cost no memory, and go back to MADV_RANDOM.
static void stream_advise(const vis_moe_layer & L, bool before) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        const vis_deferred_tensor * f = L.file[ti];
        if (!f || !L.orig[ti] || !L.orig[ti]->data) {
            continue;
        }
        const size_t n = f->nb2 * (size_t) f->n_expert;
        // pages wholly inside the tensor: a neighbouring tensor's pages are not ours to drop
        const uintptr_t a0 = ((uintptr_t) L.orig[ti]->data + page - 1) & ~(uintptr_t) (page - 1);
        const uintptr_t a1 = ((uintptr_t) L.orig[ti]->data + n) & ~(uintptr_t) (page - 1);
        if (a1 <= a0) {
            continue;
        }
        if (before) {
            madvise((void *) a0, a1 - a0, MADV_SEQUENTIAL);
        } else {
            madvise((void *) a0, a1 - a0, MADV_DONTNEED);
            madvise((void *) a0, a1 - a0, MADV_RANDOM);
            posix_fadvise(f->file->fd, (off_t) f->offs, (off_t) n, POSIX_FADV_DONTNEED);
        }
    }
}

static void vis_drop_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    (void) a;
    (void) dst;
    (void) nth;
    if (ith == 0) {
        auto * ud = (vis_moe_op_ud *) userdata;
        stream_advise(ud->vm->layers[ud->il], false);
    }
}

static void vis_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * ud = (vis_moe_op_ud *) userdata;
    vis_moe_context & vm = *ud->vm;
    const int64_t n_pairs = ggml_nelements(a);
    const auto * ids = (const int32_t *) a->data;
    auto * out = (int32_t *) dst->data;
    try {
        switch (ud->kind) {
            case VIS_OP_TRACE:
                if (vm.trace) {
                    trace_record(vm, ud->il, a, b);
                }
                std::memcpy(out, ids, n_pairs * sizeof(int32_t));
                break;
            case VIS_OP_PASS: {
                vis_moe_layer & L = vm.layers[ud->il];
                if (ud->pass == 0) {
                    if (vm.trace) {
                        trace_record(vm, ud->il, a, b);
                    }
                    plan_ubatch(L, ids, n_pairs);
                }
                run_pass(vm, L, ud->il, ud->pass, ids, n_pairs, out);
            } break;
            case VIS_OP_STREAM: {
                // prefill streaming: upstream's graph reads the layer's experts through the mapping
                if (vm.trace) {
                    trace_record(vm, ud->il, a, b);
                }
                const vis_moe_layer & L = vm.layers[ud->il];
                std::vector<bool> seen(L.n_expert, false);
                for (int64_t j = 0; j < n_pairs; ++j) {
                    if (ids[j] >= 0 && ids[j] < L.n_expert && !seen[ids[j]]) {
                        seen[ids[j]] = true;
                        vm.n_streamed++;
                        vm.bytes_streamed += L.expert_bytes;
                    }
                }
                for (const auto * f : L.file) {
                    if (f) {
                        f->file->check_unchanged();  // never compute on a file replaced under us
                        break;
                    }
                }
                stream_advise(L, true);
                vm.ub_streamed = true;
                std::memcpy(out, ids, n_pairs * sizeof(int32_t));
            } break;
            case VIS_OP_SELECT: {
                const vis_moe_layer & L = vm.layers[ud->il];
                for (int64_t j = 0; j < n_pairs; ++j) {
                    out[j] = (int32_t) (L.pass_of[ids[j]] * n_pairs + j);
                }
            } break;
            case VIS_OP_MERGE:
            case VIS_OP_DROP:
                break;  // their own callbacks (vis_merge_op, vis_drop_op)
        }
    } catch (const std::exception & e) {
        vm.fail(e.what());
        // keep the graph running on finite data; the ubatch is reported as failed
        for (int64_t j = 0; j < n_pairs; ++j) {
            const vis_moe_layer & L = vm.layers[ud->il];
            out[j] = ud->kind == VIS_OP_SELECT ? (int32_t) j
                   : ud->kind == VIS_OP_PASS   ? (L.cpu_passes ? -1 : L.n_slots)
                                               : ids[j];
        }
    }
}

// ---------------------------------------------------------------------------
// attach / detach
// ---------------------------------------------------------------------------
static int64_t layer_expert_bytes(const llama_layer & l) {
    int64_t b = 0;
    for (const ggml_tensor * t : { l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps, l.ffn_gate_up_exps }) {
        b += t ? (int64_t) t->nb[2] : 0;
    }
    return b;
}

static bool layer_is_moe(const llama_layer & l) {
    return l.ffn_gate_exps || l.ffn_up_exps || l.ffn_down_exps || l.ffn_gate_up_exps;
}

static void attach_impl(const llama_context * lctx, const llama_model & model);

// The token embeddings of a model with its own output matrix: a token reads one row of them, so they are
// neither counted as resident weights nor locked (a few touched pages stay in the page cache).
static bool row_gathered(const llama_model & model, const ggml_tensor * t) {
    return t == model.tok_embd && model.output != nullptr &&
           std::strcmp(ggml_get_name(model.output), ggml_get_name(model.tok_embd)) != 0;  // tied: same name
}

void vis_moe_context_attach(const llama_context * lctx, const llama_model & model) {
    try {
        attach_impl(lctx, model);
    } catch (const std::exception & e) {
        g_last_error = e.what();
        LLAMA_LOG_ERROR("%s\n", e.what());
        throw;
    }
}

// is the memory behind buffer `buf` (on device `dev`) writable by the CPU?
static bool cpu_writable(ggml_backend_buffer_t buf, ggml_backend_dev_t dev) {
    if (ggml_backend_buffer_is_host(buf)) {
        return true;
    }
    // Jetson: an integrated GPU whose buffers are CUDA managed memory (GGML_CUDA_ENABLE_UNIFIED_MEMORY=1)
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    const char * um = std::getenv("GGML_CUDA_ENABLE_UNIFIED_MEMORY");
    return props.type == GGML_BACKEND_DEVICE_TYPE_IGPU && um && *um && std::strcmp(um, "0") != 0;
}

// bytes of the compute buffers and runtime, estimated before the graph is reserved
static int64_t estimate_reserve(const llama_context * lctx, const llama_model & model) {
    const auto & hp = model.hparams;
    const int64_t n_ub  = lctx ? (int64_t) lctx->n_ubatch() : 512;
    const int64_t n_voc = model.vocab.n_tokens();
    const int64_t n_ff  = (int64_t) hp.n_ff_exp();
    // f32 activations of one ubatch: logits, a few n_embd-wide rows, gate/up/down rows of the routed experts
    // (qwen3moe 16L at -ub 512: estimate 156 MiB, measured compute buffer 121 MiB)
    const int64_t act   = n_ub * 4 * (n_voc + 6 * (int64_t) hp.n_embd + 3 * (int64_t) hp.n_expert_used_max() * n_ff);
    return act + (64ll << 20);  // + runtime (binary, libraries, heap: ~45 MiB measured for llama-cli)
}

static void attach_impl(const llama_context * lctx, const llama_model & model) {
    std::string trace_path;
    const llama_vis_moe_params      p    = current_params(trace_path);
    const llama_vis_moe_tier_params tier = llama_vis_moe_get_tier_params();
    const auto & hp = model.hparams;
    const int n_layer = (int) hp.n_layer();

    // layers whose experts the loader deferred to the file (patch 0004) must be served by the cache
    std::vector<bool> deferred(n_layer, false);
    bool any_deferred = false;
    for (int il = 0; il < n_layer && il < (int) model.layers.size(); ++il) {
        const llama_layer & l = model.layers[il];
        for (const ggml_tensor * t : { l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps, l.ffn_gate_up_exps }) {
            if (t && vis_moe_deferred(t)) {
                deferred[il] = any_deferred = true;
            }
        }
    }
    const bool cache_on = p.n_slots > 0 || p.cache_mib > 0 || tier.mem_mib != 0 || any_deferred;
    if (!cache_on && trace_path.empty()) {
        return;  // feature off: no object, no graph change
    }
    if (hp.n_expert == 0) {
        LLAMA_LOG_WARN("vis-moe: the model has no routed experts; --moe-* options ignored\n");
        return;
    }

    auto vm = std::make_unique<vis_moe_context>();
    vm->lctx  = lctx;
    vm->model = &model;
    vm->params = p;
    vm->tier   = tier;
    vm->trace_path = trace_path;
    vm->stream_passes = (int) env_ll("VIS_MOE_STREAM_PASSES", 8);  // 0: never stream
    vm->n_expert_used = (int) hp.n_expert_used_max();
    vm->layers.resize(n_layer);

    std::vector<int> moe_layers;
    for (int il = 0; il < n_layer && il < (int) model.layers.size(); ++il) {
        if (layer_is_moe(model.layers[il])) {
            moe_layers.push_back(il);
        }
    }
    const int n_moe  = (int) moe_layers.size();
    const int k      = vm->n_expert_used;
    const int n_exp  = (int) hp.n_expert;
    const int pinned = p.n_pinned < 0 ? n_moe : p.n_pinned;
    if (pinned > n_moe) {
        throw std::runtime_error("--moe-pinned-layers " + std::to_string(p.n_pinned) + " exceeds the model's " +
                                 std::to_string(n_moe) + " MoE layers (valid: 0.." + std::to_string(n_moe) + ", -1 = all)");
    }
    std::vector<int> managed(moe_layers.begin() + pinned, moe_layers.end());
    for (int il : moe_layers) {
        if (deferred[il] && std::find(managed.begin(), managed.end(), il) == managed.end()) {
            throw std::runtime_error("vis-moe: layer " + std::to_string(il) + " was deferred to the file at load but is pinned "
                                     "now; create contexts with the --moe-pinned-layers the model was loaded with");
        }
    }

    // device of the slabs and whether the CPU can write them (tier 1 in unified memory)
    int64_t per_slot = 0;  // bytes of one slot in every managed layer
    int64_t exp_max  = 0;
    for (int il : managed) {
        per_slot += layer_expert_bytes(model.layers[il]);
        exp_max   = std::max(exp_max, layer_expert_bytes(model.layers[il]));
    }
    bool all_host_devices = true;
    for (int il : managed) {
        ggml_backend_dev_t dev = model.dev_layer(il);
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            ggml_backend_dev_props props;
            ggml_backend_dev_get_props(dev, &props);
            const char * um = std::getenv("GGML_CUDA_ENABLE_UNIFIED_MEMORY");
            const bool igpu_um = props.type == GGML_BACKEND_DEVICE_TYPE_IGPU && um && *um && std::strcmp(um, "0") != 0;
            all_host_devices = all_host_devices && igpu_um;
        }
    }
    if (tier.unified == 1 && !all_host_devices) {
        throw std::runtime_error("--moe-unified on: the slabs' device is not CPU-writable memory; it needs the CPU backend or "
                                 "an integrated GPU (Jetson) with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1 (use auto or off)");
    }
    vm->unified = tier.unified != 0 && all_host_devices;

    // CPU-only run: passes skip other passes' pairs (patch 0006), so no staging slot; with a GPU present the
    // scheduler may offload a host-weight mul_mat_id, and other passes' pairs go to one staging slot per layer
    const bool cpu_only = model.devices.empty();
    const int  staging  = cpu_only ? 0 : 1;
    int n_slots = p.n_slots;
    int64_t host_bytes = tier.host_mib > 0 ? (tier.host_mib << 20) : 0;
    bool planned = false;  // slots from --moe-cache-mib or --moe-mem rather than --moe-slots
    int64_t pageable = 0;  // resident weights left unlocked because the budget cannot hold them
    if (p.cache_mib > 0 && !managed.empty()) {
        const int64_t budget = p.cache_mib << 20;
        const int64_t slots_total = budget / per_slot;  // includes the staging slot
        n_slots = (int) std::min<int64_t>(slots_total - staging, n_exp);
        planned = true;
        if (n_slots < 1) {
            const double need = (double) per_slot * (1 + staging) / (1 << 20);
            throw std::runtime_error("--moe-cache-mib " + std::to_string(p.cache_mib) + " is too small: the " +
                                     std::to_string(managed.size()) + " managed layers need at least " +
                                     std::to_string((int64_t) std::ceil(need)) + " MiB (one slot" +
                                     (staging ? " + 1 staging slot" : "") + " each); raise it or pin fewer layers");
        }
    } else if (tier.mem_mib != 0 && !managed.empty() && model.hparams.no_alloc) {
        n_slots = p.n_slots > 0 ? p.n_slots : k;  // a memory-fit probe (--fit): nothing is loaded, nothing to plan
    } else if (tier.mem_mib != 0 && !managed.empty()) {
        // --moe-mem: split one budget over resident weights, KV cache, compute, slabs and the host cache
        int64_t model_bytes = 0, kv_bytes = 0, deferred_bytes = 0;
        // weights that stay resident: every tensor but the deferred experts (mapped buffers span
        // file ranges, so buffer sizes would overcount); the context's own memory_breakdown()
        // needs the scheduler, which does not exist yet
        for (const auto & [name, t] : model.tensors_by_name) {
            if (!row_gathered(model, t)) {
                model_bytes += (int64_t) ggml_nbytes(t);
            }
        }
        if (lctx && lctx->get_memory()) {
            for (const auto & [buft, size] : lctx->get_memory()->memory_breakdown()) {
                kv_bytes += (int64_t) size;
            }
        }
        for (int il : managed) {
            if (deferred[il]) {
                deferred_bytes += (int64_t) n_exp * layer_expert_bytes(model.layers[il]);
            }
        }
        llama_vis_moe_plan_request rq = {};
        rq.budget           = tier.mem_mib > 0 ? (tier.mem_mib << 20) : 0;
        rq.resident_bytes   = std::max<int64_t>(0, model_bytes - deferred_bytes);
        rq.kv_bytes         = kv_bytes;
        rq.reserve_bytes    = estimate_reserve(lctx, model);
        rq.expert_bytes     = per_slot / (int64_t) managed.size();
        rq.n_managed_layers = (int32_t) managed.size();
        rq.n_expert         = n_exp;
        rq.n_expert_used    = k;
        rq.unified          = all_host_devices ? 1 : 0;
        rq.host_mib         = tier.host_mib;
        rq.n_slots          = p.n_slots;
        rq.no_staging       = cpu_only ? 1 : 0;
        if (!all_host_devices) {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(model.dev_layer(managed.front()), &free, &total);
            rq.device_bytes = (int64_t) (free * 9 / 10);
        }
        struct llama_vis_moe_plan plan;
        llama_vis_moe_plan(&rq, &plan);
        if (!plan.ok) {
            throw std::runtime_error(std::string("--moe-mem ") + (tier.mem_mib < 0 ? "auto" : std::to_string(tier.mem_mib)) +
                                     ": " + g_last_error);
        }
        n_slots    = plan.n_slots;
        host_bytes = plan.host_bytes;
        pageable   = plan.pageable_bytes;
        planned    = p.n_slots <= 0;
        vm->plan_budget = plan.budget;
        if (tier.mem_mib < 0) {
            llama_vis_mem_info mi;
            llama_vis_mem_probe(&mi);
            vm->plan_source = mi.cgroup_limit > 0 && mi.cgroup_limit <= plan.budget
                ? "auto: cgroup v" + std::to_string(mi.cgroup_version) + " limit" : std::string("auto: MemAvailable");
        } else {
            vm->plan_source = "--moe-mem";
        }
        LLAMA_LOG_INFO("vis-moe: memory plan: budget %.0f MiB = resident %.0f + KV %.0f + compute/runtime %.0f + slabs %.0f "
                       "(%d slots x %zu layers) + host cache %.0f MiB\n", plan.budget / 1048576.0,
                       rq.resident_bytes / 1048576.0, rq.kv_bytes / 1048576.0, rq.reserve_bytes / 1048576.0,
                       plan.slab_bytes / 1048576.0, n_slots, managed.size(), plan.host_bytes / 1048576.0);
    } else if (n_slots <= 0) {
        n_slots = n_exp;  // deferred layers with the cache off: every expert gets a slot
    }
    if (n_slots < 1) {
        throw std::runtime_error("--moe-slots " + std::to_string(n_slots) + ": valid range 1.." + std::to_string(n_exp) +
                                 " (0 = off)");
    }
    if (n_slots < k && !managed.empty()) {
        // exact all the same: every step runs its experts in passes of n_slots
        char msg[320];
        std::snprintf(msg, sizeof(msg), "%d slot%s per layer%s, below the model's top-k (%d): each decode step runs %d "
                      "passes per managed layer and reads most routed experts again%s", n_slots, n_slots == 1 ? "" : "s",
                      planned ? " fit the budget" : "", k, (k + n_slots - 1) / n_slots,
                      planned ? "; a larger budget gives top-k slots" : "");
        vm->note(msg);
    }

    // slabs, grouped by buffer type of the layer's device
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (int il : managed) {
        const llama_layer & l = model.layers[il];
        if (n_slots >= n_exp && !deferred[il]) {
            continue;  // everything fits: bypass, upstream graph
        }
        if (l.ffn_gate_exps_s || l.ffn_up_exps_s || l.ffn_down_exps_s) {
            if (deferred[il]) {
                throw std::runtime_error("vis-moe: layer " + std::to_string(il) + " has per-expert scales, which the file "
                                         "tier does not page yet; run with --moe-store model");
            }
            LLAMA_LOG_WARN("vis-moe: layer %d has per-expert scales; left fully resident\n", il);
            continue;
        }
        vis_moe_layer & L = vm->layers[il];
        L.orig = { l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps, l.ffn_gate_up_exps };
        L.deferred = deferred[il];
        size_t off = 0;
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            ggml_tensor * t = L.orig[ti];
            if (!t) {
                continue;
            }
            if (!L.deferred && t->extra != nullptr) {
                throw std::runtime_error(std::string("vis-moe: ") + t->name + " is held in a repacked CPU buffer (" +
                                         ggml_backend_buffer_name(t->buffer) + "), which cannot serve single experts; "
                                         "run with --no-repack (-nr) to use the expert cache");
            }
            if (!ggml_is_contiguous(t)) {
                throw std::runtime_error(std::string("vis-moe: ") + t->name + " is not contiguous");
            }
            if (L.deferred) {
                L.file[ti] = vis_moe_deferred(t);
                if (!L.file[ti]) {
                    throw std::runtime_error(std::string("vis-moe: ") + t->name + " of a deferred layer has no file record");
                }
            }
            L.part_off[ti] = off;
            off += t->nb[2];
        }
        ggml_backend_dev_t dev = model.dev_layer(il);
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
        ggml_context *& c = ctx_of[buft];
        if (!c) {
            ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * (size_t) (4 * n_layer + 8),
                                    /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
            c = ggml_init(ip);
            vm->ctxs.push_back(c);
        }
        const int ns = std::min(n_slots, n_exp);
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            ggml_tensor * t = L.orig[ti];
            if (!t) {
                continue;
            }
            L.slab[ti] = ggml_new_tensor_3d(c, t->type, t->ne[0], t->ne[1], ns + staging);
            ggml_format_name(L.slab[ti], "vis_slab.blk.%d.%s", il, VIS_T_NAME[ti]);
        }
        L.managed      = true;
        L.n_slots      = ns;
        L.n_expert     = n_exp;
        L.expert_bytes = layer_expert_bytes(l);
        L.slot_of.assign(n_exp, -1);
        L.pass_of.assign(n_exp, -1);
        L.expert_of.assign(ns, -1);
        L.last_use.assign(ns, 0);
        L.stats.n_slots = ns;
        L.stats.managed = 1;
        vm->n_managed++;
    }
    size_t slab_bytes = 0;
    bool locked = true;
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            throw std::runtime_error(std::string("vis-moe: failed to allocate the expert slabs in ") + ggml_backend_buft_name(buft) +
                                     "; lower --moe-slots / --moe-cache-mib / --moe-mem");
        }
        ggml_backend_buffer_clear(buf, 0);  // the staging slot (if any) and the padding hold finite zeros
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        slab_bytes += ggml_backend_buffer_get_size(buf);
        if (tier.mlock && ggml_backend_buffer_is_host(buf)) {
            locked = vis_mlock_region(ggml_backend_buffer_get_base(buf), ggml_backend_buffer_get_size(buf), "the expert slabs") && locked;
        } else if (tier.mlock) {
            locked = false;
        }
        vm->bufs.push_back(buf);
    }
    vm->slab_bytes = (int64_t) slab_bytes;
    for (int il : managed) {
        vis_moe_layer & L = vm->layers[il];
        if (L.managed && L.deferred) {
            L.direct_write = vm->unified && cpu_writable(L.slab[0] ? L.slab[0]->buffer : L.slab[3]->buffer, model.dev_layer(il));
        }
        if (L.managed) {
            // CPU-only run: the CPU mul_mat_id skips id -1 (patch 0006), so passes compute only their own pairs;
            // with a GPU present the scheduler may offload a host-weight mul_mat_id, so keep the staging slot there
            L.cpu_passes = cpu_only;  // no staging slot (see above)
        }
    }
    if (vm->n_managed > 0 && any_deferred) {
        vm->io = std::make_unique<vis_io_pool>(tier.io_threads, tier.direct_io);
        if (tier.mlock && !model.hparams.no_alloc) {
            // The resident weights are mapped file pages: under memory pressure the kernel would drop them and
            // fault them back in every token (mmap thrash). Lock them, tensor by tensor (mapped ranges also
            // span deferred experts, which must stay out of memory), as far as the plan has room for them:
            // the `pageable` bytes it could not fit stay unlocked, so the kernel can reclaim them instead of
            // killing us.
            const size_t page = (size_t) sysconf(_SC_PAGESIZE);
            size_t n_locked = 0, n_skipped = 0;
            bool ok = true;
            for (const auto & [name, t] : model.tensors_by_name) {
                if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer) || !t->data || vis_moe_deferred(t) ||
                    row_gathered(model, t)) {
                    continue;
                }
                const uintptr_t a = (uintptr_t) t->data & ~(uintptr_t) (page - 1);
                const uintptr_t b = ((uintptr_t) t->data + ggml_nbytes(t) + page - 1) & ~(uintptr_t) (page - 1);
                if (n_skipped < (size_t) pageable) {
                    n_skipped += ggml_nbytes(t);  // left unlocked until the plan's pageable bytes are covered
                    continue;
                }
                ok = vis_mlock_region((void *) a, b - a, "the resident weights") && ok;
                n_locked += b - a;
            }
            if (ok && n_locked > 0) {
                LLAMA_LOG_INFO("vis-moe: locked %.2f MiB of resident weights in memory\n", n_locked / 1048576.0);
            }
            if (n_skipped > 0) {
                char msg[320];
                std::snprintf(msg, sizeof(msg), "the memory budget cannot hold all resident weights next to the minimal "
                              "slabs: %.2f MiB of them stay unlocked and are re-read from the file whenever the kernel "
                              "drops them (slow); a budget of %.0f MiB or more keeps them locked",
                              n_skipped / 1048576.0, (vm->plan_budget + pageable) / 1048576.0);
                vm->note(msg);
            }
        }
    }
    if (vm->n_managed > 0 && host_bytes > 0 && n_slots < n_exp) {
        vm->host = std::make_unique<vis_host_cache>((size_t) host_bytes, (size_t) exp_max, tier.mlock != 0);
        vm->host_exclusive = vm->unified;
        locked = locked && vm->host->locked();
    }
    vm->locked = tier.mlock && locked && vm->n_managed > 0;
    {
        rusage ru = {};
        getrusage(RUSAGE_SELF, &ru);
        vm->majflt0 = vm->majflt_last = ru.ru_majflt;
    }
    if (!trace_path.empty()) {
        trace_open(*vm);
    }
    if (vm->n_managed > 0) {
        LLAMA_LOG_INFO("vis-moe: expert cache: %d of %d MoE layers managed (%d pinned), %d slots of %d experts each, "
                       "slabs %.2f MiB\n", vm->n_managed, n_moe, pinned, std::min(n_slots, n_exp), n_exp, slab_bytes / 1048576.0);
        if (any_deferred) {
            LLAMA_LOG_INFO("vis-moe: tiers: slabs %.2f MiB (%s) | host cache %.2f MiB (%s) | file: %s, %d I/O threads%s\n",
                           slab_bytes / 1048576.0, vm->unified ? "filled straight from the file" : "filled through a staging buffer",
                           (vm->host ? vm->host->capacity_blocks() * vm->host->block_bytes() : 0) / 1048576.0,
                           vm->host ? (vm->host_exclusive ? "exclusive of the slabs" : "inclusive") : "off",
                           tier.direct_io == 0 ? "buffered reads, pages dropped" : "O_DIRECT where allowed",
                           tier.io_threads, vm->locked ? ", memory locked" : "");
        }
    } else if (cache_on) {
        LLAMA_LOG_INFO("vis-moe: expert cache: every MoE layer fits (%d slots >= %d experts, or pinned); upstream graph\n",
                       n_slots, n_exp);
    }
    if (vm->n_managed == 0 && trace_path.empty()) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_registry[lctx] = std::move(vm);
}

void vis_moe_context_detach(const llama_context * lctx) {
    vis_moe_context * cur = vis_moe_context_get(lctx);
    if (!cur) {
        return;
    }
    if (cur->params.print_stats && cur->n_managed > 0) {
        llama_vis_moe_stats tot;
        llama_vis_moe_get_stats(lctx, -1, &tot);
        if (tot.n_calls > 0) {  // not for contexts that never ran (e.g. --fit probes)
            llama_vis_moe_print_stats(lctx);
        }
    }
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_registry.erase(lctx);
}

void vis_moe_begin_ubatch(vis_moe_context * vm, const llama_ubatch & ub) {
    if (!vm) {
        return;
    }
    vm->ubatch_index++;
    if (!vm->trace) {
        return;
    }
    vm->ub_pos.assign(ub.n_tokens, -1);
    vm->ub_seq.assign(ub.n_tokens, -1);
    vm->ub_out.clear();
    for (uint32_t t = 0; t < ub.n_tokens; ++t) {
        if (ub.output && ub.output[t]) {
            vm->ub_out.push_back((int32_t) t);
        }
        vm->ub_pos[t] = ub.pos ? ub.pos[t] : -1;
        vm->ub_seq[t] = (ub.seq_id && ub.n_seq_id && ub.n_seq_id[t] > 0) ? ub.seq_id[t][0] : -1;
    }
    vm->ub_image = ub.embd != nullptr ? 1 : 0;
}

bool vis_moe_end_ubatch(vis_moe_context * vm) {
    if (!vm) {
        return true;
    }
    if (vm->trace) {
        std::fflush(vm->trace);
    }
    if (vm->n_managed > 0) {
        // the kernel paging our working set in and out means the budget is too large for the machine
        rusage ru = {};
        getrusage(RUSAGE_SELF, &ru);
        const int64_t d = ru.ru_majflt - vm->majflt_last;
        vm->majflt_last = ru.ru_majflt;
        if (vm->ub_streamed) {
            // streaming faults its experts in on purpose (not a sign of paging); the read-ahead also spills past
            // the streamed ranges: drop every unmapped page of the model files, so the page cache does not sit on
            // the budget during the next steps (mapped, locked resident weights stay)
            vm->ub_streamed = false;
            std::set<const vis_gguf_file *> files;
            for (const auto & L : vm->layers) {
                for (const auto * f : L.file) {
                    if (f && files.insert(f->file.get()).second) {
                        posix_fadvise(f->file->fd, 0, 0, POSIX_FADV_DONTNEED);
                    }
                }
            }
        } else if (d >= 256 && !vm->warned_faults) {
            vm->warned_faults = true;
            LLAMA_LOG_WARN("vis-moe: %" PRId64 " major page faults in one ubatch: the system is paging our working set "
                           "(swap or evicted mmap pages); lower --moe-mem / --moe-slots / --moe-host-mib or use --moe-mem auto\n", d);
        }
    }
    std::lock_guard<std::mutex> lock(vm->err_mutex);
    if (vm->failed) {
        g_last_error = vm->failure;
        LLAMA_LOG_ERROR("%s\n", vm->failure.c_str());
        vm->failed = false;
        return false;
    }
    return true;
}

uint32_t vis_moe_extra_nodes(const vis_moe_context * vm, uint32_t n_tokens) {
    if (!vm) {
        return 0;
    }
    uint32_t extra = 0;
    for (const auto & L : vm->layers) {
        if (!L.managed) {
            extra += vm->trace ? 4 : 0;
            continue;
        }
        const int64_t pairs = (int64_t) vm->n_expert_used * n_tokens;
        const int passes = std::max(1, (int) ((std::min<int64_t>(L.n_expert, pairs) + L.n_slots - 1) / L.n_slots));
        extra += 32u * passes + 16u;  // per pass: the slot op and a copy of upstream's expert nodes
    }
    return extra;
}

// ---------------------------------------------------------------------------
// graph
// ---------------------------------------------------------------------------
vis_moe_layer_graph::vis_moe_layer_graph(const vis_moe_context * vm_, ggml_context * ctx_, ggml_cgraph * gf_, int il_,
                                         ggml_tensor * selected_experts, ggml_tensor * weights_, int64_t n_tokens)
    : ctx(ctx_), gf(gf_), il(il_) {
    vm = const_cast<vis_moe_context *>(vm_);
    if (!vm || il < 0 || il >= (int) vm->layers.size()) {
        vm = nullptr;
        return;
    }
    const vis_moe_layer & L = vm->layers[il];
    if (!L.managed && !vm->trace) {
        vm = nullptr;  // bypass: upstream graph
        return;
    }
    weights  = weights_;
    ids_cont = ggml_cont(ctx, selected_experts);
    ggml_format_name(ids_cont, "vis_moe_ids-%d", il);
    if (!L.managed) {
        ggml_tensor * t = ggml_map_custom2(ctx, ids_cont, weights, vis_op, 1, vm->ud(il, 0, VIS_OP_TRACE));
        ggml_format_name(t, "vis_moe_trace-%d", il);
        ggml_build_forward_expand(gf, t);
        vm = nullptr;
        return;
    }
    managed = true;
    const int64_t pairs = selected_experts->ne[0] * n_tokens;  // 0 on a last layer without output rows
    n_pass = std::max(1, (int) ((std::min<int64_t>(L.n_expert, pairs) + L.n_slots - 1) / L.n_slots));
    if (L.deferred && L.cpu_passes && vm->stream_passes > 0 && n_pass > vm->stream_passes) {
        // Prefill streaming: a ubatch that routes (nearly) every expert would need many small passes (tight budgets:
        // one slot per layer -> 128 passes, each re-running the layer's element-wise ops over all pairs).  Run
        // upstream's graph on the mapped tensors instead: the experts are read once, in file order, through the page
        // cache, exactly as upstream's mmap does; the pages are dropped after the layer and the slabs are left as
        // they are.  Same result, bit for bit: it is upstream's graph.
        managed = false;
        stream  = true;
        n_pass  = 1;
        ggml_tensor * t = ggml_map_custom2(ctx, ids_cont, weights, vis_op, 1, vm->ud(il, 0, VIS_OP_STREAM));
        ggml_format_name(t, "vis_moe_stream-%d", il);
        ggml_build_forward_expand(gf, t);
    }
}

ggml_tensor * vis_moe_layer_graph::mm_ids(int p, ggml_tensor * selected_experts) {
    if (!managed) {
        return selected_experts;
    }
    ggml_tensor * dep = p == 0 ? weights : last;
    ggml_tensor * t = ggml_map_custom2(ctx, ids_cont, dep, vis_op, 1, vm->ud(il, p, VIS_OP_PASS));
    ggml_format_name(t, "vis_moe_slots-%d.%d", il, p);
    return t;
}

ggml_tensor * vis_moe_layer_graph::weight(ggml_tensor * w) const {
    if (!managed || w == nullptr) {
        return w;
    }
    const vis_moe_layer & L = vm->layers[il];
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (L.orig[ti] == w) {
            return L.slab[ti];
        }
    }
    return w;
}

void vis_moe_layer_graph::push_output(ggml_tensor * experts) {
    if (managed && vm->layers[il].cpu_passes && !outs.empty()) {
        // merge this pass into the accumulator in place: one pass's outputs alive at a time
        ggml_tensor * acc = ggml_map_custom3_inplace(ctx, outs[0], experts, ids_cont, vis_merge_op, GGML_N_TASKS_MAX,
                                                     vm->ud(il, (int) n_merged + 1, VIS_OP_MERGE));
        ggml_format_name(acc, "vis_moe_merge-%d.%d", il, (int) n_merged + 1);
        n_merged++;
        outs[0] = acc;
        last    = acc;
        return;
    }
    outs.push_back(experts);
    last = experts;
}

ggml_tensor * vis_moe_layer_graph::output() {
    GGML_ASSERT(!outs.empty());
    if (stream) {
        // after the layer's experts ran: drop their pages (the returned view orders the drop before later use)
        ggml_tensor * t = ggml_map_custom1_inplace(ctx, outs[0], vis_drop_op, 1, vm->ud(il, 0, VIS_OP_DROP));
        ggml_format_name(t, "vis_moe_drop-%d", il);
        return t;
    }
    if (!managed || outs.size() == 1) {
        return outs[0];  // one pass, or the CPU in-place merge
    }
    ggml_tensor * cat = outs[0];
    for (size_t p = 1; p < outs.size(); ++p) {
        cat = ggml_concat(ctx, cat, outs[p], 2);
    }
    const int64_t n_embd = outs[0]->ne[0], k = outs[0]->ne[1], n_tokens = outs[0]->ne[2];
    ggml_tensor * sel = ggml_map_custom2(ctx, ids_cont, last, vis_op, 1, vm->ud(il, 0, VIS_OP_SELECT));
    ggml_format_name(sel, "vis_moe_select-%d", il);
    ggml_tensor * rows = ggml_reshape_2d(ctx, cat, n_embd, k * n_tokens * (int64_t) outs.size());
    ggml_tensor * got  = ggml_get_rows(ctx, rows, ggml_reshape_1d(ctx, sel, k * n_tokens));
    got = ggml_reshape_3d(ctx, got, n_embd, k, n_tokens);
    ggml_format_name(got, "vis_moe_experts-%d", il);
    return got;
}

// ---------------------------------------------------------------------------
// stats API
// ---------------------------------------------------------------------------
int32_t llama_vis_moe_get_stats(const llama_context * ctx, int32_t il, llama_vis_moe_stats * out) {
    vis_moe_context * vm = vis_moe_context_get(ctx);
    if (!vm || !out) {
        return -1;
    }
    if (il >= 0) {
        if (il >= (int32_t) vm->layers.size()) {
            return -1;
        }
        *out = vm->layers[il].stats;
        return 0;
    }
    llama_vis_moe_stats tot = {};
    for (const auto & L : vm->layers) {
        const auto & s = L.stats;
        tot.n_slots = std::max(tot.n_slots, s.n_slots);
        tot.managed |= s.managed;
        tot.n_routed += s.n_routed;
        tot.n_hits += s.n_hits;
        tot.n_misses += s.n_misses;
        tot.bytes_loaded += s.bytes_loaded;
        tot.load_us += s.load_us;
        tot.n_calls += s.n_calls;
        tot.n_passes += s.n_passes;
    }
    *out = tot;
    return 0;
}

static int64_t rss_peak_bytes() {
    FILE * f = std::fopen("/proc/self/status", "r");
    if (!f) {
        return -1;
    }
    char line[256];
    int64_t kib = -1;
    while (std::fgets(line, sizeof(line), f)) {
        if (std::strncmp(line, "VmHWM:", 6) == 0) {
            kib = std::strtoll(line + 6, nullptr, 10);
        }
    }
    std::fclose(f);
    return kib < 0 ? -1 : kib * 1024;
}

int32_t llama_vis_moe_get_io_stats(const llama_context * ctx, llama_vis_moe_io_stats * out) {
    vis_moe_context * vm = vis_moe_context_get(ctx);
    if (!vm || !out) {
        return -1;
    }
    llama_vis_moe_io_stats st = {};
    st.slab_hits    = vm->n_slab_hits;
    st.host_hits    = vm->n_host_hits;
    st.file_reads   = vm->n_file_reads;
    st.model_copies = vm->n_model_copies;
    if (vm->io) {
        const auto & c = vm->io->counters();
        st.bytes_read    = c.bytes_read;
        st.bytes_storage = c.bytes_device;
        st.read_us       = c.wait_us;
        st.direct_io     = c.n_direct > 0 ? 1 : 0;
        st.io_threads    = vm->io->n_threads();
    }
    if (vm->host) {
        st.host_bytes     = (int64_t) (vm->host->capacity_blocks() * vm->host->block_bytes());
        st.host_used      = (int64_t) (vm->host->used_blocks() * vm->host->block_bytes());
        st.host_evictions = vm->host->n_evictions;
    }
    st.slab_bytes = vm->slab_bytes;
    st.unified    = vm->unified ? 1 : 0;
    st.locked     = vm->locked ? 1 : 0;
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    st.major_faults = ru.ru_majflt - vm->majflt0;
    st.rss_peak     = rss_peak_bytes();
    st.streamed       = vm->n_streamed;
    st.bytes_streamed = vm->bytes_streamed;
    *out = st;
    return 0;
}

void llama_vis_moe_reset_stats(llama_context * ctx) {
    vis_moe_context * vm = vis_moe_context_get(ctx);
    if (!vm) {
        return;
    }
    vm->n_slab_hits = vm->n_host_hits = vm->n_file_reads = vm->n_model_copies = 0;
    vm->n_streamed = vm->bytes_streamed = 0;
    if (vm->io) {
        vm->io->reset_counters();
    }
    if (vm->host) {
        vm->host->n_evictions = 0;
    }
    for (auto & L : vm->layers) {
        const int32_t n_slots = L.stats.n_slots, managed = L.stats.managed;
        L.stats = {};
        L.stats.n_slots = n_slots;
        L.stats.managed = managed;
    }
}

int32_t llama_vis_moe_n_managed(const llama_context * ctx) {
    vis_moe_context * vm = vis_moe_context_get(ctx);
    return vm ? vm->n_managed : 0;
}

void llama_vis_moe_print_stats(const llama_context * ctx) {
    vis_moe_context * vm = vis_moe_context_get(ctx);
    if (!vm) {
        return;
    }
    std::fprintf(stderr, "vis-moe: expert cache stats (%d managed layers)\n", vm->n_managed);
    std::fprintf(stderr, "vis-moe: %5s %6s %10s %10s %10s %8s %12s %10s %8s\n", "layer", "slots", "routed", "hits", "misses",
                   "hit%", "MiB loaded", "stall ms", "passes");
    for (size_t il = 0; il < vm->layers.size(); ++il) {
        const auto & s = vm->layers[il].stats;
        if (!s.managed) {
            continue;
        }
        std::fprintf(stderr, "vis-moe: %5zu %6d %10" PRId64 " %10" PRId64 " %10" PRId64 " %7.1f%% %12.2f %10.2f %8" PRId64 "\n", il,
                       s.n_slots, s.n_routed, s.n_hits, s.n_misses, s.n_routed ? 100.0 * s.n_hits / s.n_routed : 0.0,
                       s.bytes_loaded / 1048576.0, s.load_us / 1000.0, s.n_passes);
    }
    llama_vis_moe_stats t;
    llama_vis_moe_get_stats(ctx, -1, &t);
    std::fprintf(stderr, "vis-moe: %5s %6s %10" PRId64 " %10" PRId64 " %10" PRId64 " %7.1f%% %12.2f %10.2f %8" PRId64 "\n", "total", "",
                   t.n_routed, t.n_hits, t.n_misses, t.n_routed ? 100.0 * t.n_hits / t.n_routed : 0.0,
                   t.bytes_loaded / 1048576.0, t.load_us / 1000.0, t.n_passes);
    llama_vis_moe_io_stats io;
    if (llama_vis_moe_get_io_stats(ctx, &io) == 0 && (io.file_reads > 0 || io.host_hits > 0 || vm->io)) {
        const double secs = io.read_us / 1e6;
        std::fprintf(stderr, "vis-moe: tiers: slab hits %" PRId64 " | host-cache hits %" PRId64 " | file reads %" PRId64
                             " (%.2f MiB payload, %.2f MiB from storage%s, %.2f s waiting, %.0f MiB/s) | model copies %" PRId64 "\n",
                     io.slab_hits, io.host_hits, io.file_reads, io.bytes_read / 1048576.0, io.bytes_storage / 1048576.0,
                     io.direct_io ? " with O_DIRECT" : " buffered", secs, secs > 0 ? io.bytes_read / 1048576.0 / secs : 0.0,
                     io.model_copies);
        if (io.streamed > 0) {
            std::fprintf(stderr, "vis-moe: prefill streaming: %" PRId64 " experts (%.2f MiB) read through the mapping by "
                                 "ubatches needing more than %d passes, pages dropped after each layer\n",
                         io.streamed, io.bytes_streamed / 1048576.0, vm->stream_passes);
        }
        std::fprintf(stderr, "vis-moe: memory: slabs %.2f MiB, host cache %.2f/%.2f MiB (%" PRId64 " evictions), %s, "
                             "peak RSS %.2f MiB, major faults %" PRId64 "\n",
                     io.slab_bytes / 1048576.0, io.host_used / 1048576.0, io.host_bytes / 1048576.0, io.host_evictions,
                     io.locked ? "locked" : "not locked", io.rss_peak / 1048576.0, io.major_faults);
        if (vm->plan_budget > 0) {
            std::fprintf(stderr, "vis-moe: memory plan: budget %.0f MiB (%s)\n", vm->plan_budget / 1048576.0, vm->plan_source.c_str());
        }
        for (const auto & n : vm->notes) {
            std::fprintf(stderr, "vis-moe: %s\n", n.c_str());
        }
    }
}
