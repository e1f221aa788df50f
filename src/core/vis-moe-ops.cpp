// vis-moe-ops.cpp - CPU custom ops of a managed layer's graph (vis-moe-ops.h).
#include "vis-moe-ops.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-fetch-slots.h"
#include "vis-moe-overlap.h"
#include "vis-moe-passes.h"
#include "vis-moe-precision.h"
#include "vis-moe-shadow-slots.h"
#include "vis-pages.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

// what an ids op (one thread) works on: its context and layer, the routed ids in, the ids out
struct ids_op {
    vis_moe_op_ud &   ud;
    vis_moe_context & vm;
    vis_moe_layer &   L;
    int64_t           n_pairs;
    const int32_t *   ids;
    int32_t *         out;

    ids_op(ggml_tensor * dst, const ggml_tensor * ids_t, void * userdata)
        : ud(*(vis_moe_op_ud *) userdata), vm(*ud.vm), L(vm.layers[ud.il]), n_pairs(ggml_nelements(ids_t)),
          ids((const int32_t *) ids_t->data), out((int32_t *) dst->data) {}
};

// run `body`; on failure record it and fill dst with `fallback(j)` so the graph continues on finite data
template <typename Body, typename Fallback>
static void guarded(vis_moe_context & vm, int32_t * out, int64_t n_pairs, Body body, Fallback fallback) {
    try {
        body();
    } catch (const std::exception & e) {
        vm.fail(e.what());
        for (int64_t j = 0; j < n_pairs; ++j) {
            out[j] = fallback(j);
        }
    }
}

// pass 0 of a managed layer (dep = the gate weights): make the ubatch plan (vis-moe-ubatch-plan.h) through the
// features' planning chain (vis-moe-feature.h) and the core's split into passes, then apply it (the one mutator:
// pass 0 loaded, background reads started) and tell the features what was started
static void plan_ubatch(ids_op & a, const ggml_tensor * ids_t, const ggml_tensor * dep, const ggml_tensor * scores) {
    vis_moe_context & vm = a.vm;
    const vis_moe_context & cvm = vm;  // the planners read the context and the layer, and write the plan
    const vis_moe_layer & L = a.L;
    const int il = a.ud.il;
    for (auto & f : vm.features) {
        f->observe_routing(cvm, il, ids_t, dep);  // pass 0 depends on the router weights
    }
    vis_moe_overlap_finish(vm, a.L);  // an earlier ubatch's overlapped reads whose passes did not run
    int64_t waited = 0;  // the layer's background reads (substitution, reads ahead): cancelled, waited for, resident
    const std::vector<vis_fetch_done> done = vis_moe_fetch_collect(vm, a.L, il, waited);
    for (auto & f : vm.features) {
        f->plan_collected(cvm, L, il, done, waited, a.ids, a.n_pairs);
    }
    vis_ubatch_plan & plan = vm.planning;
    plan.begin(a.n_pairs, ids_t->ne[0]);  // the routed ids, unless a planner picks others
    for (auto & f : vm.features) {
        f->plan_route(cvm, L, il, plan, ids_t, dep, scores);  // stand-ins, then image pairs over capacity rerouted
    }
    for (auto & f : vm.features) {
        f->plan_routed(cvm, L, il, plan, ids_t);  // the experts the passes run (the trace's SUB1, after the REC1)
    }
    for (auto & f : vm.features) {
        f->plan_serve(cvm, L, il, plan, ids_t, dep);  // which misses run from shadows (plan.shadow_serve)
    }
    vis_moe_plan_passes(L, plan, plan.run_ids(a.ids), a.n_pairs);
    vis_shadow_plan(L, plan, vis_moe_full_passes(vm, L, a.n_pairs, vm.ub_image));  // numbered as the graph counts
    for (auto & f : vm.features) {
        f->plan_reads(cvm, L, il, plan);  // stand-ins' experts, precision's refetch
    }
    vis_moe_plan_overlap(cvm, L, plan, vm.ub_image);  // a one-pass ubatch: the hits, then the miss passes
    vm.apply(il, plan, a.ids, a.out);
    for (auto & f : vm.features) {
        f->plan_applied(cvm, L, il, L.ubatch_plan);
    }
    a.L.overlap.pass0_end_us = vis_moe_now_us();  // the hits' mul_mat_id run next
}

// pass p of a managed layer; pass 0 also plans the ubatch
static void pass_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * dep, const ggml_tensor * scores,
                    void * userdata) {
    ids_op a(dst, ids_t, userdata);
    guarded(a.vm, a.out, a.n_pairs, [&]() {
        if (a.ud.pass == 0) {
            plan_ubatch(a, ids_t, dep, scores);
            return;
        }
        if (a.L.ubatch_plan.overlap_first > 0 && a.ud.pass >= a.L.ubatch_plan.overlap_first) {
            vis_moe_overlap_pass(a.vm, a.L, a.ud.il, a.ud.pass, a.L.run_ids(a.ids), a.n_pairs, a.out);
            return;
        }
        vis_moe_run_pass(a.vm, a.L, a.ud.il, a.ud.pass, a.L.run_ids(a.ids), a.n_pairs, a.out);
    }, [&](int64_t j) { return a.L.cpu_passes ? -1 : (int32_t) (j % ids_t->ne[0]); });  // distinct in a row
}

