// vis-moe-prefetch-ab.h - whether reads ahead pay on this machine, measured: decode steps alternate between
// prefetch on and off in short epochs, and the faster setting runs for a while before the next probe
// (src/features/vis-moe-prefetch-ab.cpp; part of --moe-prefetch-tune, docs/prediction.md).
//
// Why: a read ahead saves at most the compute it overlaps, and a wasted one costs its bytes.  On a device where
// decode waits on storage (a slow disk, a fast CPU) even good predictions can lose; where compute and reads take
// similar time they win.  The per-layer waste rule (vis-moe-prefetch.h) cannot see that; the step time can.
//
// Schedule: probe = 4 epochs of EPOCH decode steps, on / off / on / off (the first step after a prompt is
// skipped: it pays for the prompt's evictions); then the setting with the lower median step time runs for RUN
// steps; off wins ties within MARGIN (prefetch must earn its place).  Prefill ubatches are not timed.
#pragma once

#include <cstdint>
#include <vector>

class vis_prefetch_ab {
public:
    static constexpr int    EPOCH  = 8;
    static constexpr int    RUN    = 128;
    static constexpr double MARGIN = 0.97;  // on must be at least 3 % faster

    // reads ahead are issued in this step
    bool on() const { return cur_on; }

    // a ubatch starts / ended after `us` microseconds (decode: every sequence has one token)
    void begin(bool decode);
    void end(int64_t us);

    struct result {
        int64_t median_on_us  = 0;  // of the last probe
        int64_t median_off_us = 0;
        int32_t probes        = 0;  // probes decided so far
        int32_t chose_on      = 0;  // ... in favour of prefetch
        int32_t running_on    = 1;  // the setting in force now (1 while probing)
    };
    const result & last() const { return res; }

private:
    enum phase { PROBE, RUN_PHASE };
    phase   ph       = PROBE;
    int     step_in  = 0;      // decode steps into the phase
    bool    cur_on   = true;
    bool    decode   = false;
    bool    skip     = true;   // the next decode step follows a prompt: not timed
    std::vector<int64_t> t_on, t_off;
    result  res;

    void decide();
};
