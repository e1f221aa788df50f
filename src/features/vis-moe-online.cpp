// vis-moe-online.cpp - the online controller (vis-moe-online.h).
#include "vis-moe-online.h"
#include "vis-moe-context.h"
#include "vis-moe-kv-pages.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include "ggml.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <unistd.h>

static double mib(int64_t b) {
    return b / 1048576.0;
}

// the KV bytes one ubatch may add: its cells, and a page more per (tensor, stream) block where it starts a page
static int64_t kv_growth(const llama_kv_cache & kv, int64_t n_ubatch) {
    const int64_t page = (int64_t) sysconf(_SC_PAGESIZE);
    return n_ubatch * vis_kv_pages::cell_bytes(kv) + page * 2 * (int64_t) kv.get_layer_ids().size() * 2 *
           (int64_t) kv.get_n_stream();
}

int vis_moe_online::target(int64_t kv_bytes) const {
    const int64_t left = p.budget - p.fixed - kv_bytes;
    const int64_t s    = p.row_bytes > 0 ? left / p.row_bytes : p.max_slots;
    return (int) std::clamp<int64_t>(s, p.min_slots, p.max_slots);
}

void vis_moe_online::resize(vis_moe_context & vm, int slots, const std::string & why) {
    int64_t dropped = 0;
    for (int il = 0; il < (int) vm.layers.size(); ++il) {
        vis_moe_layer & L = vm.layers[il];
        if (!L.managed) {
            continue;
        }
        // a split layer keeps its share: its slots scaled like the even count, at least one
        const int n = std::max(L.min_active, L.share(slots, p.max_slots));
        dropped += vm.limit_slots(il, n);
    }
    // seen without -v (llama-server shows no info lines of libllama): one line per resize, with its reason
    const std::string freed = dropped > 0 ? ", " + std::to_string(dropped >> 20) + " MiB of slabs released" : "";
    if (slots == active) {
        std::fprintf(stderr, "vis-moe: resize: slots %d per layer (%s%s)\n", slots, why.c_str(), freed.c_str());
    } else {
        std::fprintf(stderr, "vis-moe: resize: slots %d -> %d per layer (%s%s)\n", active, slots, why.c_str(),
                     freed.c_str());
    }
    std::fflush(stderr);
    if (slots != active) {
        (slots < active ? n_shrink : n_grow)++;
    }
    active = slots;
    lo = std::min(lo, slots);
    hi = std::max(hi, slots);
}

void vis_moe_online::ubatch_end(vis_moe_context & vm) {
    const llama_kv_cache * kv = vis_kv_of(lctx);
    if (!kv) {
        return;
    }
    const int64_t t0     = ggml_time_us();
    const int64_t kv_now = vis_kv_pages::resident(*kv);
    recount_us += ggml_time_us() - t0;
    n_recount++;
    const int64_t kv_next = kv_now + kv_growth(*kv, p.n_ubatch);
    const int     want   = target(kv_next);
    if (want >= active + std::max(1, active / 10)) {
        grow_wait++;
    } else {
        grow_wait = 0;
    }
    if (want < active || grow_wait >= GROW_AFTER) {
        // hysteresis on the way down too: a shrink goes at least one step (10 %), so a growing context does not
        // resize at every ubatch
        const int to = want < active ? std::max(p.min_slots, std::min(want, active - std::max(1, active / 10))) : want;
        char why[200];
        std::snprintf(why, sizeof(why), "KV %.0f -> %.0f MiB: %" PRId64 " cells used", mib(kv_last), mib(kv_now),
                      vis_kv_pages::used_cells(*kv));
        if (want >= active) {
            const size_t n = std::strlen(why);
            std::snprintf(why + n, sizeof(why) - n, ", held for %d ubatches", GROW_AFTER);
        }
        resize(vm, to, why);
        kv_last   = kv_now;
        grow_wait = 0;
    }
    set_room(kv_next);
}

void vis_moe_online::stats_print(const vis_moe_context & vm) const {
    (void) vm;
    std::fprintf(stderr, "vis-moe: online controller: %" PRId64 " shrinks, %" PRId64 " growths, %d..%d slots per layer "
                         "(plan: %d at the whole KV cache, %d at its floor), %d now; the KV recount %.2f ms over %"
                         PRId64 " ubatch ends\n",
                 n_shrink, n_grow, lo, hi, p.min_slots, p.max_slots, active, recount_us / 1000.0, n_recount);
}

void vis_moe_online_attach(vis_moe_context & vm, const llama_context * lctx, const vis_moe_online::plan & p) {
    const llama_kv_cache * kv = vis_kv_of(lctx);
    if (!kv) {
        throw std::runtime_error("VIS_MOE_ONLINE=on: this model's memory is not a plain KV cache (sliding-window or "
                                 "recurrent layers); unset VIS_MOE_ONLINE");
    }
    if (vm.precision || vm.capacity || vm.shadow) {
        throw std::runtime_error("VIS_MOE_ONLINE=on cannot run with --moe-precision, --moe-shadow or --moe-capacity (they "
                                 "plan passes at a fixed slot count); unset VIS_MOE_ONLINE or drop them");
    }
    auto * c = vm.add(std::make_unique<vis_moe_online>(lctx, p));
    c->active = p.max_slots;
    c->lo = c->hi = p.max_slots;
    for (auto & L : vm.layers) {
        if (L.managed) {
            L.min_active = L.share(p.min_slots, p.max_slots);
        }
    }
    const int64_t kv_now = vis_kv_pages::resident(*kv);
    const int64_t kv_next = kv_now + kv_growth(*kv, p.n_ubatch);
    const int first = c->target(kv_next);
    c->kv_last = kv_now;
    c->resize(vm, first, "start: KV " + std::to_string(kv_now >> 20) + " MiB resident of " +
                         std::to_string(vis_kv_pages::total(*kv) >> 20) + "; the plan: " + std::to_string(p.min_slots) +
                         " slots with the whole KV cache, " + std::to_string(p.max_slots) + " at its floor");
    c->set_room(kv_next);
    c->stats_reset();
}
