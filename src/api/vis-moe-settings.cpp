// vis-moe-settings.cpp - where the --moe-* settings live: the environment, process-wide values, per-thread
// overrides, and the settings half of the C API (llama-vis.h).  The table of flags and their parsers:
// vis-moe-settings-table.cpp.  See vis-moe-settings.h.
#include "vis-moe-settings.h"
#include "vis-error.h"
#include "vis-moe-encoder.h"

#include <cctype>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using vis_error = std::invalid_argument;
using flag_row  = vis_moe_flag_row;

int n_rows() {
    int n = 0;
    vis_moe_flag_rows(n);
    return n;
}

// ---- the two layers ----------------------------------------------------------
// Process-wide values are the environment, read at each use (so a variable changed at run time counts, as
// upstream's LLAMA_ARG_* do at parse time), overlaid by the groups of values set explicitly through a flag or
// a set_* call.  A flag sets its whole group, starting from the values in force at that moment.
// G_ENV: the variables without a flag (vis_moe_env_rows), never set explicitly
enum group : unsigned { G_PARAMS = 1, G_TIER = 2, G_STREAM = 4, G_SUB = 8, G_PIN = 16, G_PREDICT = 32, G_SHADOW = 64, G_CAP = 128,
                        G_TOPK = 256, G_POLICY = 512, G_ENV = 1024, G_MODE = 2048 };

unsigned group_of(const flag_row & r) {
    const std::string n = r.name;
    if (n == "--moe-stream-passes" || n == "--moe-stream-ahead" || n == "--moe-stream-lend" ||
        n == "--moe-stream-stage" || n == "--moe-overlap") return G_STREAM;
    if (n == "--moe-pin-mib") return G_PIN;
    if (n == "--moe-topk") return G_TOPK;
    if (n == "--moe-policy") return G_POLICY;
    if (n == "--moe-mode") return G_MODE;
    if (n == "--moe-capacity" || n.rfind("--moe-cap-", 0) == 0) return G_CAP;
    if (n == "--moe-shadow" || n == "--moe-shadow-slots" || n == "--moe-precision" || n.rfind("--moe-prec-", 0) == 0) {
        return G_SHADOW;
    }
    if (n.rfind("--moe-sub", 0) == 0) return G_SUB;  // --moe-substitute, --moe-sub-*
    // --moe-predict, --moe-predict-profile, --moe-lookahead, --moe-prefetch-*
    if (n.rfind("--moe-predict", 0) == 0 || n == "--moe-lookahead" || n.rfind("--moe-prefetch", 0) == 0) return G_PREDICT;
    if (n == "--moe-slots" || n == "--moe-cache-mib" || n == "--moe-pinned-layers" || n == "--moe-stats" ||
        n == "--moe-trace" || n == "--moe-csv") return G_PARAMS;
    return G_TIER;
}

struct env_values {
    vis_moe_settings s;
    std::string error;          // the first invalid variable of a group not set explicitly
    unsigned    error_groups = 0;
    std::vector<std::pair<const flag_row *, std::string>> invalid;  // every invalid variable and its message
};

