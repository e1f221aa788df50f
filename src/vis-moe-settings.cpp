// vis-moe-settings.cpp - the table of every --moe-* setting, strict parsing,
// process-wide and per-thread values, and the settings half of the C API
// (llama-vis.h).  See vis-moe-settings.h.
#include "vis-moe-settings.h"
#include "vis-error.h"

#include <cctype>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace {

constexpr long long MAX_SLOTS  = 1 << 16;   // far above any model's expert count (LLAMA_MAX_EXPERTS)
constexpr long long MAX_LAYERS = 1 << 16;
constexpr long long MAX_MIB    = 1ll << 30; // 1 PiB
constexpr long long MAX_IO     = 64;
constexpr long long MAX_STREAM = 1 << 16;
constexpr long long MAX_SUB_BUDGET = 64;    // substitutions per token per layer: at most the top-k

using vis_error = std::invalid_argument;

// [+-]digits and nothing else, within [lo, hi]
long long parse_int(const std::string & what, const std::string & v, long long lo, long long hi, const char * note = "") {
    size_t i = (!v.empty() && (v[0] == '-' || v[0] == '+')) ? 1 : 0;
    bool ok = i < v.size();
    for (size_t j = i; ok && j < v.size(); ++j) {
        ok = std::isdigit((unsigned char) v[j]) != 0;
    }
    errno = 0;
    const long long r = ok ? std::strtoll(v.c_str(), nullptr, 10) : 0;
    if (!ok || errno == ERANGE || r < lo || r > hi) {
        throw vis_error(what + ": expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + note +
                        ", got '" + v + "'");
    }
    return r;
}

// auto (-1, if allowed) | on (1) | off (0); 1/0 and true/false are accepted as on/off
int32_t parse_switch(const std::string & what, const std::string & v, bool allow_auto) {
    if (allow_auto && v == "auto") return -1;
    if (v == "on"  || v == "1" || v == "true")  return 1;
    if (v == "off" || v == "0" || v == "false") return 0;
    throw vis_error(what + ": expected " + (allow_auto ? "auto, on or off" : "on or off") + ", got '" + v + "'");
}

// a finite decimal number and nothing else, within [lo, hi]
double parse_real(const std::string & what, const std::string & v, double lo, double hi, const char * note = "") {
    char * end = nullptr;
    errno = 0;
    const double r = v.empty() || std::isspace((unsigned char) v[0]) ? NAN : std::strtod(v.c_str(), &end);
    if (v.empty() || !end || *end != '\0' || errno == ERANGE || !std::isfinite(r) || r < lo || r > hi) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "a number in %g..%g", lo, hi);
        throw vis_error(what + ": expected " + buf + note + ", got '" + v + "'");
    }
    return r;
}

using apply_fn = void (*)(vis_moe_settings & s, const std::string & what, const std::string & value);

struct flag_row {
    const char * name;
    const char * env;
    const char * hint;  // nullptr: a flag without a value (its variable takes on/off)
    const char * help;
    apply_fn     apply;
};

