// vis-moe-apply.cpp - vis_moe_context::apply: the one place a ubatch plan (vis-moe-ubatch-plan.h) changes the
// cache, as upstream's llama-memory apply() is for the KV cache.  The planners (vis-moe-feature.h) only read the
// context and write the plan; this takes it: the layer runs it, pass 0's experts are loaded into the slot pool and
// the background reads start, in the plan's order.  limit_slots is the other mutator: the online controller's slot
// limit (vis-moe-online.h).
#include "vis-moe-context.h"
#include "vis-moe-fetch-slots.h"
#include "vis-moe-overlap.h"
#include "vis-moe-passes.h"
#include "vis-pages.h"

#include <stdexcept>
#include <string>
#include <utility>

void vis_moe_context::apply_reads(int il, std::vector<vis_plan_read> & reads) {
    // in order: a kind whose read found no slot tries none of its kind after it (every slot serves this pass, or
    // a read ahead would evict a protected one); if_missing: skipped when the expert is resident by its turn
    vis_moe_layer & L = layers[il];
    int full = -1;  // the kind that found no slot
    std::vector<int> held;  // reads ahead: slots of resident predicted experts, kept from the later reads' victims
    for (vis_plan_read & r : reads) {
        if ((int) r.why == full) {
            r.done = VIS_READ_NOT_ISSUED;
            continue;
        }
        const bool ahead = r.why == VIS_READ_AHEAD;
        const int  s     = r.if_missing ? L.slots.slot_of(r.expert) : -1;
        if (s >= 0) {
            if (ahead && L.slots.policy().slot_class(s) != vis_slot_class::REQUIRED) {
                L.slots.policy().hold(s, true);
                held.push_back(s);
            }
            r.done = VIS_READ_RESIDENT;
            continue;
        }
        if (ahead && L.slots.filling(r.expert)) {
            r.done = VIS_READ_FILLING;
            continue;
        }
        switch (vis_moe_fetch_submit(*this, L, il, r.expert, ahead)) {
            case VIS_FETCH_NO_SLOT: r.done = VIS_READ_NO_SLOT; full = (int) r.why; break;
            case VIS_FETCH_SERVED:  r.done = VIS_READ_SERVED; break;
            case VIS_FETCH_QUEUED:  r.done = VIS_READ_QUEUED; break;
        }
    }
    for (int s : held) {
        L.slots.policy().hold(s, false);
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
    vis_moe_overlap_issue(*this, L, il);  // the misses' reads start before the hits compute (vis-moe-overlap.h)
    apply_reads(il, L.ubatch_plan.reads);
}

int64_t vis_moe_context::limit_slots(int il, int n) {
    vis_moe_layer & L = layers[il];
    if (n == L.slots.n_active()) {
        return 0;
    }
    if (n < L.slots.n_active()) {
        int64_t waited = 0;
        vis_moe_fetch_collect(*this, L, il, waited);  // nothing may be written into a slot whose pages go
    }
    int64_t dropped = 0;
    for (int s : L.slots.limit(n)) {
        dropped += drop_slot_pages(il, s);
    }
    graph_epoch++;  // the graphs' pass counts were planned at the old limit
    return dropped;
}

int64_t vis_moe_context::drop_slot_pages(int il, int s) {
    int64_t dropped = 0;
    for (ggml_tensor * t : layers[il].slab) {
        if (t && t->data && ggml_backend_buffer_is_host(t->buffer)) {
            dropped += vis_release_pages((uint8_t *) t->data + (size_t) s * t->nb[2], t->nb[2], false, false);
        }
    }
    return dropped;
}
