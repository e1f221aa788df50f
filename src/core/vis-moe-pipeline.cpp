// vis-moe-pipeline.cpp - prefill passes pipelined (vis-moe-pipeline.h).
#include "vis-moe-pipeline.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-overlap.h"
#include "vis-moe-passes.h"
#include "vis-moe-transfer.h"

#include <algorithm>
#include <chrono>

void vis_moe_plan_pipeline(const vis_moe_context & vm, const vis_moe_layer & L, vis_ubatch_plan & plan, bool image) {
    // the graph's passes left over by the plain split let that many passes run in halves; none left: nothing to gain
    if ((int) plan.passes.size() >= vis_moe_pipeline_passes(vm, L, plan.n_pairs, image) || plan.sub_active ||
        !plan.reads.empty() || !plan.shadow_passes.empty() || plan.overlap_first > 0 || plan.passes.empty()) {
        return;
    }
    for (const auto & pass : plan.passes) {
        for (int e : pass) {
            if (!L.slots.resident(e)) {
                plan.pipelined = true;  // a miss to read
                return;
            }
        }
    }
}

// resume the background reader once no read of the ubatch is under way
static void resume_fetch(vis_moe_context & vm, vis_pipeline_layer & pl) {
    if (pl.paused_fetch && std::none_of(pl.reads.begin(), pl.reads.end(), [](const vis_pipeline_read & r) {
            return r.issued && r.ticket != 0;
        })) {
        pl.paused_fetch = false;
        if (vm.fetch) {
            vm.fetch->demand_end();
        }
    }
}

// start the reads that op p may start (their slot's last half before them has computed), in pass order
static void issue(vis_moe_context & vm, vis_moe_layer & L, int il, int p) {
    vis_pipeline_layer & pl = L.overlap.pipeline;
    std::vector<vis_read_req> reqs;
    for (vis_pipeline_read & r : pl.reads) {
        if (r.issued || r.issue_at > p) {
            continue;
        }
        r.issued = true;
        vis_moe_keep_evicted(vm, L, il, r.slot, r.evicted);  // its bytes are whole until now (its halves ran)
        if (vis_moe_serve_from_memory(vm, L, il, r.expert, r.slot, nullptr)) {
            continue;  // tier 2 or the model's copy: written now
        }
        if (!pl.paused_fetch) {
            L.any_file()->check_unchanged();  // never read from a file replaced under us
            if (vm.fetch) {
                vm.fetch->demand_begin();  // reads ahead wait: these are needed now
            }
            pl.paused_fetch = true;
        }
        vm.n_file_reads++;
        reqs.clear();
        vis_moe_slot_reqs(L, il, r.expert, r.slot, reqs);
        r.ticket = vm.io->submit(reqs);
        L.overlap.stats.n_prefill_reads++;
        L.overlap.stats.n_prefill_ahead += r.pass > p ? 1 : 0;
    }
}

// op p: start what may start, wait for pass p's reads, write its ids
static void run_half(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                     int32_t * out) {
    vis_pipeline_layer & pl = L.overlap.pipeline;
    const int64_t t0 = vis_moe_now_us();
    try {
        issue(vm, L, il, p);
        for (size_t i = 0; i < pl.reads.size();) {
            vis_pipeline_read & r = pl.reads[i];
            if (r.pass != p) {
                ++i;
                continue;
            }
            if (r.ticket != 0) {
                const int64_t from = vis_moe_now_us();
                const uint64_t t = r.ticket;
                r.ticket = 0;  // taken: a failure below leaves it to the slot emptying of finish
                r.issued = false;
                const auto done = vm.io->wait(t);
                const int64_t done_us =
                    std::chrono::duration_cast<std::chrono::microseconds>(done.time_since_epoch()).count();
                L.overlap.stats.n_prefill_ready += done_us <= from ? 1 : 0;
            }
            pl.reads.erase(pl.reads.begin() + (std::ptrdiff_t) i);
        }
        resume_fetch(vm, pl);
    } catch (...) {
        const int64_t us = vis_moe_now_us() - t0;
        L.overlap.stats.prefill_wait_us += us;
        L.stats.load_us += us;
        vis_moe_pipeline_finish(vm, L);
        throw;
    }
    const std::vector<int32_t> & pass_of = L.ubatch_plan.pass_of;
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = ids[j];
        out[j] = pass_of[e] == p ? pl.slot_of[e] : L.foreign_id();
    }
    const int64_t us = vis_moe_now_us() - t0;
    L.overlap.stats.prefill_wait_us += us;
    L.stats.load_us += us;  // the stall the layer still has
}

