// vis-moe-compute-probe.cpp - the compute side of the configurator's cost model (llama-vis.h,
// docs/planning.md#cost-model):
// timed once per (backend device, weight type, expert shape, thread count) through the ggml backend API, on the
// device the experts run on, and cached in $XDG_CACHE_HOME/vis-moe/compute (default ~/.cache) next to the
// bandwidth probe.  Four numbers, each overridden by its knob (all four set: nothing is timed):
//   mem_bps       weight bytes/s of a memory-bound matmul at one token (decode): a matrix of the experts' type and
//                 row length, larger than the caches, times one token (VIS_MOE_MEM_MBPS)
//   token_byte_s  seconds per prompt token per weight byte at a large batch (prefill compute): the same matrix
//                 times BATCH tokens (VIS_MOE_TOKEN_NS_PER_MIB, ns per token per MiB)
//   pass_s        one extra pass of one layer: one graph of the ops a pass re-runs over the ubatch (SiLU, the gate
//                 product, the routing weights, the sum into the layer's output) at one token ...
//   pass_token_s  ... and its growth per token of the ubatch (VIS_MOE_PASS_US, VIS_MOE_PASS_TOKEN_US)
// A probe timed while the load average exceeds the CPUs is used but not cached (VIS_MOE_PROBE_CACHE).
#include "llama-vis.h"
#include "vis-error.h"
#include "vis-moe-settings.h"
#include "vis-moe-cost-cache.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <sched.h>

namespace {

constexpr int64_t MATRIX_BYTES = 48ll << 20;  // larger than the last-level cache: weights stream from memory
constexpr int     BATCH        = 64;           // tokens of the batched matmul and of the long pass
constexpr int     REPEAT_MIN   = 3;            // each timing: the best of at least this many runs ...
constexpr int     REPEAT_MAX   = 50;           // ... and at most this many,
constexpr double  TIME_S       = 0.1;          // ... repeated while under this many seconds (a loaded machine
                                               // leaves the probe some quiet runs to find)

struct probed {
    double mem_bps = 0, token_byte_s = 0, pass_s = 0, pass_token_s = 0;
};

// "key mem_bps token_byte_s pass_s pass_token_s" lines; the last valid one of the key wins.  A line of the key that
// does not parse is reported (the caller probes again and appends a good line).
bool cached(const std::string & key, probed & p, bool & bad) {
    std::ifstream f(vis_moe_cost_cache_file("compute"));
    std::string line;
    bool found = false;
    while (std::getline(f, line)) {
        std::istringstream ss(line);
        std::string k;
        if (!(ss >> k) || k != key) {
            continue;
        }
        probed q;
        std::string extra;
        if ((ss >> q.mem_bps >> q.token_byte_s >> q.pass_s >> q.pass_token_s) && !(ss >> extra) &&
            std::isfinite(q.mem_bps) && std::isfinite(q.token_byte_s) && std::isfinite(q.pass_s) &&
            std::isfinite(q.pass_token_s) && q.mem_bps > 0 && q.token_byte_s > 0 && q.pass_s >= 0 &&
            q.pass_token_s >= 0) {
            p = q;
            found = true;
            bad = false;
        } else {
            bad = true;
        }
    }
    return found && !bad;
}

void store(const std::string & key, const probed & p) {
    std::ostringstream ss;
    ss.precision(17);  // the numbers read back are the ones probed
    ss << key << " " << p.mem_bps << " " << p.token_byte_s << " " << p.pass_s << " " << p.pass_token_s;
    vis_moe_cost_cache_append("compute", ss.str());
}

// one backend on the CPU device with n_threads threads, and the context its tensors are made in
struct bench {
    ggml_backend_t backend = nullptr;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;

