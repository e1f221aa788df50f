// vis-moe-metrics.cpp - /metrics and /props of llama-server (vis-moe-metrics.h).
#include "vis-moe-metrics.h"

#include "llama-vis.h"

#include <cstdio>
#include <map>
#include <mutex>

namespace {

struct entry {
    vis_moe_published p;
    std::string       mode;
};

std::mutex                       g_mutex;
std::map<const void *, entry>    g_live;
vis_moe_published                g_retired;  // the last snapshots of the contexts freed so far
bool                             g_any = false;
std::string                      g_mode;        // of the context created last
std::string                      g_props = "null";

void add(vis_moe_published & a, const vis_moe_published & b) {
    a.c += b.c;
    a.prompt_tokens += b.prompt_tokens;
    a.decode_tokens += b.decode_tokens;
    a.ubatches += b.ubatches;
    a.busy_s += b.busy_s;
}

// a Prometheus label value: backslash, double quote and newline escaped
std::string label(const std::string & v) {
    std::string r;
    for (char ch : v) {
        if (ch == '\\' || ch == '"') {
            r += '\\';
            r += ch;
        } else if (ch == '\n') {
            r += "\\n";
        } else {
            r += ch;
        }
    }
    return r;
}

struct metric_text {
    std::string out;
    // one family: HELP and TYPE, then one sample per (labels, value)
    void family(const char * name, const char * type, const char * help,
                std::initializer_list<std::pair<std::string, double>> samples) {
        const std::string full = std::string("llamacpp:vis_moe_") + name;
        out += "# HELP " + full + " " + help + "\n# TYPE " + full + " " + type + "\n";
        for (const auto & [labels, v] : samples) {
            char b[64];
            // counts as integers (exact to 2^53), times with microsecond resolution
            std::snprintf(b, sizeof(b), v == (double) (int64_t) v && v < 9007199254740992.0 ? "%.0f" : "%.6f", v);
            out += full + labels + " " + b + "\n";
        }
    }
};

} // namespace

void vis_moe_metrics_attach(const void * key, const std::string & mode, const std::string & props_json) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_live[key] = entry{ {}, mode };
    g_any   = true;
    g_mode  = mode;
    g_props = props_json;
}

void vis_moe_metrics_publish(const void * key, const vis_moe_published & p) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_live.find(key);
    if (it != g_live.end()) {
        it->second.p = p;
    }
}

void vis_moe_metrics_detach(const void * key) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_live.find(key);
    if (it != g_live.end()) {
        add(g_retired, it->second.p);
        g_live.erase(it);
    }
}

// ---- C API ---------------------------------------------------------------------
const char * llama_vis_moe_metrics_text(void) {
    static thread_local std::string ret;
    vis_moe_published t;
    std::string mode;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (!g_any) {
            ret.clear();
            return ret.c_str();
        }
        t = g_retired;
        for (const auto & [key, e] : g_live) {
            add(t, e.p);
        }
        mode = g_mode;
    }
    const auto & c = t.c;
    metric_text m;
    m.family("info", "gauge", "The expert cache's mode (exact, or lossy and its mechanisms) of the context created last",
             { { "{mode=\"" + label(mode.rfind("lossy", 0) == 0 ? "lossy" : "exact") + "\",detail=\"" + label(mode) + "\"}", 1.0 } });
    m.family("tokens_total", "counter", "Tokens computed by contexts with an expert cache, by phase",
             { { "{phase=\"prompt\"}", (double) t.prompt_tokens }, { "{phase=\"decode\"}", (double) t.decode_tokens } });
    m.family("ubatches_total", "counter", "Ubatches computed", { { "", (double) t.ubatches } });
    m.family("ubatch_seconds_total", "counter", "Wall time of those ubatches", { { "", t.busy_s } });
    m.family("routed_total", "counter", "Routed experts looked up in the slots (per pass)", { { "", (double) c.routed } });
    m.family("hits_total", "counter", "Routed experts found in a slot", { { "", (double) c.hits } });
    m.family("misses_total", "counter", "Routed experts loaded into a slot, by the tier that served them",
             { { "{tier=\"host_cache\"}", (double) c.host_hits }, { "{tier=\"storage\"}", (double) c.file_reads },
               { "{tier=\"model_copy\"}", (double) c.model_copies } });
    m.family("loaded_bytes_total", "counter", "Bytes copied into slots", { { "", (double) c.loaded_bytes } });
    m.family("read_bytes_total", "counter", "Payload bytes read from storage on demand", { { "", (double) c.read_bytes } });
    m.family("read_stall_seconds_total", "counter", "Time compute waited for expert loads",
             { { "", c.stall_us / 1e6 } });
    m.family("reads_ahead_total", "counter", "Experts read ahead of need (--moe-predict), by outcome",
             { { "{outcome=\"used\"}", (double) c.ahead_used }, { "{outcome=\"wasted\"}", (double) c.ahead_wasted } });
    m.family("ahead_bytes_total", "counter", "Bytes read ahead of need", { { "", (double) c.ahead_bytes } });
    m.family("lossy_events_total", "counter", "(token, expert) pairs that did not run their routed expert at full precision",
             { { "{kind=\"substituted\"}", (double) c.substituted }, { "{kind=\"shadow\"}", (double) c.shadow },
               { "{kind=\"rerouted\"}", (double) c.rerouted }, { "{kind=\"dropped\"}", (double) c.dropped } });
    ret = m.out;
    return ret.c_str();
}

const char * llama_vis_moe_props_json(void) {
    static thread_local std::string ret;
    std::lock_guard<std::mutex> lock(g_mutex);
    ret = g_props;
    return ret.c_str();
}