void vis_moe_pass_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * dep, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        pass_op(dst, ids_t, dep, nullptr, userdata);
    }
}

void vis_moe_pass0_scored_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * weights,
                             const ggml_tensor * scores, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        pass_op(dst, ids_t, weights, scores, userdata);
    }
}

void vis_moe_shadow_pass_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * dep, int ith, int nth,
                            void * userdata) {
    (void) dep;
    (void) nth;
    if (ith != 0) {
        return;
    }
    ids_op a(dst, ids_t, userdata);
    guarded(a.vm, a.out, a.n_pairs, [&]() {
        vis_shadow_run_pass(a.vm, a.L, a.ud.il, a.ud.pass, a.L.run_ids(a.ids), a.n_pairs, a.out,
                            a.vm.precision->stats(a.ud.il));
    }, [&](int64_t j) { return a.L.cpu_passes ? -1 : (int32_t) (j % ids_t->ne[0]); });  // distinct in a row
}

void vis_moe_select_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * dep, int ith, int nth, void * userdata) {
    (void) dep;
    (void) nth;
    if (ith != 0) {
        return;
    }
    ids_op a(dst, ids_t, userdata);
    const int32_t * ids = a.L.run_ids(a.ids);
    for (int64_t j = 0; j < a.n_pairs; ++j) {
        a.out[j] = (int32_t) (a.L.ubatch_plan.pass_of[ids[j]] * a.n_pairs + j);
    }
}

void vis_moe_trace_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * weights, int ith, int nth,
                      void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    ids_op a(dst, ids_t, userdata);
    for (auto & f : a.vm.features) {
        f->observe_routing(a.vm, a.ud.il, ids_t, weights);
    }
    std::memcpy(a.out, a.ids, a.n_pairs * sizeof(int32_t));
}

// The page cache's room for a layer streamed through the mapping: the --moe-mem budget less what the process holds
// now (VmRSS: the slabs' pages a lending ubatch released are out of it, the compute buffer's written pages in) and a
// margin for the kernel; unbounded without a plan.  Where RSS cannot be read: the least spare bytes the features
// leave next to the slabs (staging_room)
static constexpr int64_t STREAM_ROOM_MARGIN = 16ll << 20;  // the kernel's own slack under a cgroup limit

static int64_t stream_room(const vis_moe_context & vm) {
    if (vm.plan_budget <= 0) {
        return INT64_MAX;
    }
    const int64_t rss = vis_process_rss();
    if (rss >= 0) {
        return vm.plan_budget - rss - STREAM_ROOM_MARGIN;
    }
    int64_t spare = INT64_MAX;
    for (const auto & f : vm.features) {
        spare = std::min(spare, f->staging_room(vm));
    }
    return spare;
}

// Prefill streaming: the mapped expert tensors of layer L.  Before the layer, where the routed experts fit the page
// cache's room (stream_room): the kernel reads exactly their slices (WILLNEED, in file order, adjacent experts
// merged), and the ranges stay MADV_RANDOM (the loader marks lazy ranges so), so a fault reads no further than its
// page.  Else a sequential hint: every fault reads ahead the device's read_ahead_kb (8 MiB on the dev VM, twice that
// under MADV_SEQUENTIAL), experts the ubatch does not use included, but in large reads; exact reads of a set larger
// than the room would be dropped before their use and faulted back 4 KiB at a time.  Measured
// (docs/paging.md#prefill-streaming): 16 layers at 12.5 %, a 150-token prompt, 1.5x the sequential hint's prefill;
// 48 layers at 12.5 %, a 700-token prompt, the exact reads 0.4-0.5x (hence the rule).
// After the layer: drop the pages from our mapping and from the page cache, so the streamed experts cost no memory.
static void stream_advise(vis_moe_context & vm, const vis_moe_layer & L, bool before, const std::vector<int> & routed = {}) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    std::vector<int> order(routed);
    std::sort(order.begin(), order.end());
    const bool exact = before && (int64_t) order.size() * L.expert_bytes <= stream_room(vm);
    if (before) {
        (exact ? vm.n_stream_routed : vm.n_stream_seq)++;
    }
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        const vis_deferred_tensor * f = L.file[ti];
        if (!f || !L.orig[ti] || !L.orig[ti]->data) {
            continue;
        }
        const uintptr_t base = (uintptr_t) L.orig[ti]->data;
        const size_t    n    = f->nb2 * (size_t) f->n_expert;
        if (exact) {
            for (size_t i = 0; i < order.size();) {
                size_t j = i + 1;
                while (j < order.size() && order[j] == order[j - 1] + 1) {
                    ++j;  // adjacent experts: one range
                }
                const uintptr_t a0 = (base + (size_t) order[i] * f->nb2) & ~(uintptr_t) (page - 1);
                const uintptr_t a1 = (base + (size_t) (order[j - 1] + 1) * f->nb2 + page - 1) & ~(uintptr_t) (page - 1);
                madvise((void *) a0, a1 - a0, MADV_WILLNEED);  // a hint: its failure changes nothing
                i = j;
            }
            continue;
        }
        // pages wholly inside the tensor: a neighbouring tensor's pages are not ours to drop or re-advise
        const uintptr_t a0 = (base + page - 1) & ~(uintptr_t) (page - 1);
        const uintptr_t a1 = (base + n) & ~(uintptr_t) (page - 1);
        if (a1 <= a0) {
            continue;
        }
        if (before) {
            madvise((void *) a0, a1 - a0, MADV_SEQUENTIAL);
        } else {
            madvise((void *) a0, a1 - a0, MADV_DONTNEED);
            madvise((void *) a0, a1 - a0, MADV_RANDOM);
            posix_fadvise(f->file->fd, (off_t) f->offs, (off_t) n, POSIX_FADV_DONTNEED);
        }
    }
}

