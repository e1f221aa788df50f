// vis-moe-lend.cpp - slab lending (vis-moe-lend.h).
#include "vis-moe-lend.h"
#include "vis-moe-borrow.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-fetch-slots.h"
#include "vis-moe-host-cache.h"
#include "vis-moe-policy.h"
#include "vis-pages.h"

#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>


void vis_moe_lend_decide(vis_moe_context & vm, int mode, int64_t plan_free) {
    if (mode == 0 || (mode < 0 && plan_free < 0) || vm.stream_passes <= 0 || vm.n_managed == 0) {
        return;
    }
    int64_t layer_bytes = 0;  // the largest streamed layer's experts
    bool    streams     = false;
    for (const auto & L : vm.layers) {
        if (L.can_stream()) {
            streams     = true;
            layer_bytes = std::max(layer_bytes, L.expert_bytes * (int64_t) L.n_expert);
        }
    }
    if (!streams) {
        return;  // only CPU-only runs stream
    }
    const int64_t need  = layer_bytes * (vm.stream_ahead ? 2 : 1);
    const int64_t slabs = vm.slab_bytes + vm.shadow_slab_bytes;  // what lending gives: the shadow slabs too
    if (mode > 0) {
        vm.lend = vm.add(std::make_unique<vis_moe_lender>());
        LLAMA_LOG_INFO("vis-moe: --moe-stream-lend on: streamed ubatches lend the slabs' %.0f MiB to the page cache and "
                       "refill them afterwards\n", slabs / 1048576.0);
        return;
    }
    if (plan_free >= need) {
        return;  // room enough
    }
    // with a stager (vis-moe-stage.h), a ubatch whose staging buffers the budget cannot hold (the borrowed slots'
    // bytes are the compute buffer's while a large ubatch runs) streams through the mapping: it lends too.  Measured
    // (docs/paging.md#prefill-streaming): the 48-layer model at 12.5 %, a 700-token prompt, prefill 21.6-22.1
    // against 19.9-20.4 tok/s, 21.4 against 26.8-27.1 GB read
    vm.lend = vm.add(std::make_unique<vis_moe_lender>());
    LLAMA_LOG_INFO("vis-moe: the memory plan leaves %.0f MiB free, a streamed prefill keeps %.0f MiB in the page cache "
                   "(%s): streamed ubatches %slend the slabs' %.0f MiB to the page cache and refill them afterwards\n",
                   plan_free / 1048576.0, need / 1048576.0, vm.stream_ahead ? "two layers' experts, --moe-stream-ahead"
                   : "one layer's experts", vm.stage ? "that cannot stage their layers in the slabs " : "",
                   slabs / 1048576.0);
    if (slabs + plan_free < need) {
        vm.note("a streamed prefill keeps " + std::to_string(need >> 20) + " MiB in the page cache, more than the " +
                std::to_string((slabs + plan_free) >> 20) + " MiB the slabs and the plan's free bytes give it: "
                "prefill may re-read experts" + std::string(vm.stream_ahead ? "; try --moe-stream-ahead off" : "") +
                ", or raise the budget");
    }
}

void vis_moe_empty_slots(vis_moe_context & vm) {
    for (int il = 0; il < (int) vm.layers.size(); ++il) {
        vis_moe_layer & L = vm.layers[il];
        if (!L.managed) {
            continue;
        }
        int64_t waited = 0;
        vis_moe_fetch_collect(vm, L, il, waited);  // nothing may write a slot whose pages go (throws on a read error)
        L.slots.forget_all();
        L.shadow.pool.forget_all();  // the shadow slabs go with the slabs (lent, or overwritten by staging)
    }
}

void vis_moe_lend_slabs(vis_moe_context & vm) {
    if (!vm.lend || vm.lend->lent) {
        return;
    }
    vm.lend->lent = true;  // first: a failed collect below still returns the slabs at the end of the ubatch
    vis_moe_empty_slots(vm);
    for (ggml_backend_buffer_t buf : vm.bufs) {
        if (ggml_backend_buffer_is_host(buf)) {
            vm.lend->bytes_lent += vis_release_pages(ggml_backend_buffer_get_base(buf), ggml_backend_buffer_get_size(buf),
                                                     vm.locked, false);
        }
    }
    vm.lend->n_lent++;
}

void vis_moe_return_slabs(vis_moe_context & vm) {
    if (!vm.lend || !vm.lend->lent) {
        return;
    }
    vm.lend->lent = false;
    if (!vm.locked) {
        return;  // the pages come back as the slots refill
    }
    if (vm.borrow) {
        vm.borrow->lock_base(vm);  // the borrowed slots above stay unlocked (vis-moe-borrow.h)
        return;
    }
    for (ggml_backend_buffer_t buf : vm.bufs) {
        if (ggml_backend_buffer_is_host(buf)) {
            vis_mlock_region(ggml_backend_buffer_get_base(buf), ggml_backend_buffer_get_size(buf), "the expert slabs");
        }
    }
}

void vis_moe_lender::ubatch_end(vis_moe_context & vm) {
    vis_moe_return_slabs(vm);  // lent only by a ubatch that streamed
}

void vis_moe_lender::stats_print(const vis_moe_context & vm) const {
    (void) vm;
    if (n_lent > 0) {
        std::fprintf(stderr, "vis-moe: slab lending: %" PRId64 " streamed ubatches gave the slabs' %.2f MiB to the page "
                             "cache (the slots emptied, refilled on demand)\n", n_lent,
                     bytes_lent / 1048576.0 / (double) n_lent);
    }
}

void vis_moe_lender::stream_layer(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<int> & routed,
                                  vis_stream_how how, const ggml_tensor * ids, const ggml_tensor * weights) {
    (void) L;
    (void) il;
    (void) routed;
    (void) ids;
    (void) weights;
    if (how == VIS_STREAM_MAPPED) {
        vis_moe_lend_slabs(vm);
    }
}
