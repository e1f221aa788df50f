// vis-moe-online.h - the online controller (issue #24 item 3, VIS_MOE_ONLINE=on; docs/planning.md#online-controller):
// as a server's load changes (contexts grow, slots fill and empty), bytes move between the KV cache and the expert
// slots within the --moe-mem budget (src/features/vis-moe-online.cpp).
//
// The memory plan at start prices the KV cache at the admission floor (one sequence of the asked context) instead of
// the whole context x parallel, and the slabs are made for the slots that floor leaves (max_slots).  The KV cache's
// pages are resident only where its cells are used (vis-moe-kv-pages.h), and the slots a pass may use are limited
// (vis_slot_pool::limit): at the end of every ubatch
//     slots = (budget - fixed - KV resident - the next ubatch's KV) / bytes of one slot row,
// clamped to [min_slots, max_slots].  min_slots is what the plan gives with the whole KV cache resident (today's
// plan, so every request the server admits still fits); fixed is everything else the plan holds (resident weights,
// compute, encoder, host cache).  A shrink is applied at once (the budget is at stake); a growth waits until the
// target has stayed at least one step higher for GROW_AFTER ubatches (hysteresis).  A slot above the limit is
// emptied and its pages dropped (vis-pages.h); below it, a slot refills on demand like any miss.
//
// Exactness.  The limit changes only between ubatches; the passes are planned in chunks of the limit, and a graph
// built at other limits is not reused (vis_moe_graph_epoch, patch 0016), so each expert still sees exactly the rows
// it sees upstream (vis-moe-passes.h).  What is computed never changes, only what is resident.
#pragma once

#include "vis-moe-feature.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

struct llama_context;
struct vis_moe_context;

class vis_moe_online : public vis_moe_feature {
public:
    // what the plan decided (vis-moe-attach.cpp): the budget, what it holds besides the KV cache and the slabs,
    // the slots at the whole KV cache (min) and at its floor (max, the slabs' size)
    struct plan {
        int64_t budget = 0, fixed = 0, row_bytes = 0;
        int     min_slots = 1, max_slots = 1;
        int64_t n_ubatch = 512;
    };
    vis_moe_online(const llama_context * lctx, const plan & p) : lctx(lctx), p(p) {}

    static constexpr int GROW_AFTER = 4;  // ubatches a higher target must hold before the slots grow

    const char * feature_name() const override { return "online"; }
    void ubatch_end(vis_moe_context & vm) override;
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override { n_shrink = n_grow = n_recount = recount_us = 0; }
    // what the budget leaves next to the active slots and the KV cache with the next ubatch's cells (at the last
    // ubatch end): a staged ubatch may write that much above the limits (vis-moe-stage.h)
    int64_t staging_room(const vis_moe_context & vm) const override { (void) vm; return room; }

    // the limit of every managed layer set to `slots` (per-layer splits scaled), the emptied slots' pages dropped
    void resize(vis_moe_context & vm, int slots, const std::string & why);
    // the slots the budget leaves next to a KV cache of kv_bytes (clamped to [min_slots, max_slots])
    int target(int64_t kv_bytes) const;
    // the spare bytes next to `active` slots and a KV cache of kv_bytes (staging_room)
    void set_room(int64_t kv_bytes) { room = std::max<int64_t>(0, p.budget - p.fixed - kv_bytes - (int64_t) active * p.row_bytes); }

    int active = 0;  // the slots per layer now (the limit of a layer with max_slots)
    int     lo = 0, hi = 0;   // the fewest and most slots per layer used
    int64_t kv_last   = 0;    // KV bytes resident at the last resize

private:
    const llama_context * lctx;
    plan    p;
    int     grow_wait = 0;    // ubatches the target has stayed above `active`
    int64_t room      = 0;    // staging_room
    int64_t n_shrink = 0, n_grow = 0;
    int64_t n_recount = 0, recount_us = 0;  // ubatch ends, and the microseconds their KV recount took (--moe-stats)
};

// at attach, after the slabs: the controller of a context whose plan priced the KV cache at its floor (throws where
// it cannot work: no --moe-mem plan, a GPU, a lossy feature that bounds passes, a KV cache that is not plain)
void vis_moe_online_attach(vis_moe_context & vm, const llama_context * lctx, const vis_moe_online::plan & p);
