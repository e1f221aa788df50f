// vis-moe-plan.cpp - what memory this machine gives us (cgroup v1/v2 limits,
// MemAvailable, swap, zram) and how one budget splits over the tiers of the
// expert cache.  `pyvis plan` calls the same two functions (docs/paging.md).
#include "llama-vis.h"
#include "vis-error.h"
#include "vis-moe-reserve.h"
#include "vis-pages.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <dirent.h>
#include <sys/resource.h>

static int64_t read_int_file(const std::string & path, bool & ok) {
    std::ifstream f(path);
    std::string s;
    ok = false;
    if (!(f >> s)) {
        return -1;
    }
    if (s == "max") {
        ok = true;
        return -1;
    }
    char * end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (end == s.c_str()) {
        return -1;
    }
    ok = true;
    return (int64_t) v;
}

static int64_t meminfo_kib(const std::string & text, const char * key) {
    const auto p = text.find(std::string(key) + ":");
    if (p == std::string::npos) {
        return -1;
    }
    return std::strtoll(text.c_str() + p + std::strlen(key) + 1, nullptr, 10) * 1024;
}

static std::string slurp(const char * path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Walk from our cgroup up to the root of the mount, keeping the tightest limit.
// `dir` is the mount point, `rel` our path inside it.  v1 "unlimited" is a huge number.
static void cgroup_walk(const std::string & dir, std::string rel, const char * limit_file, const char * usage_file,
                        int64_t & limit, int64_t & usage) {
    for (;;) {
        const std::string d = dir + rel;
        bool ok = false;
        const int64_t l = read_int_file(d + "/" + limit_file, ok);
        if (ok && l > 0 && l < (int64_t) 1 << 60 && (limit < 0 || l < limit)) {
            limit = l;
            bool ok2 = false;
            usage = read_int_file(d + "/" + usage_file, ok2);
            if (!ok2) {
                usage = -1;
            }
        }
        if (rel.empty() || rel == "/") {
            break;
        }
        const auto s = rel.find_last_of('/');
        rel = s == std::string::npos || s == 0 ? "" : rel.substr(0, s);
    }
}

static void probe_cgroup(llama_vis_mem_info & m) {
    m.cgroup_limit = -1;
    m.cgroup_usage = -1;
    m.cgroup_version = 0;
    std::ifstream f("/proc/self/cgroup");
    std::string line;
    std::string v1_path, v2_path;
    bool have_v2 = false;
    while (std::getline(f, line)) {
        // hierarchy-ID:controller-list:cgroup-path
        const auto a = line.find(':');
        const auto b = line.find(':', a + 1);
        if (a == std::string::npos || b == std::string::npos) {
            continue;
        }
        const std::string ctrl = line.substr(a + 1, b - a - 1);
        const std::string path = line.substr(b + 1);
        if (line.compare(0, a, "0") == 0 && ctrl.empty()) {
            v2_path = path;
            have_v2 = true;
        }
        std::stringstream cs(ctrl);
        std::string c;
        while (std::getline(cs, c, ',')) {
            if (c == "memory") {
                v1_path = path;
            }
        }
    }
    // v1: /sys/fs/cgroup/memory/<path>; inside a cgroup namespace the path may not exist: use the mount root
    if (!v1_path.empty()) {
        const std::string mnt = "/sys/fs/cgroup/memory";
        std::string rel = v1_path == "/" ? "" : v1_path;
        std::ifstream probe(mnt + rel + "/memory.limit_in_bytes");
        if (!probe.good()) {
            rel = "";
        }
        int64_t lim = -1, use = -1;
        cgroup_walk(mnt, rel, "memory.limit_in_bytes", "memory.usage_in_bytes", lim, use);
        if (std::ifstream(mnt + "/memory.limit_in_bytes").good()) {
            m.cgroup_version = 1;
        }
        if (lim > 0) {
            m.cgroup_limit = lim;
            m.cgroup_usage = use;
        }
    }
    if (have_v2) {
        for (const char * mnt : { "/sys/fs/cgroup", "/sys/fs/cgroup/unified" }) {
            std::string rel = v2_path == "/" ? "" : v2_path;
            if (!std::ifstream(std::string(mnt) + "/cgroup.controllers").good()) {
                continue;
            }
            if (!std::ifstream(std::string(mnt) + rel + "/cgroup.controllers").good()) {
                rel = "";
            }
            int64_t lim = -1, use = -1;
            cgroup_walk(mnt, rel, "memory.max", "memory.current", lim, use);
            if (std::ifstream(std::string(mnt) + rel + "/memory.max").good() || lim > 0) {
                if (m.cgroup_version == 0) {
                    m.cgroup_version = 2;
                }
            }
            if (lim > 0 && (m.cgroup_limit < 0 || lim < m.cgroup_limit)) {
                m.cgroup_limit = lim;
                m.cgroup_usage = use;
                m.cgroup_version = 2;
            }
            break;
        }
    }
}

static int64_t zram_used() {
    int64_t total = 0;
    DIR * d = opendir("/sys/block");
    if (!d) {
        return 0;
    }
    while (dirent * e = readdir(d)) {
        if (std::strncmp(e->d_name, "zram", 4) != 0) {
            continue;
        }
        // mm_stat: orig_data_size compr_data_size mem_used_total ...
        std::ifstream f(std::string("/sys/block/") + e->d_name + "/mm_stat");
        long long orig = 0, compr = 0, used = 0;
        if (f >> orig >> compr >> used) {
            total += used;
        }
    }
    closedir(d);
    return total;
}

int32_t llama_vis_mem_probe(struct llama_vis_mem_info * out) {
    if (!out) {
        return -1;
    }
    llama_vis_mem_info m = {};
    const std::string mi = slurp("/proc/meminfo");
    m.mem_total     = meminfo_kib(mi, "MemTotal");
    m.mem_available = meminfo_kib(mi, "MemAvailable");
    m.swap_total    = meminfo_kib(mi, "SwapTotal");
    m.swap_free     = meminfo_kib(mi, "SwapFree");
    m.zram_bytes    = zram_used();
    probe_cgroup(m);
    const std::string st = slurp("/proc/self/status");
    m.rss      = vis_process_rss();  // VmRSS
    m.rss_peak = meminfo_kib(st, "VmHWM");
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    m.major_faults = ru.ru_majflt;

    m.limit = m.mem_total;
    if (m.cgroup_limit > 0) {
        m.limit = std::min(m.limit, m.cgroup_limit);
    }
    // what the process may use: what it holds plus what is still free
    int64_t avail = m.mem_available + std::max<int64_t>(m.rss, 0);
    if (m.cgroup_limit > 0) {
        // page cache charged to the cgroup is reclaimable, so the limit itself is what we may grow to
        avail = std::min(avail, m.cgroup_limit);
    }
    m.available = std::min(avail, m.limit);
    *out = m;
    return 0;
}

int64_t llama_vis_moe_estimate_reserve(int64_t n_ubatch, int64_t n_vocab, int64_t n_embd, int64_t n_expert_used,
                                       int64_t n_ff_exp) {
    // f32 activations of one ubatch: logits, a few n_embd-wide rows, gate/up/down rows of the routed experts
    // (qwen3moe 16L at -ub 512: estimate 156 MiB, measured compute buffer 121 MiB)
    const int64_t act = std::max<int64_t>(n_ubatch, 1) * 4 *
                        (std::max<int64_t>(n_vocab, 0) + 6 * std::max<int64_t>(n_embd, 0) +
                         3 * std::max<int64_t>(n_expert_used, 0) * std::max<int64_t>(n_ff_exp, 0));
    // + the runtime (binary, libraries, heap) and the headroom left to the kernel (vis-moe-reserve.h)
    return act + VIS_MOE_RESERVE_RUNTIME + VIS_MOE_RESERVE_KERNEL;
}

// the budget a plan works with: `requested` bytes, never above what this process may hold at all (the cgroup
// limit, MemTotal: a larger number would be planned for and then killed); <= 0: what the machine gives (auto)
static int64_t effective_budget(int64_t requested) {
    llama_vis_mem_info mi;
    llama_vis_mem_probe(&mi);
    if (requested <= 0) {
        return mi.available;
    }
    return mi.limit > 0 ? std::min(requested, mi.limit) : requested;
}

int32_t llama_vis_moe_whole_model_fits(int64_t model_bytes, int64_t budget) {
    budget = effective_budget(budget);
    return model_bytes + llama_vis_moe_estimate_reserve(0, 0, 0, 0, 0) <= budget / 10 * 9 ? 1 : 0;
}

static std::string mib(int64_t b) {
    char buf[32];
    if (b < (10ll << 20) && b % (1 << 20) != 0) {
        std::snprintf(buf, sizeof(buf), "%.1f MiB", std::ceil(b / 104857.6) / 10.0);
    } else {
        std::snprintf(buf, sizeof(buf), "%.0f MiB", std::ceil(b / 1048576.0));
    }
    return buf;
}

int32_t llama_vis_moe_plan(const struct llama_vis_moe_plan_request * req, struct llama_vis_moe_plan * out) {
    vis_clear_last_error();
    if (!req || !out) {
        vis_set_last_error("llama_vis_moe_plan: NULL argument");
        return -1;
    }
    const auto & r = *req;
    if (r.reserve_bytes < 0 || r.encoder_bytes < 0 || r.io_bytes < 0) {
        vis_set_last_error("llama_vis_moe_plan: reserve_bytes, encoder_bytes and io_bytes must be >= 0 "
                           "(llama_vis_moe_estimate_reserve, llama_vis_moe_encoder_estimate and "
                           "llama_vis_moe_io_buffer_bytes give the runtime's), got " + std::to_string(r.reserve_bytes) +
                           ", " + std::to_string(r.encoder_bytes) + " and " + std::to_string(r.io_bytes));
        return -1;
    }
    // the vision encoder (its weights, compute buffer and image copies) is anonymous memory, as compute is
    const std::string kv_and = r.encoder_bytes > 0 ? "KV cache, compute, vision encoder" : "KV cache, compute";
    struct llama_vis_moe_plan p = {};
    const int64_t budget = effective_budget(r.budget);
    if (r.n_managed_layers <= 0 || r.expert_bytes <= 0 || r.n_expert <= 0) {
        // nothing to page: everything is resident, and all of it must fit
        p.n_slots = r.n_expert;
        p.fixed_bytes = r.resident_bytes + r.kv_bytes + r.reserve_bytes + r.encoder_bytes + r.io_bytes;
        p.budget = budget;
        p.min_budget = p.fixed_bytes;
        p.tight_budget = p.fixed_bytes;
        p.ok = p.fixed_bytes <= budget ? 1 : 0;
        if (!p.ok) {
            vis_set_last_error("the memory budget of " + mib(budget) + " is too small: every expert stays resident, so " +
                               mib(r.resident_bytes) + " of weights + " + mib(r.kv_bytes + r.reserve_bytes + r.encoder_bytes + r.io_bytes) +
                               " for " + kv_and + " = " + mib(p.fixed_bytes) + " must fit; raise the budget to " +
                               "at least that, or let experts page (fewer --moe-pinned-layers, fewer --moe-slots)");
        }
        *out = p;
        return 0;
    }
    // the I/O threads' bounce buffers are anonymous memory too
    const int64_t reserve = r.reserve_bytes + r.encoder_bytes + r.io_bytes;
    const int64_t row     = (int64_t) r.n_managed_layers * r.expert_bytes;  // one slot in every managed layer
    const int     k       = std::max(1, (int) r.n_expert_used);
    const int     staging = r.no_staging ? 0 : 1;
    p.budget      = budget;
    p.fixed_bytes = r.resident_bytes + r.kv_bytes + reserve;
    const int64_t host_fixed = r.host_mib > 0 ? (r.host_mib << 20) : 0;
    // Unified memory: the slabs share the budget.  Resident weights come first (every token reads them), then
    // slots; a tight budget gets fewer than top-k slots per layer (exact: decode runs in passes), and below one
    // slot per layer the resident weights that do not fit stay pageable.  What must fit is the anonymous
    // memory: KV cache, compute, host cache and one slot (+ staging) per layer.
    // the least it runs with: one slot per layer (or the --moe-slots asked for), resident weights pageable
    const int64_t min_slots = r.n_slots > 0 ? std::min(r.n_slots, r.n_expert) : 1;
    const int64_t floor_1  = r.unified ? r.kv_bytes + reserve + host_fixed + (int64_t) (1 + staging) * row
                                       : p.fixed_bytes + host_fixed;
    p.min_budget   = r.unified ? r.kv_bytes + reserve + host_fixed + (min_slots + staging) * row : floor_1;
    p.tight_budget = r.unified ? p.fixed_bytes + host_fixed + (int64_t) (k + staging) * row : p.fixed_bytes + host_fixed;
    const int64_t all_experts = (int64_t) r.n_expert * row;

    const int64_t free_host = budget - p.fixed_bytes - host_fixed;
    int slots = r.n_slots;
    if (slots <= 0) {
        const int64_t room = r.unified ? free_host : r.device_bytes;
        slots = (int) std::min<int64_t>(r.n_expert, room / row - staging);
        if (r.unified) {
            slots = std::max(slots, 1);  // below one slot per layer: page resident weights instead (checked below)
        }
    }
    if (slots < 1 || (r.unified && budget < floor_1)) {
        const std::string where = r.unified ? "memory budget" : "device memory";
        vis_set_last_error("the " + where + " of " + mib(r.unified ? budget : r.device_bytes) + " is too small: " +
                               std::to_string(r.n_managed_layers) + " managed layers need at least one expert slot" +
                               (staging ? " + 1 staging slot" : "") + " each (" + mib((int64_t) (1 + staging) * row) + ")" +
                               (r.unified ? " on top of " + mib(r.kv_bytes + reserve + host_fixed) +
                                            " for " + kv_and + " and host cache = " + mib(floor_1)
                                          : std::string()) +
                               "; raise the budget, shorten the context (-c) or pin fewer layers (--moe-pinned-layers)");
        p.ok = 0;
        p.n_slots = std::max(slots, 0);
        *out = p;
        return 0;
    }
    slots = std::min(slots, r.n_expert);
    p.n_slots    = slots;
    p.slab_bytes = (int64_t) (slots + staging) * row;
    if (r.unified) {
        // resident weights that do not fit next to the slabs: left to the page cache, never the slabs or KV
        p.pageable_bytes = std::max<int64_t>(0, p.fixed_bytes + host_fixed + p.slab_bytes - budget);
        if (p.pageable_bytes > r.resident_bytes) {
            vis_set_last_error("the memory budget of " + mib(budget) + " cannot hold " + mib(p.slab_bytes) + " slabs (" +
                                   std::to_string(slots) + " slots per layer) + " + mib(host_fixed) + " host cache next to " +
                                   mib(r.kv_bytes + reserve) + " for " + kv_and + "; lower --moe-slots or --moe-host-mib");
            p.ok = 0;
            *out = p;
            return 0;
        }
    }
    if (r.host_mib >= 0) {
        p.host_bytes = r.host_mib << 20;
    } else if (slots < r.n_expert) {
        // tier 2 gets what is left, never more than the experts the slabs do not hold
        const int64_t left = r.unified ? free_host - p.slab_bytes : budget - p.fixed_bytes;
        const int64_t not_in_slabs = r.unified ? all_experts - (int64_t) slots * row : all_experts;
        p.host_bytes = std::max<int64_t>(0, std::min(left, not_in_slabs));
        // Unified memory: tier 2 is a victim cache shared by every layer, and every eviction copies its expert in.
        // What is left after whole slot rows is less than one row: fewer entries than managed layers, each gone
        // before its layer misses again (48-layer model under the replayed Qwen3 trace, 4 GiB: 21 entries, 11394
        // copies of 2.6 MiB, 0 hits; decode 1.2x faster without it).  Those bytes stay spare memory (staging room).
        if (p.host_bytes < r.expert_bytes || (r.unified && p.host_bytes < row)) {
            p.host_bytes = 0;
        }
    }
    if (r.unified && r.n_slots <= 0 && slots < r.n_expert) {
        // What is left after whole slot rows (and a host cache, if any) is less than one row: one more slot in that
        // many layers (which ones: llama_vis_moe_extra_slots, at attach).  48-layer model at top-6 (the replayed
        // trace): 22 of them next to 22 slots at 4 GiB; 40 next to 5 at 12.5 %, which then serve a top-6 step in one
        // pass (decode 1.15x there; docs/planning.md#slots-from-the-bytes-left-over)
        const int64_t left = budget - p.fixed_bytes - p.slab_bytes - p.host_bytes;
        p.extra_slots = (int32_t) std::clamp<int64_t>(left / r.expert_bytes, 0, r.n_managed_layers - 1);
        p.slab_bytes += (int64_t) p.extra_slots * r.expert_bytes;
    }
    const int64_t cached = (int64_t) slots * row + (int64_t) p.extra_slots * r.expert_bytes +
                           (r.unified ? p.host_bytes : 0);
    p.file_only_bytes = std::max<int64_t>(0, all_experts - std::max(cached, r.unified ? 0 : p.host_bytes));
    p.ok = 1;
    *out = p;
    return 0;
}