    bench(int n_threads, size_t n_tensors) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        backend = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
        if (backend) {
            ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
            auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(
                reg, "ggml_backend_set_n_threads");
            if (set_threads) {
                set_threads(backend, n_threads);
            }
        }
        ggml_init_params ip = { ggml_tensor_overhead() * n_tensors + ggml_graph_overhead() * 8, nullptr, true };
        ctx = ggml_init(ip);
    }
    ~bench() {
        if (buf) {
            ggml_backend_buffer_free(buf);
        }
        if (ctx) {
            ggml_free(ctx);
        }
        if (backend) {
            ggml_backend_free(backend);
        }
    }
    bool alloc() {
        buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        return buf != nullptr;
    }
    // fill a tensor with a small, finite pattern (0x11 bytes: small normal numbers in every float and block format)
    static void fill(ggml_tensor * t) {
        if (t->type == GGML_TYPE_F32) {
            std::vector<float> v(ggml_nelements(t), 0.01f);
            ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
        } else {
            std::vector<uint8_t> v(ggml_nbytes(t), 0x11);
            ggml_backend_tensor_set(t, v.data(), 0, v.size());
        }
    }
    // the best of REPEAT runs of a graph ending in `out`, seconds (after one warm-up run); its intermediate tensors
    // are allocated by a graph allocator on the backend's buffer type
    double time(ggml_tensor * out) {
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        struct gallocr {
            ggml_gallocr_t a;
            ~gallocr() { ggml_gallocr_free(a); }
        } ga{ ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)) };
        if (!ga.a || !ggml_gallocr_alloc_graph(ga.a, gf)) {
            return -1;
        }
        double best = 1e30;
        const double start = vis_moe_cost_now_s();
        for (int i = 0; i <= REPEAT_MAX && (i <= REPEAT_MIN || vis_moe_cost_now_s() - start < TIME_S); ++i) {
            const double t0 = vis_moe_cost_now_s();
            if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
                return -1;
            }
            if (i > 0) {
                best = std::min(best, vis_moe_cost_now_s() - t0);
            }
        }
        return best;
    }
};

// the four numbers, timed; false if the backend cannot run the probe (the caller says so)
bool probe(ggml_type type, int64_t n_embd, int64_t n_ff_exp, int64_t k, int n_threads, probed & p) {
    const int64_t blck = ggml_blck_size(type);
    n_embd = std::max<int64_t>(blck, (n_embd + blck - 1) / blck * blck);  // a row the type can hold
    const int64_t row = (int64_t) ggml_row_size(type, n_embd);
    const int64_t rows = std::max<int64_t>(64, MATRIX_BYTES / std::max<int64_t>(row, 1));
    n_ff_exp = std::max<int64_t>(1, n_ff_exp);
    k = std::max<int64_t>(1, k);
    bench b(n_threads, 64);
    if (!b.backend || !b.ctx) {
        return false;
    }
    ggml_tensor * w  = ggml_new_tensor_2d(b.ctx, type, n_embd, rows);
    ggml_tensor * x1 = ggml_new_tensor_2d(b.ctx, GGML_TYPE_F32, n_embd, 1);
    ggml_tensor * xb = ggml_new_tensor_2d(b.ctx, GGML_TYPE_F32, n_embd, BATCH);
    // a pass's element-wise ops over the pairs of t tokens: SiLU(gate) * up, the routing weight, the sum over k
    ggml_tensor * g[2], * u[2], * d[2], * rw[2];
    for (int i = 0; i < 2; ++i) {
        const int64_t t = i == 0 ? 1 : BATCH;
        g[i]  = ggml_new_tensor_3d(b.ctx, GGML_TYPE_F32, n_ff_exp, k, t);
        u[i]  = ggml_new_tensor_3d(b.ctx, GGML_TYPE_F32, n_ff_exp, k, t);
        d[i]  = ggml_new_tensor_3d(b.ctx, GGML_TYPE_F32, n_embd, k, t);
        rw[i] = ggml_new_tensor_3d(b.ctx, GGML_TYPE_F32, 1, k, t);
    }
    if (!b.alloc()) {
        return false;
    }
    for (ggml_tensor * t = ggml_get_first_tensor(b.ctx); t; t = ggml_get_next_tensor(b.ctx, t)) {
        bench::fill(t);
    }
    const double wbytes = (double) ggml_nbytes(w);
    const double t1 = b.time(ggml_mul_mat(b.ctx, w, x1));
    const double tb = b.time(ggml_mul_mat(b.ctx, w, xb));
    double tp[2];
    for (int i = 0; i < 2; ++i) {
        ggml_tensor * h = ggml_mul(b.ctx, ggml_silu(b.ctx, g[i]), u[i]);
        ggml_tensor * o = ggml_mul(b.ctx, d[i], rw[i]);
        // the pass's output added into the layer's: one add per pass over n_embd x t, after the k experts' sum
        ggml_tensor * s = ggml_sum_rows(b.ctx, ggml_cont(b.ctx, ggml_permute(b.ctx, o, 1, 0, 2, 3)));
        tp[i] = b.time(ggml_add(b.ctx, ggml_sum(b.ctx, h), ggml_sum(b.ctx, s)));
    }
    if (!(t1 > 0) || !(tb > 0) || !(tp[0] > 0) || !(tp[1] >= 0)) {
        return false;
    }
    p.mem_bps      = wbytes / t1;
    p.token_byte_s = tb / (BATCH * wbytes);
    p.pass_s       = tp[0];
    p.pass_token_s = std::max(0.0, (tp[1] - tp[0]) / (BATCH - 1));
    return true;
}

