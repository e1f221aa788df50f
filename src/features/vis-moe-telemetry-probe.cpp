// vis-moe-telemetry-probe.cpp - what telemetry (vis-moe-telemetry.h) reads out of a context's expert cache: its
// counters, its lossy mechanisms, its memory plan for /props, the files its run reads.  Declared in
// vis-moe-context.h beside the stats; the telemetry files themselves never see a vis_moe_context.
#include "vis-moe-context.h"
#include "vis-moe-capacity.h"
#include "vis-moe-precision.h"
#include "vis-moe-prefetch.h"
#include "vis-moe-settings.h"
#include "vis-moe-stage.h"
#include "vis-moe-substitute.h"

#include "llama-context.h"
#include "llama-memory.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

vis_moe_counters vis_moe_counters_now(const vis_moe_context & vm) {
    vis_moe_counters c;
    llama_vis_moe_stats st;
    vis_moe_total_stats(vm, st);
    c.routed       = st.n_routed;
    c.hits         = st.n_hits;
    c.misses       = st.n_misses;
    c.loaded_bytes = st.bytes_loaded;
    c.stall_us     = st.load_us;
    c.host_hits    = vm.n_host_hits;
    c.file_reads   = vm.n_file_reads;
    c.model_copies = vm.n_model_copies;
    if (vm.io) {
        c.read_bytes = vm.io->counters().bytes_read;
    }
    if (vm.stage) {
        c.stall_us += vm.stage->stats().wait_us;
    }
    if (vm.prefetch) {
        llama_vis_moe_prefetch_stats p;
        vis_moe_total_prefetch_stats(vm, p);
        c.ahead_used   = p.n_used;
        c.ahead_wasted = p.n_wasted;
        c.ahead_bytes  = p.bytes_read;
    }
    if (vm.sub) {
        llama_vis_moe_sub_stats s;
        vis_moe_total_sub_stats(vm, s);
        c.substituted = s.outcomes[LLAMA_VIS_SUB_SUBSTITUTED];
        c.dropped    += s.outcomes[LLAMA_VIS_SUB_DROPPED];   // --moe-substitute drop (--moe-mode fast)
    }
    if (vm.precision) {
        llama_vis_moe_prec_stats p;
        vis_moe_total_prec_stats(vm, p);
        c.shadow = p.n_shadow_pairs;
        c.stall_us += p.load_us;
    }
    if (vm.capacity) {
        llama_vis_moe_cap_stats p;
        vis_moe_total_cap_stats(vm, p);
        c.rerouted = p.n_rerouted;
        c.dropped += p.n_dropped;                          // --moe-capacity's last resort
    }
    return c;
}

std::string vis_moe_lossy_what(const vis_moe_context & vm) {
    std::string r;
    auto add = [&r](const std::string & s) { r += (r.empty() ? "" : " ") + s; };
    if (vm.topk > 0) {
        add("topk=" + std::to_string(vm.topk));
    }
    if (vm.sub) {
        add(std::string("substitute=") + vm.sub->mode_name());
    }
    if (vm.precision) {
        add(std::string("precision=") + vm.precision->mode_name());
    }
    if (vm.capacity) {
        add("capacity");
    }
    return r;
}

int64_t vis_moe_kv_bytes(const llama_context * lctx) {
    int64_t n = 0;
    if (lctx && lctx->get_memory()) {
        for (const auto & [buft, size] : lctx->get_memory()->memory_breakdown()) {
            n += (int64_t) size;
        }
    }
    return n;
}

std::vector<vis_input_file> vis_moe_run_inputs(const vis_moe_context & vm, const vis_moe_settings & s) {
    std::vector<vis_input_file> in = { { s.sub.profile, "the VIS_MOE_SUB_PROFILE file" },
                                      { s.predict.profile, "the --moe-predict-profile file" },
                                      { s.prec.shadow, "the --moe-shadow file" },
                                      { s.cap.profile, "the VIS_MOE_CAP_PROFILE file" },
                                      { s.replay_path, "the VIS_MOE_REPLAY trace" } };
    for (const auto & L : vm.layers) {
        if (const vis_gguf_file * f = L.any_file()) {
            in.push_back({ f->path, "the model file" });
        }
    }
    return in;
}

// a JSON string: quotes, backslashes and control characters escaped
static std::string jstr(const std::string & v) {
    std::string r = "\"";
    for (unsigned char ch : v) {
        if (ch == '"' || ch == '\\') {
            r += '\\';
            r += (char) ch;
        } else if (ch < 0x20) {
            char b[8];
            std::snprintf(b, sizeof(b), "\\u%04x", ch);
            r += b;
        } else {
            r += (char) ch;
        }
    }
    return r + "\"";
}

std::string vis_moe_props_json(const vis_moe_context & vm, int64_t kv_bytes) {
    int slots = 0;
    for (const auto & L : vm.layers) {
        if (L.managed) {
            slots = std::max(slots, L.n_slots);
        }
    }
    llama_vis_moe_info info = {};
    llama_vis_model_moe_info(vm.model, &info);
    const std::string lossy = vis_moe_lossy_what(vm);
    std::string mechanisms = "[";
    for (size_t i = 0, j; i < lossy.size(); i = j + 1) {
        j = lossy.find(' ', i);
        j = j == std::string::npos ? lossy.size() : j;
        mechanisms += (mechanisms.size() > 1 ? "," : "") + jstr(lossy.substr(i, j - i));
    }
    mechanisms += "]";
    const int64_t host = vm.host ? (int64_t) (vm.host->capacity_blocks() * vm.host->block_bytes()) : 0;
    char b[768];
    std::snprintf(b, sizeof(b),
                  "{\"mode\":%s,\"exact\":%s,\"lossy\":%s,\"moe_layers\":%d,\"managed_layers\":%d,"
                  "\"resident_moe_layers\":%d,\"pinned_layers_setting\":%d,\"slots_per_layer\":%d,\"n_expert\":%d,"
                  "\"n_expert_used\":%d,\"budget_bytes\":%" PRId64 ",\"budget_source\":%s,\"kv_bytes\":%" PRId64
                  ",\"slab_bytes\":%" PRId64 ",\"host_cache_bytes\":%" PRId64 ",\"reserve_bytes\":%" PRId64 "}",
                  jstr(lossy.empty() ? "exact" : "lossy").c_str(), lossy.empty() ? "true" : "false", mechanisms.c_str(),
                  info.n_moe_layers, vm.n_managed, info.n_moe_layers - vm.n_managed, vm.params.n_pinned, slots,
                  info.n_expert, vm.n_expert_used, vm.plan_budget, jstr(vm.plan_source).c_str(), kv_bytes,
                  vm.slab_bytes, host, vm.plan_reserve);
    return b;
}
