// vis-moe-telemetry-types.h - the values telemetry works on (docs/telemetry.md): a snapshot of the expert
// cache's counters, one step (ubatch) of them, what a context publishes to /metrics.
// Plain data: the telemetry files (vis-moe-telemetry, -csv, -status, -metrics) include this and never the cache's
// state; vis-moe-telemetry-probe.cpp reads these values out of a vis_moe_context.
#pragma once

#include "vis-output-file.h"

#include <cstdint>
#include <string>

#define VIS_COUNTER_FIELDS(X) X(routed) X(hits) X(misses) X(host_hits) X(file_reads) X(model_copies) X(loaded_bytes) \
    X(read_bytes) X(stall_us) X(ahead_used) X(ahead_wasted) X(ahead_bytes) X(substituted) X(shadow) X(rerouted) X(dropped)

// the cache's counters at one moment, summed over layers and tiers; each is read from its one owner
struct vis_moe_counters {
    int64_t routed       = 0;  // llama_vis_moe_stats: experts looked up, per pass
    int64_t hits         = 0;  // ... found in a slab
    int64_t misses       = 0;  // ... loaded (host_hits + file_reads + model_copies)
    int64_t host_hits    = 0;  // misses served from the host cache (tier 2)
    int64_t file_reads   = 0;  // misses read from storage (tier 3)
    int64_t model_copies = 0;  // misses copied from llama.cpp's own copy (--moe-store model)
    int64_t loaded_bytes = 0;  // bytes copied into slabs
    int64_t read_bytes   = 0;  // payload bytes read from storage on demand (llama_vis_moe_io_stats::bytes_read)
    int64_t stall_us     = 0;  // compute waited for expert loads: slots, shadow slots, staged streaming
    int64_t ahead_used   = 0;  // reads ahead (--moe-predict) that their step routed
    int64_t ahead_wasted = 0;  // ... that it did not
    int64_t ahead_bytes  = 0;  // bytes read ahead
    int64_t substituted  = 0;  // (token, expert) pairs that ran a stand-in (--moe-substitute)
    int64_t shadow       = 0;  // pairs computed from a low-bit shadow (--moe-precision)
    int64_t rerouted     = 0;  // pairs rerouted to an expert in memory (--moe-capacity)
    int64_t dropped      = 0;  // pairs dropped (--moe-substitute drop, --moe-mode fast, --moe-capacity)

    vis_moe_counters operator-(const vis_moe_counters & o) const {
        vis_moe_counters r;
#define VIS_SUB(f) r.f = f - o.f;
        VIS_COUNTER_FIELDS(VIS_SUB)
#undef VIS_SUB
        return r;
    }
    vis_moe_counters & operator+=(const vis_moe_counters & o) {
#define VIS_ADD(f) f += o.f;
        VIS_COUNTER_FIELDS(VIS_ADD)
#undef VIS_ADD
        return *this;
    }
};

// one ubatch as the CSV row and the status line see it
struct vis_moe_step {
    double  t_ms     = 0;      // since the context was created, at the end of the ubatch
    double  wall_ms  = 0;      // the ubatch: from vis_moe_begin_ubatch to vis_moe_end_ubatch
    int64_t n_tokens = 0;
    bool    decode   = false;  // every sequence of the ubatch has one token (a generated token each)
    vis_moe_counters d;        // what the counters moved by during the ubatch
};

// what one context's ubatches moved the counters by, and its tokens: what it publishes to /metrics
struct vis_moe_published {
    vis_moe_counters c;
    int64_t prompt_tokens = 0, decode_tokens = 0, ubatches = 0;
    double  busy_s = 0;  // wall time of its ubatches
};
