// vis-moe-ubatch-plan.h - the ubatch plan of a managed layer (issue #23 item 2): what pass 0 decided for the
// ubatch, as a value.  ("The plan" alone is the --moe-mem memory plan, vis-moe-attach-plan.h; this is the
// ubatch plan.)
//
// Pass 0 (vis-moe-ops.cpp) turns the router's output into a ubatch plan by running the features' planning chain
// (vis-moe-feature.h) on a const context and layer: which expert each pair runs and why (route: substitution,
// capacity), which misses run from shadow slots (serve: precision), the passes (the core's split), and the reads
// to start in the background once pass 0 is loaded (stand-ins' experts, precision's refetch).  Then the context's
// apply() (vis-moe-apply.cpp) is the one place that makes it happen: the layer takes the plan (the ops of its other
// passes read it), pass 0's experts are loaded into the slot pool and the background reads are started; the
// features count what was started in plan_applied.  Prefetch's predict op, after pass 0, lists the reads ahead of
// a later layer the same way (vis_plan_read, VIS_READ_AHEAD) for the context's apply_reads.  The same buffers serve every ubatch: the context's scratch plan
// and the layer's applied one are swapped, never reallocated once grown.
#pragma once

#include <cstdint>
#include <vector>

// who wants a background read (its feature counts the reads that were started, vis_moe_feature::plan_applied)
enum vis_read_why : uint8_t {
    VIS_READ_STAND_IN = 0,  // the expert every pair of which runs a stand-in (substitution)
    VIS_READ_REFETCH  = 1,  // the full-precision expert of a miss served from its shadow (precision)
    VIS_READ_AHEAD    = 2,  // a predicted expert of a later layer (prefetch, vis_moe_context::apply_reads):
                            // speculative; a resident one is held from the victims of the reads after it, one
                            // on its way already is skipped
};

// what apply() did with a background read
enum vis_read_done : uint8_t {
    VIS_READ_NOT_ISSUED = 0,  // an earlier read of the same kind found no slot: none of its kind after it is tried
    VIS_READ_NO_SLOT,         // every slot serves this pass (vis_moe_fetch_submit's VIS_FETCH_NO_SLOT)
    VIS_READ_SERVED,          // served on the spot (host cache, model's copy)
    VIS_READ_QUEUED,          // a background read, collected by the layer's next pass 0
    VIS_READ_RESIDENT,        // if_missing and the expert was resident when its turn came: nothing to read
    VIS_READ_FILLING,         // a read ahead whose expert was on its way already
};

// one background read of a ubatch plan (or of a list of reads ahead), in issue order
struct vis_plan_read {
    int32_t       expert     = -1;
    vis_read_why  why        = VIS_READ_STAND_IN;
    bool          if_missing = false;  // skipped when the expert is resident by the time it is issued
    vis_read_done done       = VIS_READ_NOT_ISSUED;  // written by apply()
};

struct vis_ubatch_plan {
    int64_t n_pairs = 0;  // (token, expert) pairs of the ubatch: n_tokens * k
    int64_t n_used  = 1;  // k: the pairs of one token (a row of the ids)

    // route: the expert each pair runs and why (substitution, capacity); without sub_active the routed ids
    bool                 sub_active = false;
    std::vector<int32_t> exec;     // [n_pairs]
    std::vector<uint8_t> outcome;  // [n_pairs] llama_vis_sub_outcome (the trace's SUB1)

    // serve: expert -> 1 when its pairs run from its shadow (precision; sized n_expert when the layer has shadows)
    std::vector<uint8_t> shadow_serve;

    // the passes: expert -> graph pass (-1 not run), full-precision passes, then the shadow passes
    std::vector<int32_t>              pass_of;
    std::vector<std::vector<int32_t>> passes;
    std::vector<std::vector<int32_t>> shadow_passes;
    int                               shadow_first_pass = 0;  // graph index of shadow pass 0
    // overlap (vis-moe-overlap.h): the first miss pass, whose misses are read while pass 0's hits compute (0: none)
    int                               overlap_first = 0;

    // the reads to start in the background once pass 0 is loaded
    std::vector<vis_plan_read> reads;

    // a new ubatch of n pairs, k per token: the routed ids, no reads (the buffers keep their capacity)
    void begin(int64_t n, int64_t k) {
        n_pairs    = n;
        n_used     = k;
        sub_active = false;
        overlap_first = 0;
        reads.clear();
    }
    // the ids the passes use: exec with stand-ins, else the routed ids
    const int32_t * run_ids(const int32_t * routed) const { return sub_active ? exec.data() : routed; }
    void read(int32_t e, vis_read_why why, bool if_missing) { reads.push_back({ e, why, if_missing, VIS_READ_NOT_ISSUED }); }
};