void vis_moe_pipeline_apply(vis_moe_context & vm, vis_moe_layer & L, int il, const int32_t * ids, int64_t n_pairs,
                            int32_t * out) {
    vis_ubatch_plan & plan = L.ubatch_plan;
    vis_pipeline_layer & pl = L.overlap.pipeline;
    pl.active = true;
    pl.slot_of.assign(L.n_expert, -1);
    pl.reads.clear();
    L.overlap.stats.n_prefill_ubatches++;
    // the passes the graph runs without pipelining (an empty one included), as the stats count them
    L.stats.n_passes += vis_moe_max_passes(L.n_expert, n_pairs, L.slots.n_active());
    // 1. the passes' decisions, pass after pass, exactly as vis_moe_run_pass takes them
    std::vector<uint8_t> miss(L.n_expert, 0);
    std::vector<int32_t> evicted(L.n_expert, -1);
    std::vector<vis_pass_miss> decided;
    for (const auto & pass : plan.passes) {
        decided.clear();
        vis_moe_decide_pass(L, pass, decided);
        for (int e : pass) {
            pl.slot_of[e] = L.slots.slot_of(e);  // a later pass may evict it: it still runs from here
        }
        // the expert evicted may still run from the slot in an earlier half, or not be read yet: its bytes are
        // whole only when the read into the slot starts, after that half; tier 2 (unified memory) takes them then
        for (const vis_pass_miss & m : decided) {
            evicted[m.expert] = m.evicted;
            miss[m.expert]    = 1;
        }
    }
    // 2. the first passes in two halves, as many as the graph's passes left over by the plain split allow (the
    //    others whole): hits first, then the misses whose slot's last user ran earliest
    const int n_split = vis_moe_pipeline_passes(vm, L, n_pairs, vm.ub_image) - (int) plan.passes.size();
    std::vector<int> last(L.slots.n_slots(), -1);  // the last half that ran from each slot
    std::vector<std::vector<int32_t>> halves;
    for (const auto & pass : plan.passes) {
        std::vector<int32_t> order;
        for (int e : pass) {
            if (!miss[e]) {
                order.push_back(e);
            }
        }
        const size_t n_hits = order.size();
        for (int e : pass) {
            if (miss[e]) {
                order.push_back(e);
            }
        }
        std::stable_sort(order.begin() + (std::ptrdiff_t) n_hits, order.end(),
                         [&](int a, int b) { return last[pl.slot_of[a]] < last[pl.slot_of[b]]; });
        const size_t half = (int) halves.size() < 2 * n_split ? (order.size() + 1) / 2 : order.size();
        for (int h = 0; h < 2; ++h) {
            const auto from = order.begin() + (std::ptrdiff_t) (h == 0 ? 0 : half);
            const auto to   = h == 0 ? order.begin() + (std::ptrdiff_t) half : order.end();
            if (from == to) {
                continue;
            }
            const int q = (int) halves.size();
            halves.emplace_back(from, to);
            for (auto it = from; it != to; ++it) {
                if (miss[*it]) {
                    pl.reads.push_back({ *it, pl.slot_of[*it], q, last[pl.slot_of[*it]] + 1, evicted[*it], false, 0 });
                }
            }
            for (auto it = from; it != to; ++it) {
                last[pl.slot_of[*it]] = q;
                plan.pass_of[*it]     = q;
            }
        }
    }
    plan.passes = std::move(halves);
    std::stable_sort(pl.reads.begin(), pl.reads.end(),
                     [](const vis_pipeline_read & a, const vis_pipeline_read & b) { return a.pass < b.pass; });
    // 3. pass 0: its reads and those that may start now
    run_half(vm, L, il, 0, ids, n_pairs, out);
}

void vis_moe_pipeline_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                           int32_t * out) {
    run_half(vm, L, il, p, ids, n_pairs, out);
    if (L.overlap.pipeline.reads.empty()) {
        L.overlap.pipeline.active = false;
    }
}

void vis_moe_pipeline_finish(vis_moe_context & vm, vis_moe_layer & L) {
    vis_pipeline_layer & pl = L.overlap.pipeline;
    for (const vis_pipeline_read & r : pl.reads) {
        bool landed = r.issued;  // served from memory, or its read below succeeds
        if (r.issued && r.ticket != 0) {
            try {
                vm.io->wait(r.ticket);
            } catch (...) {
                landed = false;  // the ubatch whose read this was failed already
            }
        }
        if (!landed && L.slots.expert_of(r.slot) == r.expert) {
            L.slots.evict(r.slot);  // never leave a slot marked as holding an expert it does not hold
        }
    }
    pl.reads.clear();
    pl.active = false;
    resume_fetch(vm, pl);
}
