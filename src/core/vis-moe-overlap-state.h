// vis-moe-overlap-state.h - what a managed layer keeps of reads overlapped with compute in decode (VIS_MOE_OVERLAP):
// the reads under way and the stats.  The mechanism is vis-moe-overlap.h; the layer (vis-moe-context.h) holds this.
#pragma once

#include "llama-vis.h"

#include <cstdint>
#include <vector>

// one miss of an overlapped ubatch, issued and not yet waited for
struct vis_overlap_read {
    int32_t  expert = -1;
    int32_t  slot   = -1;
    uint64_t ticket = 0;  // the I/O pool's ticket of its reads; 0: served from memory when issued
    int64_t  issued_us = 0;
};

// one miss of a pipelined prefill ubatch (vis-moe-pipeline.h): its expert, its slot, the pass that runs it and the
// pass whose op may start its read (the one after the last pass that ran from that slot)
struct vis_pipeline_read {
    int32_t  expert   = -1;
    int32_t  slot     = -1;
    int32_t  pass     = 0;
    int32_t  issue_at = 0;
    int32_t  evicted  = -1;  // the expert the slot held before: it moves down to tier 2 when the read starts
    bool     issued   = false;
    uint64_t ticket   = 0;  // the I/O pool's ticket; 0: served from memory, or not issued yet
};

// a managed layer's pipelined prefill ubatch: the slot each of its experts runs from, the misses' reads
struct vis_pipeline_layer {
    bool active = false;                  // the running ubatch is pipelined
    std::vector<int32_t> slot_of;         // [n_expert] the slot an expert of the ubatch runs from, -1 none
    std::vector<vis_pipeline_read> reads; // in pass order; erased once waited for
    bool paused_fetch = false;            // the background reader is paused while they are under way
};

// a managed layer's overlap state
struct vis_overlap_layer {
    std::vector<vis_overlap_read> reads;  // issued, not waited for
    bool    paused_fetch = false;         // the background reader is paused while they are under way
    int64_t pass0_end_us = 0;             // when the running ubatch's pass 0 op returned (its hits compute next)
    // the running ubatch's reads as one window (they are queued at once and read in order): its first issue, the
    // end of the last read taken, and the time its miss passes waited inside it
    int64_t window_from_us = 0, window_done_us = 0, window_waited_us = 0;
    llama_vis_moe_overlap_stats stats = {};  // decode's and the pipelined prefill's (the n_prefill_* fields)
    vis_pipeline_layer pipeline;
};
