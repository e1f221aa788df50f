// vis-moe-overlap.cpp - reads overlapped with compute in decode (vis-moe-overlap.h).
#include "vis-moe-overlap.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-passes.h"
#include "vis-moe-transfer.h"

#include <algorithm>
#include <chrono>

int64_t vis_moe_now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

static int64_t us_of(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

void vis_moe_plan_overlap(const vis_moe_context & vm, const vis_moe_layer & L, vis_ubatch_plan & plan, bool image) {
    const int g = vis_moe_overlap_passes(vm, L, plan.n_pairs, image);
    if (g <= 0) {
        return;
    }
    plan.overlap_first = 1;  // the graph's passes 1..g are miss passes, empty ones included
    if (plan.passes.size() != 1) {
        return;  // every expert served from shadows: no full pass
    }
    std::vector<int32_t> & first = plan.passes[0];
    const auto miss0 = std::find_if(first.begin(), first.end(), [&](int32_t e) { return !L.slots.resident(e); });
    const std::vector<int32_t> misses(miss0, first.end());  // hits first, then misses (vis_moe_plan_passes)
    first.erase(miss0, first.end());
    const int m = (int) misses.size();
    const int n = std::min(g, m);
    size_t at = 0;
    for (int i = 0; i < n; ++i) {
        const size_t len = (size_t) (m / n + (i >= n - m % n ? 1 : 0));  // the later passes take the remainder
        plan.passes.emplace_back(misses.begin() + at, misses.begin() + at + len);
        for (size_t x = at; x < at + len; ++x) {
            plan.pass_of[misses[x]] = (int32_t) plan.passes.size() - 1;
        }
        at += len;
    }
}

void vis_moe_overlap_issue(vis_moe_context & vm, vis_moe_layer & L, int il) {
    const vis_ubatch_plan & plan = L.ubatch_plan;
    vis_overlap_layer & ov = L.overlap;
    if (plan.overlap_first <= 0) {
        return;
    }
    ov.stats.n_ubatches++;
    // as vis_moe_run_pass takes a pass's misses: each gets the policy's victim (pass 0's hits are Required), the
    // victim is evicted, the miss is touched; then they are filled from the tiers, in the same order
    const size_t first = ov.reads.size();
    for (size_t p = (size_t) plan.overlap_first; p < plan.passes.size(); ++p) {
        for (int e : plan.passes[p]) {
            const int s = L.slots.policy().victim();
            GGML_ASSERT(s >= 0 && "vis-moe: an overlapped miss found no slot (plan bug)");
            vis_moe_evict_slot(vm, L, il, s);
            L.slots.reserve(e, s);  // no id points at the slot until its pass settles it
            L.slots.policy().touch(s, e);
            L.stats.n_misses++;
            L.stats.n_routed++;
            L.stats.bytes_loaded += L.expert_bytes;
            ov.reads.push_back({ e, s, 0, 0 });
        }
    }
    bool checked = false;
    std::vector<vis_read_req> reqs;
    for (size_t i = first; i < ov.reads.size(); ++i) {
        vis_overlap_read & r = ov.reads[i];
        if (vis_moe_serve_from_memory(vm, L, il, r.expert, r.slot, nullptr)) {
            continue;  // resident at its pass, nothing to wait for
        }
        if (!checked) {
            L.any_file()->check_unchanged();  // never read from a file replaced under us
            checked = true;
            if (vm.fetch && !ov.paused_fetch) {
                vm.fetch->demand_begin();  // reads ahead wait: these are needed now
                ov.paused_fetch = true;
            }
        }
        vm.n_file_reads++;
        if (ov.window_from_us == 0) {
            ov.window_from_us = vis_moe_now_us();
        }
        reqs.clear();
        vis_moe_slot_reqs(L, il, r.expert, r.slot, reqs);
        r.ticket    = vm.io->submit(reqs);
        r.issued_us = vis_moe_now_us();
        ov.stats.n_reads++;
    }
}

// wait for read r (taken out of the layer's list); its slot settles, or is released when the read failed
static void take_read(vis_moe_context & vm, vis_moe_layer & L, size_t i, int64_t wait_from_us) {
    vis_overlap_layer & ov = L.overlap;
    const vis_overlap_read r = ov.reads[i];
    ov.reads.erase(ov.reads.begin() + (std::ptrdiff_t) i);
    auto resume_fetch = [&]() {
        if (ov.reads.empty() && ov.paused_fetch) {
            ov.paused_fetch = false;
            if (vm.fetch) {
                vm.fetch->demand_end();
            }
        }
    };
    if (r.ticket != 0) {
        try {
            ov.window_done_us = std::max(ov.window_done_us, us_of(vm.io->wait(r.ticket)));
            ov.stats.n_late += r.issued_us > ov.pass0_end_us ? 1 : 0;
            if (std::none_of(ov.reads.begin(), ov.reads.end(), [](const vis_overlap_read & x) { return x.ticket != 0; })) {
                // the window's last read: the layer computed inside it for all of it but what its passes waited
                ov.stats.hidden_us += std::max<int64_t>(0, std::min(ov.window_done_us, wait_from_us) -
                                                               ov.window_from_us - ov.window_waited_us);
                ov.window_from_us = ov.window_done_us = ov.window_waited_us = 0;
            }
        } catch (...) {
            L.slots.release(r.slot);  // never leave a slot marked as holding an expert it does not hold
            resume_fetch();
            throw;
        }
    }
    L.slots.settle(r.slot);
    resume_fetch();
}

void vis_moe_overlap_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                          int32_t * out) {
    (void) il;
    const int64_t t0 = vis_moe_now_us();
    const vis_ubatch_plan & plan = L.ubatch_plan;
    vis_overlap_layer & ov = L.overlap;
    ov.stats.n_passes++;
    auto add_wait = [&]() {
        const int64_t us = vis_moe_now_us() - t0;
        ov.stats.wait_us += us;
        if (ov.window_from_us != 0) {
            ov.window_waited_us += us;  // reads of the window still under way: this wait was inside it
        }
        L.stats.load_us += us;  // the stall the layer still has
    };
    try {
        if (p < (int) plan.passes.size()) {
            for (int e : plan.passes[p]) {
                for (size_t i = 0; i < ov.reads.size(); ++i) {
                    if (ov.reads[i].expert == e) {
                        take_read(vm, L, i, t0);
                        break;
                    }
                }
            }
        }
    } catch (...) {
        add_wait();
        throw;
    }
    vis_moe_pass_ids(L, p, ids, n_pairs, out);
    add_wait();
}

void vis_moe_overlap_finish(vis_moe_context & vm, vis_moe_layer & L) {
    while (!L.overlap.reads.empty()) {
        try {
            take_read(vm, L, 0, vis_moe_now_us());
        } catch (...) {
            // the ubatch whose read this was failed already: its slot is released, nothing more to say
        }
    }
}
