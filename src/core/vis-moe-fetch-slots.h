// vis-moe-fetch-slots.h - background reads into a layer's slots (the reader itself: vis-moe-fetch.h).
//
// The planner picks the slot (a victim no pair of the running ubatch uses), holds it in the slot pool while the
// read is in flight, and the layer's next ubatch collects the layer's reads (waiting for any still in flight)
// before it plans.  Used by substitution, the precision refetch, prefetch and slab lending.
#pragma once

#include <cstdint>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;

// what vis_moe_fetch_collect did with one background read of the layer
struct vis_fetch_done {
    int  expert;
    int  slot;
    bool speculative;
    bool cancelled;   // speculative and not started: its slot was released, nothing was read
};

// Read expert e of layer il in the background into the policy's victim slot (evicted first), held until
// collected: VIS_FETCH_QUEUED.  A read the host cache or the model's copy can serve is done on the spot:
// VIS_FETCH_SERVED.  VIS_FETCH_NO_SLOT when every slot is Required (the running pass uses them all) or, for
// speculative reads, when the victim is Speculative (a prediction never evicts a protected one).  Compute thread.
enum vis_fetch_result { VIS_FETCH_NO_SLOT = 0, VIS_FETCH_SERVED, VIS_FETCH_QUEUED };
vis_fetch_result vis_moe_fetch_submit(vis_moe_context & vm, vis_moe_layer & L, int il, int e, bool speculative);

// Before layer il plans its ubatch: speculative reads not started are dropped (their slots released); the others are
// waited for (the wait counts as the layer's stall) and their slots become resident.  Throws vis_io_error after
// releasing every slot when a read failed.  waited_us: how long it waited.  Compute thread.
std::vector<vis_fetch_done> vis_moe_fetch_collect(vis_moe_context & vm, vis_moe_layer & L, int il, int64_t & waited_us);