const flag_row ROWS[] = {
    { "--moe-slots", "VIS_MOE_SLOTS", "N",
      "vis-moe: expert slots per managed MoE layer; routed experts are loaded into them on demand\n"
      "(fewer than the model's top-k run exactly, in passes; >= its expert count = everything resident; default: 0 = off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.n_slots = (int32_t) parse_int(w, v, 0, MAX_SLOTS, " (0 = off)"); } },
    { "--moe-cache-mib", "VIS_MOE_CACHE_MIB", "M",
      "vis-moe: derive --moe-slots from a total slab budget of M MiB over the managed layers (default: 0 = off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.cache_mib = parse_int(w, v, 0, MAX_MIB, " (0 = off)"); } },
    { "--moe-pinned-layers", "VIS_MOE_PINNED", "L",
      "vis-moe: keep the first L MoE layers fully resident (-1 = all; default: 0)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.n_pinned = (int32_t) parse_int(w, v, -1, MAX_LAYERS, " (-1 = all)"); } },
    { "--moe-stats", "VIS_MOE_STATS", nullptr,
      "vis-moe: print per-layer expert cache stats (hits, misses, bytes loaded, stall) to stderr at exit",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.print_stats = v.empty() ? 1 : parse_switch(w, v, false); } },
    { "--moe-trace", "VIS_MOE_TRACE", "FILE",
      "vis-moe: record every routing decision to FILE (binary; read with pyvis.runtime.trace). An existing GGUF or\n"
      "model file is never overwritten",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v.empty()) {
              throw vis_error(w + ": expected a file path, got ''");
          }
          s.trace_path = v; } },
    { "--moe-store", "VIS_MOE_STORE", "file|model",
      "vis-moe: where missed experts come from: file = read each expert from the GGUF on demand; managed\n"
      "experts are not loaded at start (tier 3); model = llama.cpp loads them and the cache copies (default: file)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v != "file" && v != "model") {
              throw vis_error(w + ": expected file or model, got '" + v + "'");
          }
          s.tier.store = v == "model" ? 1 : 0; } },
    { "--moe-host-mib", "VIS_MOE_HOST_MIB", "N",
      "vis-moe: host-RAM expert cache (tier 2) between the slabs and the file, in MiB (default: planned by\n"
      "--moe-mem, else 0)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.host_mib = parse_int(w, v, 0, MAX_MIB); } },
    { "--moe-mem", "VIS_MOE_MEM", "auto|off|MIB",
      "vis-moe: memory budget of the whole process; slots and host cache are sized to fit it next to the\n"
      "resident weights, KV cache and compute buffers. auto = the real limit (cgroup v1/v2, MemAvailable)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.mem_mib = v == "auto" ? -1 : v == "off" ? 0 : parse_int(w, v, 1, MAX_MIB, " MiB (or auto, off)"); } },
    { "--moe-io-threads", "VIS_MOE_IO_THREADS", "N",
      "vis-moe: parallel expert reads from the file (default: 4)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.io_threads = (int32_t) parse_int(w, v, 1, MAX_IO); } },
    { "--moe-direct-io", "VIS_MOE_DIRECT_IO", "auto|on|off",
      "vis-moe: read experts with O_DIRECT (no page-cache copy); off = buffered reads whose pages are\n"
      "dropped after (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.direct_io = parse_switch(w, v, true); } },
    { "--moe-unified", "VIS_MOE_UNIFIED", "auto|on|off",
      "vis-moe: unified memory (CPU; Jetson with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1): read experts straight\n"
      "into the slabs, and keep nothing in the host cache that a slab holds (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.unified = parse_switch(w, v, true); } },
    { "--moe-mlock", "VIS_MOE_MLOCK", "on|off",
      "vis-moe: lock the slabs and the host cache in memory so they are never swapped (default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.mlock = parse_switch(w, v, false); } },
    { "--moe-pin-mib", "VIS_MOE_PIN_MIB", "auto|off|MIB",
      "vis-moe: discrete GPU: most pinned (page-locked) host memory for the host cache and the staging buffers,\n"
      "in MiB; the rest is ordinary memory. auto = 25 % of MemTotal, off = never pin (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.pin_mib = v == "auto" ? -1 : v == "off" ? 0 : parse_int(w, v, 1, MAX_MIB, " MiB (or auto, off)"); } },
    { "--moe-stream-passes", "VIS_MOE_STREAM_PASSES", "N",
      "vis-moe: a ubatch that would need more than N passes in a managed layer reads that layer's experts\n"
      "through the mapping instead (prefill streaming; 0 = never; default: 8)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.stream_passes = (int32_t) parse_int(w, v, 0, MAX_STREAM, " (0 = never)"); } },
    { "--moe-substitute", "VIS_MOE_SUBSTITUTE", "off|router|buddy|auto",
      "vis-moe (lossy): a token whose expert is not resident may run a resident stand-in with the missing\n"
      "expert's gate weight, while the expert is read in the background. router = the resident expert the\n"
      "token's router ranks highest; buddy = the first resident buddy of --moe-sub-profile; auto = the\n"
      "measured default, exact for now: no setting was faster at < 1 % perplexity on the real-weights testbed\n"
      "(docs/substitution.md). Decode only unless --moe-sub-prefill (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if      (v == "off")    s.sub.mode = VIS_SUB_OFF;
          else if (v == "router") s.sub.mode = VIS_SUB_ROUTER;
          else if (v == "buddy")  s.sub.mode = VIS_SUB_BUDDY;
          else if (v == "auto")   s.sub.mode = VIS_SUB_AUTO;
          else throw vis_error(w + ": expected off, router, buddy or auto, got '" + v + "'"); } },
    { "--moe-sub-profile", "VIS_MOE_SUB_PROFILE", "FILE",
      "vis-moe: buddy lists and routing-entropy percentiles of this model, from\n"
      "pyvis calibrate buddies -m MODEL --out FILE (needed by --moe-substitute buddy and --moe-sub-tae pN)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v.empty()) {
              throw vis_error(w + ": expected a file path, got ''");
          }
          s.sub.profile = v; } },
    { "--moe-sub-tae", "VIS_MOE_SUB_TAE", "off|TAU|pN",
      "vis-moe: never substitute for a token whose normalised top-k routing entropy is <= TAU (0..1), or <= the\n"
      "N-th percentile (0..100) of its layer in --moe-sub-profile with pN (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v == "off") {
              s.sub.tae_kind = VIS_TAE_OFF;
          } else if (!v.empty() && v[0] == 'p') {
              s.sub.tae_kind = VIS_TAE_PERCENTILE;
              s.sub.tae = parse_real(w, v.substr(1), 0, 100, " after 'p' (a percentile; or off, or TAU in 0..1)");
          } else {
              s.sub.tae_kind = VIS_TAE_ABSOLUTE;
              s.sub.tae = parse_real(w, v, 0, 1, " (or off, or pN with N in 0..100)");
          } } },
    { "--moe-sub-margin", "VIS_MOE_SUB_MARGIN", "off|G",
      "vis-moe: never substitute for a token whose top-1 minus top-2 share of its gate weight is >= G (0..1)\n"
      "(default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.margin = v == "off" ? -1 : parse_real(w, v, 0, 1, " (or off)"); } },
    { "--moe-sub-beta", "VIS_MOE_SUB_BETA", "B",
      "vis-moe: substitute nothing in a layer whose ubatch misses more than the share B (0..1) of the experts it\n"
      "routes (default: 1 = no limit)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.beta = parse_real(w, v, 0, 1); } },
    { "--moe-sub-budget", "VIS_MOE_SUB_BUDGET", "N",
      "vis-moe: substitutions per token per layer, lowest gate weight first (default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.budget = (int32_t) parse_int(w, v, 1, MAX_SUB_BUDGET); } },
    { "--moe-sub-weight", "VIS_MOE_SUB_WEIGHT", "W",
      "vis-moe: substitute only experts whose share of the token's gate weight is below W (0..1; default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.weight = parse_real(w, v, 0, 1); } },
    { "--moe-sub-rank", "VIS_MOE_SUB_RANK", "N",
      "vis-moe: substitute only a token's N lowest-ranked experts (N = 1: only its k-th; 0 = any; default: 0)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.rank = (int32_t) parse_int(w, v, 0, MAX_SUB_BUDGET, " (0 = any)"); } },
    { "--moe-sub-prefill", "VIS_MOE_SUB_PREFILL", "on|off",
      "vis-moe: substitute in prefill ubatches too; changes the KV cache of every prompt token (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.prefill = parse_switch(w, v, false) == 1; } },
};
constexpr int N_ROWS = (int) (sizeof(ROWS) / sizeof(ROWS[0]));

vis_moe_settings builtin_defaults() {
    vis_moe_settings s;
    s.tier.store      = 0;
    s.tier.host_mib   = -1;
    s.tier.mem_mib    = 0;
    s.tier.io_threads = 4;
    s.tier.direct_io  = -1;
    s.tier.unified    = -1;
    s.tier.mlock      = 1;
    return s;
}

// ranges of the struct fields: the same as the flags' (the C API takes structs, the CLI strings)
void validate(const vis_moe_settings & s) {
    const auto & p = s.params;
    const auto & t = s.tier;
    auto range = [](const char * flag, long long v, long long lo, long long hi, const char * note) {
        if (v < lo || v > hi) {
            throw vis_error(std::string(flag) + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) + note +
                            ", got " + std::to_string(v));
        }
    };
    range("--moe-slots",         p.n_slots,     0, MAX_SLOTS, " (0 = off)");
    range("--moe-cache-mib",     p.cache_mib,   0, MAX_MIB, " (0 = off)");
    range("--moe-pinned-layers", p.n_pinned,   -1, MAX_LAYERS, " (-1 = all)");
    range("--moe-stats",         p.print_stats, 0, 1, "");
    range("--moe-store",         t.store,       0, 1, " (0 = file, 1 = model)");
    range("--moe-host-mib",      t.host_mib,   -1, MAX_MIB, " (-1 = planned)");
    range("--moe-mem",           t.mem_mib,    -1, MAX_MIB, " (-1 = auto, 0 = off)");
    range("--moe-io-threads",    t.io_threads,  1, MAX_IO, "");
    range("--moe-direct-io",     t.direct_io,  -1, 1, " (-1 = auto, 0 = off, 1 = on)");
    range("--moe-unified",       t.unified,    -1, 1, " (-1 = auto, 0 = off, 1 = on)");
    range("--moe-mlock",         t.mlock,       0, 1, "");
    range("--moe-pin-mib",       s.pin_mib,    -1, MAX_MIB, " (-1 = auto, 0 = off)");
    const auto & u = s.sub;
    range("--moe-substitute",    u.mode, VIS_SUB_OFF, VIS_SUB_AUTO, " (0 = off, 1 = router, 2 = buddy, 3 = auto)");
    range("--moe-sub-budget",    u.budget, 1, MAX_SUB_BUDGET, "");
    range("--moe-sub-rank",      u.rank, 0, MAX_SUB_BUDGET, " (0 = any)");
    auto real = [](const char * flag, double v, double lo, double hi) {
        if (!(v >= lo && v <= hi)) {
            throw vis_error(std::string(flag) + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) +
                            ", got " + std::to_string(v));
        }
    };
    real("--moe-sub-tae", u.tae, 0, u.tae_kind == VIS_TAE_PERCENTILE ? 100 : 1);
    real("--moe-sub-beta", u.beta, 0, 1);
    real("--moe-sub-weight", u.weight, 0, 1);
    if (u.margin >= 0) {
        real("--moe-sub-margin", u.margin, 0, 1);
    }
    if (p.n_slots > 0 && p.cache_mib > 0) {
        throw vis_error("--moe-slots and --moe-cache-mib are alternatives: give one of them");
    }
}

// ---- the two layers ----------------------------------------------------------
// Process-wide values are the environment, read at each use (so a variable changed at run time counts, as
// upstream's LLAMA_ARG_* do at parse time), overlaid by the groups of values set explicitly through a flag or
// a set_* call.  A flag sets its whole group, starting from the values in force at that moment.
enum group : unsigned { G_PARAMS = 1, G_TIER = 2, G_STREAM = 4, G_SUB = 8, G_PIN = 16 };

unsigned group_of(const flag_row & r) {
    const std::string n = r.name;
    if (n == "--moe-stream-passes") return G_STREAM;
    if (n == "--moe-pin-mib") return G_PIN;
    if (n.rfind("--moe-sub", 0) == 0) return G_SUB;  // --moe-substitute, --moe-sub-*
    if (n == "--moe-slots" || n == "--moe-cache-mib" || n == "--moe-pinned-layers" || n == "--moe-stats" ||
        n == "--moe-trace") return G_PARAMS;
    return G_TIER;
}

struct env_values {
    vis_moe_settings s;
    std::string error;          // the first invalid variable of a group not set explicitly
    unsigned    error_groups = 0;
};

// the environment now: defaults, then every valid VIS_MOE_* variable
env_values read_env() {
    env_values ev;
    ev.s = builtin_defaults();
    for (const flag_row & r : ROWS) {
        const char * v = std::getenv(r.env);
        if (!v || !*v) {
            continue;
        }
        vis_moe_settings trial = ev.s;
        try {
            r.apply(trial, r.env, v);
            validate(trial);
            ev.s = trial;
        } catch (const std::exception & e) {
            ev.error_groups |= group_of(r);
            if (ev.error.empty()) {
                ev.error = std::string("invalid environment variable: ") + e.what() + " (fix or unset " + r.env + ")";
            }
        }
    }
    return ev;
}

std::mutex       g_mutex;
unsigned         g_explicit = 0;  // groups set through flags or set_* calls
vis_moe_settings g_set;           // their values

thread_local std::unique_ptr<vis_moe_settings> t_override;
thread_local std::string                        t_trace_ret;  // storage of the trace_path a getter returns

void overlay(vis_moe_settings & s, const vis_moe_settings & o, unsigned groups) {
    if (groups & G_PARAMS) {
        s.params     = o.params;
        s.trace_path = o.trace_path;
    }
    if (groups & G_TIER) {
        s.tier = o.tier;
    }
    if (groups & G_STREAM) {
        s.stream_passes = o.stream_passes;
    }
    if (groups & G_SUB) {
        s.sub = o.sub;
    }
    if (groups & G_PIN) {
        s.pin_mib = o.pin_mib;
    }
}

// process-wide values; `error`: the environment's first invalid variable that they depend on
vis_moe_settings process_settings(std::string * error = nullptr) {
    env_values ev = read_env();
    std::lock_guard<std::mutex> lock(g_mutex);
    overlay(ev.s, g_set, g_explicit);
    if (error && (ev.error_groups & ~g_explicit) != 0) {
        *error = ev.error;
    }
    return ev.s;
}

// store `s` as the process-wide values of `groups`, after validation
int32_t set_process(vis_moe_settings s, unsigned groups) {
    try {
        validate(s);
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    overlay(g_set, s, groups);
    g_explicit |= groups;
    return 0;
}

vis_moe_settings effective() {
    return t_override ? *t_override : process_settings();
}

void take_params(vis_moe_settings & s, const llama_vis_moe_params & p) {
    s.params = p;
    s.params.print_stats = p.print_stats != 0 ? 1 : 0;
    s.params.trace_path = nullptr;
    s.trace_path = p.trace_path ? p.trace_path : "";
}

const flag_row * find_row(const std::string & flag) {
    for (const flag_row & r : ROWS) {
        if (flag == r.name) {
            return &r;
        }
    }
    return nullptr;
}

llama_vis_moe_params params_out(const vis_moe_settings & s) {
    llama_vis_moe_params p = s.params;
    t_trace_ret = s.trace_path;
    p.trace_path = t_trace_ret.empty() ? nullptr : t_trace_ret.c_str();
    return p;
}

} // namespace

vis_moe_settings vis_moe_settings_current() {
    if (t_override) {
        return *t_override;
    }
    std::string error;
    vis_moe_settings s = process_settings(&error);
    if (!error.empty()) {
        // also straight to stderr, once per message: tools that silence the llama log (llama-bench) would
        // otherwise report only "failed to load model"
        static std::mutex m;
        static std::string said;
        {
            std::lock_guard<std::mutex> lock(m);
            if (said != error) {
                said = error;
                std::fprintf(stderr, "vis-moe: %s\n", error.c_str());
            }
        }
        throw std::runtime_error("vis-moe: " + error);
    }
    return s;
}

bool vis_moe_settings_deferral(int & n_pinned, int64_t n_expert) {
    const vis_moe_settings s = vis_moe_settings_current();
    if (!s.cache_on() || s.tier.store != 0 || s.params.n_pinned < 0) {
        return false;
    }
    if (s.params.n_slots > 0 && s.params.n_slots >= n_expert) {
        return false;  // everything fits: upstream loads it
    }
    n_pinned = s.params.n_pinned;
    return true;
}

bool vis_moe_settings_mem_only(const vis_moe_settings & s) {
    return s.tier.mem_mib != 0 && s.tier.store == 0 && s.params.n_slots == 0 && s.params.cache_mib == 0 &&
           s.params.n_pinned >= 0;
}

bool vis_moe_settings_model_fits(int64_t model_bytes) {
    const vis_moe_settings s = vis_moe_settings_current();
    return vis_moe_settings_mem_only(s) && llama_vis_moe_whole_model_fits(model_bytes, s.tier.mem_mib << 20) != 0;
}

// ---- C API ---------------------------------------------------------------------
llama_vis_moe_params llama_vis_moe_default_params(void) {
    return params_out(read_env().s);
}

llama_vis_moe_tier_params llama_vis_moe_tier_default_params(void) {
    return read_env().s.tier;
}

llama_vis_moe_params llama_vis_moe_get_params(void) {
    return params_out(effective());
}

llama_vis_moe_tier_params llama_vis_moe_get_tier_params(void) {
    return effective().tier;
}

int32_t llama_vis_moe_set_params(const llama_vis_moe_params * params) {
    vis_clear_last_error();
    if (!params) {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_explicit &= ~(unsigned) G_PARAMS;  // back to the environment
        return 0;
    }
    vis_moe_settings s = process_settings();
    take_params(s, *params);
    return set_process(s, G_PARAMS);
}

int32_t llama_vis_moe_set_tier_params(const llama_vis_moe_tier_params * params) {
    vis_clear_last_error();
    if (!params) {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_explicit &= ~(unsigned) G_TIER;
        return 0;
    }
    vis_moe_settings s = process_settings();
    s.tier = *params;
    return set_process(s, G_TIER);
}

int32_t llama_vis_moe_set_thread_params(const llama_vis_moe_params * params, const llama_vis_moe_tier_params * tier) {
    vis_clear_last_error();
    if (!params && !tier) {
        t_override.reset();
        return 0;
    }
    // an override is built on the environment: a bad variable there is an error here too, never skipped
    const env_values ev = read_env();
    if (!ev.error.empty()) {
        vis_set_last_error(ev.error);
        return -1;
    }
    vis_moe_settings s = process_settings();
    if (params) {
        take_params(s, *params);
    }
    if (tier) {
        s.tier = *tier;
    }
    try {
        validate(s);
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return -1;
    }
    t_override = std::make_unique<vis_moe_settings>(s);
    return 0;
}

int32_t llama_vis_moe_thread_params_active(void) {
    return t_override ? 1 : 0;
}

int32_t llama_vis_moe_cli_apply(const char * flag, const char * value) {
    vis_clear_last_error();
    const std::string name = flag ? flag : "";
    const flag_row * r = find_row(name);
    if (!r) {
        vis_set_last_error("unknown vis-moe flag '" + name + "'");
        return -1;
    }
    vis_moe_settings s = process_settings();
    try {
        r->apply(s, name, r->hint ? (value ? value : "") : "");
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return -1;
    }
    return set_process(s, group_of(*r));
}

int32_t llama_vis_moe_thread_apply(const char * flag, const char * value) {
    vis_clear_last_error();
    const std::string name = flag ? flag : "";
    const flag_row * r = find_row(name);
    if (!r) {
        vis_set_last_error("unknown vis-moe flag '" + name + "'");
        return -1;
    }
    vis_moe_settings s;
    if (t_override) {
        s = *t_override;
    } else {
        const env_values ev = read_env();  // as for set_thread_params: a bad variable is an error here too
        if (!ev.error.empty()) {
            vis_set_last_error(ev.error);
            return -1;
        }
        s = process_settings();
    }
    try {
        r->apply(s, name, r->hint ? (value ? value : "") : "");
        validate(s);
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return -1;
    }
    t_override = std::make_unique<vis_moe_settings>(s);
    return 0;
}

int32_t llama_vis_moe_n_flags(void) {
    return N_ROWS;
}

int32_t llama_vis_moe_get_flag(int32_t i, llama_vis_moe_flag * out) {
    vis_clear_last_error();
    if (i < 0 || i >= N_ROWS || !out) {
        vis_set_last_error("llama_vis_moe_get_flag: index " + std::to_string(i) + " out of range 0.." + std::to_string(N_ROWS - 1));
        return -1;
    }
    out->name       = ROWS[i].name;
    out->env        = ROWS[i].env;
    out->value_hint = ROWS[i].hint;
    out->help       = ROWS[i].help;
    return 0;
}
