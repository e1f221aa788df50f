// vis-moe-apply.cpp - vis_moe_context::apply: the one place a ubatch plan (vis-moe-ubatch-plan.h) changes the
// cache, as upstream's llama-memory apply() is for the KV cache.  The planners (vis-moe-feature.h) only read the
// context and write the plan; this takes it: the layer runs it, pass 0's experts are loaded into the slot pool and
// the background reads start, in the plan's order.
#include "vis-moe-context.h"
#include "vis-moe-fetch-slots.h"
#include "vis-moe-passes.h"

#include <stdexcept>
#include <string>
#include <utility>

// the plan's background reads, in order: a kind whose read found no slot tries none of its kind after it (every
// slot serves this pass); a read marked if_missing is skipped when the expert is resident by its turn
static void start_reads(vis_moe_context & vm, vis_moe_layer & L, int il, vis_ubatch_plan & plan) {
    int full = -1;  // the kind that found no slot
    for (vis_plan_read & r : plan.reads) {
        if ((int) r.why == full) {
            r.done = VIS_READ_NOT_ISSUED;
            continue;
        }
        if (r.if_missing && L.slots.resident(r.expert)) {
            r.done = VIS_READ_RESIDENT;
            continue;
        }
        switch (vis_moe_fetch_submit(vm, L, il, r.expert, false)) {
            case VIS_FETCH_NO_SLOT: r.done = VIS_READ_NO_SLOT; full = (int) r.why; break;
            case VIS_FETCH_SERVED:  r.done = VIS_READ_SERVED; break;
            case VIS_FETCH_QUEUED:  r.done = VIS_READ_QUEUED; break;
        }
    }
}

void vis_moe_context::apply(int il, vis_ubatch_plan & plan, const int32_t * routed, int32_t * out) {
    vis_moe_layer & L = layers[il];
    std::swap(L.ubatch_plan, plan);  // the ops of the layer's passes read it; `plan` keeps the old one's buffers
    const vis_ubatch_plan & p = L.ubatch_plan;
    L.stats.n_calls++;
    if ((int) p.passes.size() > vis_moe_full_passes(*this, L, p.n_pairs, ub_image) ||
        (int) p.shadow_passes.size() > vis_moe_shadow_passes(*this, L, p.n_pairs, ub_image)) {
        throw std::runtime_error("vis-moe: layer " + std::to_string(il) + " planned " + std::to_string(p.passes.size()) +
                                 " + " + std::to_string(p.shadow_passes.size()) + " passes, more than its graph has "
                                 "(plan bug): the ubatch is not computed");
    }
    vis_moe_run_pass(*this, L, il, 0, p.run_ids(routed), p.n_pairs, out);
    start_reads(*this, L, il, L.ubatch_plan);
}