// the environment now: defaults, then every valid VIS_MOE_* variable
env_values read_env() {
    env_values ev;
    ev.s = vis_moe_settings_builtin();
    // row: the flag row, or null for a variable without a flag
    auto take = [&ev](const flag_row * row, const char * env, unsigned group, auto apply) {
        const char * v = std::getenv(env);
        if (!v || !*v) {
            return;
        }
        vis_moe_settings trial = ev.s;
        try {
            apply(trial, env, v);
            vis_moe_settings_validate(trial);
            ev.s = trial;
        } catch (const std::exception & e) {
            ev.error_groups |= group;
            const std::string msg = std::string("invalid environment variable: ") + e.what() + " (fix or unset " +
                                    env + ")";
            if (row) {
                ev.invalid.emplace_back(row, msg);
            }
            if (ev.error.empty()) {
                ev.error = msg;
            }
        }
    };
    for (int i = 0, n = n_rows(); i < n; ++i) {
        const flag_row & r = vis_moe_flag_rows(n)[i];
        take(&r, r.env, group_of(r), r.apply);
    }
    int n_env = 0;
    const vis_moe_env_row * env_rows = vis_moe_env_rows(n_env);
    for (int i = 0; i < n_env; ++i) {
        take(nullptr, env_rows[i].env, G_ENV, env_rows[i].apply);
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
        s.csv_path   = o.csv_path;
    }
    if (groups & G_TIER) {
        s.tier = o.tier;
    }
    if (groups & G_STREAM) {
        s.stream_passes = o.stream_passes;
        s.stream_ahead  = o.stream_ahead;
        s.stream_lend   = o.stream_lend;
        s.stream_stage  = o.stream_stage;
        s.overlap       = o.overlap;
    }
    if (groups & G_SUB) {
        s.sub = o.sub;
    }
    if (groups & G_PIN) {
        s.pin_mib = o.pin_mib;
    }
    if (groups & G_PREDICT) {
        s.predict = o.predict;
    }
    if (groups & G_SHADOW) {
        s.prec = o.prec;
    }
    if (groups & G_CAP) {
        s.cap = o.cap;
    }
    if (groups & G_TOPK) {
        s.topk = o.topk;
    }
    if (groups & G_POLICY) {
        s.policy = o.policy;
    }
    if (groups & G_MODE) {
        s.mode = o.mode;
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
        vis_moe_settings_validate(s);
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
    for (int i = 0, n = n_rows(); i < n; ++i) {
        const flag_row & r = vis_moe_flag_rows(n)[i];
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
        // also straight to stderr: tools that silence the llama log (llama-bench) would otherwise report only
        // "failed to load model"
        vis_tell_user(error);
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

void vis_moe_settings_check_resident(int64_t model_bytes, int64_t n_expert) {
    const vis_moe_settings s = vis_moe_settings_current();
    const bool all_pinned = s.params.n_pinned < 0;
    const bool all_slots  = s.params.n_slots > 0 && s.params.n_slots >= n_expert;
    if (s.tier.mem_mib == 0 || s.tier.store != 0 || (!all_pinned && !all_slots)) {
        return;
    }
    // the plan of a model with nothing to page (llama_vis_moe_plan, as pyvis plan asks it): all of it must fit
    llama_vis_moe_plan_request rq = {};
    rq.budget         = s.tier.mem_mib > 0 ? (s.tier.mem_mib << 20) : 0;
    rq.resident_bytes = model_bytes;
    rq.reserve_bytes  = llama_vis_moe_estimate_reserve(0, 0, 0, 0, 0);  // the runtime floor; KV comes later
    rq.encoder_bytes  = vis_moe_encoder_bytes();
    rq.host_mib       = -1;
    struct llama_vis_moe_plan plan;
    if (llama_vis_moe_plan(&rq, &plan) != 0 || !plan.ok) {
        const std::string why = all_pinned ? "--moe-pinned-layers -1 keeps every expert resident"
                                           : "--moe-slots " + std::to_string(s.params.n_slots) + " >= the model's " +
                                             std::to_string(n_expert) + " experts keeps every expert resident";
        throw std::runtime_error("vis-moe: --moe-mem " + (s.tier.mem_mib < 0 ? std::string("auto") :
                                 std::to_string(s.tier.mem_mib)) + ": " + why + ", and " + llama_vis_last_error());
    }
}

bool vis_moe_settings_model_fits(int64_t model_bytes) {
    const vis_moe_settings s = vis_moe_settings_current();
    // the vision encoder a VLM tool loads next to the model shares the budget (vis-moe-encoder.cpp)
    return vis_moe_settings_mem_only(s) &&
           llama_vis_moe_whole_model_fits(model_bytes + vis_moe_encoder_bytes(), s.tier.mem_mib << 20) != 0;
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

// what a new thread override starts from: the thread's own override (if `keep` and it has one), else the
// process-wide settings; an override is built on the environment, so a bad variable there is an error here
// too, never skipped.  false with the last error set.
static bool override_base(vis_moe_settings & s, bool keep) {
    if (keep && t_override) {
        s = *t_override;
        return true;
    }
    const env_values ev = read_env();
    if (!ev.error.empty()) {
        vis_set_last_error(ev.error);
        return false;
    }
    s = process_settings();
    return true;
}

// install s as the calling thread's override, after validation
static int32_t set_override(const vis_moe_settings & s) {
    try {
        vis_moe_settings_validate(s);
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return -1;
    }
    t_override = std::make_unique<vis_moe_settings>(s);
    return 0;
}

int32_t llama_vis_moe_set_thread_params(const llama_vis_moe_params * params, const llama_vis_moe_tier_params * tier) {
    vis_clear_last_error();
    if (!params && !tier) {
        t_override.reset();
        return 0;
    }
    vis_moe_settings s;
    if (!override_base(s, false)) {
        return -1;
    }
    if (params) {
        take_params(s, *params);
    }
    if (tier) {
        s.tier = *tier;
    }
    return set_override(s);
}

int32_t llama_vis_moe_thread_params_active(void) {
    return t_override ? 1 : 0;
}

// the row of `flag`, or nullptr with the last error set
static const flag_row * known_row(const char * flag) {
    const flag_row * r = find_row(flag ? flag : "");
    if (!r) {
        vis_set_last_error(std::string("unknown vis-moe flag '") + (flag ? flag : "") + "'");
    }
    return r;
}

// apply `flag` with `value` to s; the row, or nullptr with the last error set (unknown flag, bad value)
static const flag_row * apply_flag(vis_moe_settings & s, const char * flag, const char * value) {
    const flag_row * r = known_row(flag);
    if (!r) {
        return nullptr;
    }
    const std::string name = r->name;
    try {
        r->apply(s, name, value ? value : "");  // a flag without a value: "" = on, or on|off as its variable takes
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return nullptr;
    }
    return r;
}

int32_t llama_vis_moe_cli_apply(const char * flag, const char * value) {
    vis_clear_last_error();
    vis_moe_settings s = process_settings();
    const flag_row * r = apply_flag(s, flag, value);
    if (r) {
        // a flag sets its whole group from the values in force: an invalid variable of another row of that group
        // would be dropped silently (its default taken), so it is an error here; the flag's own variable is overridden
        for (const auto & [row, msg] : read_env().invalid) {
            if (row != r && group_of(*row) == group_of(*r)) {
                vis_set_last_error(msg);
                return -1;
            }
        }
    }
    if (r && r->scope == LLAMA_VIS_MOE_SCOPE_KNOB) {
        // an engine knob given in its old flag spelling: it still works for this release
        std::fprintf(stderr, "warning: %s is deprecated as a flag: it is an engine knob now; set %s=%s instead "
                     "(docs/knobs.md). The flag spelling goes in the next release.\n",
                     r->name, r->env, r->hint ? (value ? value : "") : "on");
    }
    return r ? set_process(s, group_of(*r)) : -1;
}

int32_t llama_vis_moe_thread_apply(const char * flag, const char * value) {
    vis_clear_last_error();
    vis_moe_settings s;
    if (!override_base(s, true) || !apply_flag(s, flag, value)) {
        return -1;
    }
    return set_override(s);
}

int32_t llama_vis_moe_thread_set(int32_t n, const char * const * flags, const char * const * values) {
    vis_clear_last_error();
    vis_moe_settings s;
    if (n < 0 || (n > 0 && (!flags || !values))) {
        vis_set_last_error("llama_vis_moe_thread_set: n = " + std::to_string(n) + " flags without their arrays");
        return -1;
    }
    if (!override_base(s, false)) {
        return -1;
    }
    const vis_moe_settings builtin = vis_moe_settings_builtin();
    for (int32_t i = 0; i < n; ++i) {
        const flag_row * r = values[i] ? apply_flag(s, flags[i], values[i]) : known_row(flags[i]);
        if (!r) {
            return -1;
        }
        if (!values[i] && r->clear) {
            r->clear(s);
        } else if (!values[i] && !apply_flag(s, r->name, r->show(builtin).c_str())) {  // the built-in value, spelled
            return -1;
        }
    }
    return set_override(s);
}

const char * llama_vis_moe_get_value(const char * flag, int32_t builtin) {
    vis_clear_last_error();
    static thread_local std::string out;
    const flag_row * r = known_row(flag);
    if (!r) {
        return nullptr;
    }
    out = r->show(builtin ? vis_moe_settings_builtin() : effective());
    return out.c_str();
}

int32_t llama_vis_moe_n_flags(void) {
    return n_rows();
}

const char * llama_vis_moe_env_brief(void) {
    static thread_local std::string out;
    out.clear();
    int n = 0;
    const flag_row * rows = vis_moe_flag_rows(n);
    for (int i = 0; i < n; ++i) {
        const char * v = std::getenv(rows[i].env);
        if (!v) {
            continue;
        }
        std::string name = rows[i].name;
        name = name.rfind("--moe-", 0) == 0 ? name.substr(6) : name;
        out += (out.empty() ? "" : " ") + name + "=" + v;
    }
    const vis_moe_env_row * env_rows = vis_moe_env_rows(n);
    for (int i = 0; i < n; ++i) {
        const char * v = std::getenv(env_rows[i].env);
        if (v) {  // VIS_MOE_REPLAY -> "replay=..."
            std::string name = std::string(env_rows[i].env).substr(8);
            for (char & c : name) {
                c = c == '_' ? '-' : (char) std::tolower((unsigned char) c);
            }
            out += (out.empty() ? "" : " ") + name + "=" + v;
        }
    }
    return out.c_str();
}

const char * llama_vis_moe_replay_trace(void) {
    vis_clear_last_error();
    static thread_local std::string path;
    try {
        path = vis_moe_settings_current().replay_path;
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return nullptr;
    }
    return path.empty() ? nullptr : path.c_str();
}

int32_t llama_vis_moe_get_flag(int32_t i, llama_vis_moe_flag * out) {
    vis_clear_last_error();
    const int n_rows_ = n_rows();
    if (i < 0 || i >= n_rows_ || !out) {
        vis_set_last_error("llama_vis_moe_get_flag: index " + std::to_string(i) + " out of range 0.." + std::to_string(n_rows_ - 1));
        return -1;
    }
    int n = 0;
    const flag_row & r = vis_moe_flag_rows(n)[i];
    out->name       = r.name;
    out->env        = r.env;
    out->value_hint = r.hint;
    out->help       = r.help;
    out->scope      = r.scope;
    out->value_type = r.type;
    return 0;
}