// the 1-minute load average above the CPUs this process may use: a probe timed now measures the other processes'
// share of the cores (a pass measured 25 us on an idle 2-core VM and up to 70 ms at load 6), so it is not cached
bool machine_busy(double & load, int & n_cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    n_cpu = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    std::ifstream f("/proc/loadavg");
    return (f >> load) && load > n_cpu;
}

} // namespace

int32_t llama_vis_moe_cost_probe(const char * path, int32_t type, int64_t n_embd, int64_t n_ff_exp,
                                 int32_t n_expert_used, int32_t n_threads, struct llama_vis_moe_cost * cost) {
    if (llama_vis_moe_cost_default(path, cost) != 0) {
        return -1;
    }
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((ggml_type) type) <= 0 ||
        ggml_type_size((ggml_type) type) == 0 ||
        n_embd <= 0 || n_ff_exp <= 0 || n_expert_used <= 0 || n_threads <= 0) {
        vis_set_last_error("llama_vis_moe_cost_probe: need a ggml weight type and n_embd, n_ff_exp, n_expert_used, "
                           "n_threads > 0 (type " + std::to_string(type) + ", n_embd " + std::to_string(n_embd) +
                           ", n_ff_exp " + std::to_string(n_ff_exp) + ", n_expert_used " +
                           std::to_string(n_expert_used) + ", n_threads " + std::to_string(n_threads) + ")");
        return -1;
    }
    const vis_moe_plan_settings ps = vis_moe_settings_current().plan;  // parsed by llama_vis_moe_cost_default above
    const bool all_set = ps.mem_mbps > 0 && ps.token_ns_per_mib >= 0 && ps.pass_us >= 0 && ps.pass_token_us >= 0;
    probed p;
    if (!all_set) {
        const std::string key = std::string("cpu-") + ggml_type_name((ggml_type) type) + "-e" + std::to_string(n_embd) +
                                "-f" + std::to_string(n_ff_exp) + "-k" + std::to_string(n_expert_used) + "-t" +
                                std::to_string(n_threads);
        bool bad = false;
        if (ps.probe_cache == 0 || !cached(key, p, bad)) {
            if (bad) {
                vis_tell_user(vis_moe_cost_cache_file("compute") + ": the cached compute costs of " +
                              key + " do not parse; probing again (docs/planning.md#cost-model)");
            }
            if (!probe((ggml_type) type, n_embd, n_ff_exp, n_expert_used, n_threads, p)) {
                vis_set_last_error("llama_vis_moe_cost_probe: the CPU backend could not run the compute probe; "
                                   "set VIS_MOE_MEM_MBPS, VIS_MOE_TOKEN_NS_PER_MIB, VIS_MOE_PASS_US and "
                                   "VIS_MOE_PASS_TOKEN_US");
                return -1;
            }
            double load = 0;
            int n_cpu = 1;
            if (ps.probe_cache == 0) {
                // VIS_MOE_PROBE_CACHE=off: timed at every start
            } else if (ps.probe_cache < 0 && machine_busy(load, n_cpu)) {
                char msg[256];
                std::snprintf(msg, sizeof(msg), "the machine is busy (load average %.1f on %d CPUs): the "
                              "compute costs just timed are used for this plan only, not cached "
                              "(docs/planning.md#cost-model)",
                              load, n_cpu);
                vis_tell_user(msg);
            } else {
                store(key, p);
            }
        }
    }
    cost->mem_bps      = ps.mem_mbps > 0 ? ps.mem_mbps * 1048576.0 : p.mem_bps;
    cost->token_byte_s = ps.token_ns_per_mib >= 0 ? ps.token_ns_per_mib * 1e-9 / 1048576.0 : p.token_byte_s;
    cost->pass_s       = ps.pass_us >= 0 ? ps.pass_us * 1e-6 : p.pass_s;
    cost->pass_token_s = ps.pass_token_us >= 0 ? ps.pass_token_us * 1e-6 : p.pass_token_s;
    cost->probed       = all_set ? 0 : 1;
    return 0;
}
