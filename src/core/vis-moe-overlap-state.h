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

// a managed layer's overlap state
struct vis_overlap_layer {
    std::vector<vis_overlap_read> reads;  // issued, not waited for
    bool    paused_fetch = false;         // the background reader is paused while they are under way
    int64_t pass0_end_us = 0;             // when the running ubatch's pass 0 op returned (its hits compute next)
    // the running ubatch's reads as one window (they are queued at once and read in order): its first issue, the
    // end of the last read taken, and the time its miss passes waited inside it
    int64_t window_from_us = 0, window_done_us = 0, window_waited_us = 0;
    llama_vis_moe_overlap_stats stats = {};
};