// Prefill read-ahead: while this streamed layer computes, the kernel reads the next managed layer's experts into the
// page cache (a worker submits the hint; the compute thread does not wait), so that layer's faults find them there
static void read_next_layer_ahead(vis_moe_context & vm, int il) {
    for (int T = il + 1; T < (int) vm.layers.size(); ++T) {
        const vis_moe_layer & L = vm.layers[T];
        if (!L.managed) {
            continue;
        }
        std::vector<vis_fetch_job::range> ranges;
        for (const vis_deferred_tensor * f : L.file) {
            if (f) {
                ranges.push_back({ f->file->fd, (off_t) f->offs, (off_t) (f->nb2 * (size_t) f->n_expert) });
                vm.bytes_stream_ahead += ranges.back().len;
            }
        }
        vm.n_stream_ahead++;
        vm.fetch->read_ahead(std::move(ranges));
        return;
    }
}

void vis_moe_stream_op(ggml_tensor * dst, const ggml_tensor * ids_t, const ggml_tensor * weights, int ith, int nth,
                       void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    ids_op a(dst, ids_t, userdata);
    vis_moe_context & vm = a.vm;
    vis_moe_layer & L = a.L;
    const int64_t n_pairs = a.n_pairs;
    const int32_t * ids = a.ids;
    std::memcpy(a.out, ids, n_pairs * sizeof(int32_t));
    guarded(vm, a.out, n_pairs, [&]() {
        for (auto & f : vm.features) {
            f->observe_routing(vm, a.ud.il, ids_t, weights);
        }
        std::vector<bool> seen(L.n_expert, false);
        std::vector<int>  routed;  // the distinct experts of the ubatch, in first-use order
        for (int64_t j = 0; j < n_pairs; ++j) {
            if (ids[j] >= 0 && ids[j] < L.n_expert && !seen[ids[j]]) {
                seen[ids[j]] = true;
                routed.push_back(ids[j]);
            }
        }
        const bool shadow = a.ud.pass == 2;
        vm.n_streamed     += (int64_t) routed.size();
        vm.bytes_streamed += (int64_t) routed.size() * (shadow ? L.shadow.expert_bytes : L.expert_bytes);
        if (const vis_gguf_file * f = L.any_file()) {
            f->check_unchanged();  // never compute on a file replaced under us
        }
        // 0: through the mapping (slab lending gives the page cache the slabs' memory first, under tight plans);
        // 1, 2: staged (vis-moe-stage.h), the stager reads into a staging buffer in the slabs (2: the shadows)
        for (auto & f : vm.features) {
            f->stream_layer(vm, L, a.ud.il, routed, (vis_stream_how) a.ud.pass, ids_t, weights);
        }
        if (a.ud.pass >= 1) {
            return;
        }
        stream_advise(vm, L, true, routed);
        vm.ub_streamed = true;
        if (vm.stream_ahead) {
            read_next_layer_ahead(vm, a.ud.il);
        }
    }, [&](int64_t j) { return ids[j]; });
}

void vis_moe_merge_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, const ggml_tensor * ids_t, int ith,
                      int nth, void * userdata) {
    auto * ud = (vis_moe_op_ud *) userdata;
    const vis_moe_layer & L = ud->vm->layers[ud->il];
    const int64_t n_pairs = ggml_nelements(ids_t);
    const int32_t * ids = L.run_ids((const int32_t *) ids_t->data);
    const size_t row = b->nb[1];
    GGML_ASSERT(dst->data == a->data && ggml_is_contiguous(a) && ggml_is_contiguous(b) && a->nb[1] == row);
    for (int64_t j = ith; j < n_pairs; j += nth) {
        if (L.ubatch_plan.pass_of[ids[j]] == ud->pass) {
            std::memcpy((char *) dst->data + j * row, (const char *) b->data + j * row, row);
        }
    }
}

void vis_moe_drop_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    (void) a;
    (void) dst;
    (void) nth;
    if (ith == 0) {
        auto * ud = (vis_moe_op_ud *) userdata;
        stream_advise(*ud->vm, ud->vm->layers[ud->il], false);
    }
}
