// vis-moe-fetch-slots.cpp - background reads into a layer's slots: submit, collect (vis-moe-fetch-slots.h).
#include "vis-moe-fetch-slots.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-passes.h"
#include "vis-moe-transfer.h"

#include <string>

vis_fetch_result vis_moe_fetch_submit(vis_moe_context & vm, vis_moe_layer & L, int il, int e, bool speculative) {
    const int s = L.slots.policy().victim();
    if (s < 0) {
        return VIS_FETCH_NO_SLOT;
    }
    const vis_slot_class c = L.slots.policy().slot_class(s);
    if (c == vis_slot_class::REQUIRED || (speculative && c == vis_slot_class::SPECULATIVE)) {
        return VIS_FETCH_NO_SLOT;
    }
    vis_moe_evict_slot(vm, L, il, s);
    std::unique_ptr<vis_fetch_job> job = vis_moe_fetch_job(vm, L, il, e, s);
    if (!job) {  // served from the host cache (or the model's copy) on the spot
        L.slots.place(e, s);
        if (speculative) {
            L.slots.policy().speculate(s, 1);
        } else {
            L.slots.policy().touch(s, e);
        }
        return VIS_FETCH_SERVED;
    }
    job->speculative = speculative;
    L.slots.reserve(e, s);  // no id points at the slot until it is collected
    vm.fetch->submit(std::move(job));
    return VIS_FETCH_QUEUED;
}

std::vector<vis_fetch_done> vis_moe_fetch_collect(vis_moe_context & vm, vis_moe_layer & L, int il, int64_t & waited_us) {
    waited_us = 0;
    std::vector<vis_fetch_done> done;
    if (!vm.fetch || vm.fetch->pending(il) == 0) {
        return done;
    }
    for (const auto & job : vm.fetch->cancel_queued(il)) {
        L.slots.release(job->slot);
        done.push_back({ job->expert, job->slot, true, true });
    }
    auto jobs = vm.fetch->collect(il, waited_us);
    L.stats.load_us += waited_us;  // a late background read is a (partial) stall
    std::string error;  // the first failure, thrown once every job has released its slot
    for (const auto & job : jobs) {
        if (!job->error.empty()) {
            L.slots.release(job->slot);
            error = error.empty() ? job->error : error;
            continue;
        }
        vis_moe_fetch_finish(L, *job);  // waits for this job's upload only (discrete GPU)
        L.slots.settle(job->slot);
        if (job->speculative) {
            L.slots.policy().speculate(job->slot, 1);  // protected through this step; first to go if it is not used
        } else {
            L.slots.policy().touch(job->slot, job->expert);
        }
        done.push_back({ job->expert, job->slot, job->speculative, false });
    }
    if (!error.empty()) {
        throw vis_io_error("background expert read failed: " + error +
                           " (check the disk and the model file; re-download or regenerate a damaged GGUF)");
    }
    return done;
}
