// vis-moe-borrow.cpp - borrowed slots (vis-moe-borrow.h).
#include "vis-moe-borrow.h"
#include "vis-moe-attach-plan.h"
#include "vis-error.h"
#include "vis-moe-context.h"
#include "vis-moe-host-cache.h"
#include "vis-moe-reserve.h"
#include "vis-moe-settings.h"
#include "vis-pages.h"
#include "llama-vis-paging.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

// the estimate's compute bytes at a ubatch of n tokens: the reserve less its fixed part (the reserve of a zero-sized
// model: the runtime and the kernel's headroom)
static int64_t compute_at(const vis_moe_borrow::plan & p, int64_t n) {
    return llama_vis_moe_estimate_reserve(std::min(n, p.n_ubatch), p.n_vocab, p.n_embd, p.n_expert_used, p.n_ff_exp) -
           llama_vis_moe_estimate_reserve(0, 0, 0, 0, 0);
}

vis_moe_borrow::vis_moe_borrow(const llama_context * lctx, const plan & p)
    : lctx(lctx), p(p), compute_asked(compute_at(p, p.n_ubatch)), compute_small(compute_at(p, SMALL)) {}

void vis_moe_borrow::limit_all(vis_moe_context & vm, int slots) {
    int managed = 0;
    for (int il = 0; il < (int) vm.layers.size(); ++il) {
        vis_moe_layer & L = vm.layers[il];
        if (L.managed) {
            int n = L.share(slots, p.full);
            if (managed++ < n_capped) {
                // one slot fewer than this ubatch would give it (the slabs' top slot is above a decode step's limit
                // where small ubatches were measured to leave more than the estimate), never below the base
                n = std::max(L.share(p.base, p.full), n - 1);
            }
            vm.limit_slots(il, n);
        }
    }
    active = slots;
}

void vis_moe_borrow::fit_measured(const vis_moe_context & vm) {
    // Before each ubatch: the plan's parts are estimates.  Where the process holds more than the budget less the
    // kernel's headroom anyway, as many layers as that takes hold one slot fewer from then on (limit_all; a backstop:
    // since the graph's node capacity stopped growing as slots fall, the plan was enough in every run measured:
    // docs/planning.md#the-schedulers-node-capacity).
    const int64_t rss = vm.plan_budget > 0 ? vis_process_rss() : -1;  // one read of /proc/self/statm: every ubatch
    if (rss <= 0) {
        return;
    }
    const int64_t o = rss - (vm.plan_budget - VIS_MOE_RESERVE_KERNEL);
    const int64_t slot = p.row_bytes / std::max(1, vm.n_managed);
    if (o > 0 && slot > 0 && n_capped < vm.n_managed) {
        // never given back: the next ubatch's limits drop the pages of the slot these layers give up
        over += o;
        n_capped = (int) std::min<int64_t>(vm.n_managed, n_capped + (o + slot - 1) / slot);
        capped_now = true;
    }
}

bool vis_moe_borrow::lock_base(vis_moe_context & vm) const {
    bool ok = true;
    for (const auto & L : vm.layers) {
        for (const ggml_tensor * t : L.slab) {
            if (L.managed && t && t->data && ggml_backend_buffer_is_host(t->buffer)) {
                ok = vis_mlock_region(t->data, (size_t) L.min_active * t->nb[2], "the expert slabs") && ok;
            }
        }
    }
    return ok;
}

int64_t vis_moe_borrow::sched_size(ggml_backend_buffer_type_t buft) const {
    ggml_backend_sched_t sched = lctx ? lctx->get_sched() : nullptr;
    int64_t sum = -1;
    for (int i = 0; sched && i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_buffer_type_t t = ggml_backend_sched_get_buffer_type(sched, ggml_backend_sched_get_backend(sched, i));
        if (buft ? t == buft : ggml_backend_buft_is_host(t)) {
            sum = std::max<int64_t>(sum, 0) +
                  (int64_t) ggml_backend_sched_get_buffer_size(sched, ggml_backend_sched_get_backend(sched, i));
        }
    }
    return sum;
}

bool vis_moe_borrow::compute_is_current() const {
    // the scheduler replaces its buffer only by a larger one (ggml_gallocr_reserve_n): the same size, the same buffer
    return compute && sched_size(ggml_backend_buffer_get_type(compute)) == (int64_t) compute_size;
}

void vis_moe_borrow::ubatch_prepare(vis_moe_context & vm, const llama_ubatch & ub) {
    fit_measured(vm);  // what the process holds, measured: the plan's parts are estimates
    const int64_t n = ub.n_tokens;
    const int64_t R = sched_size(nullptr);
    const bool current = compute_is_current();
    // what the ubatches since the last check left resident in the compute buffer: the measure the next limits use
    const int64_t res = current ? vis_resident_bytes(ggml_backend_buffer_get_base(compute), compute_size) : -1;
    if (res >= 0 && large_n > 0 && R > 0) {
        const double pred = (double) R * (double) large_n / (double) p.n_ubatch;
        if (pred > 0 && res > pred) {
            scale = std::max(scale, res / pred);
        }
    } else if (res >= 0 && ran_small) {
        small_bytes = std::max(small_bytes, res);
    }
    if (n <= SMALL && large_n > 0 && current) {
        // nothing in it is live: the last outputs were copied out, this ubatch's inputs are not set yet
        bytes_released += vis_release_pages(ggml_backend_buffer_get_base(compute), compute_size, false, false);
        n_released++;
        large_n = 0;
    }
    if (n <= SMALL && large_n == 0) {
        need = std::max(compute_small, small_bytes);
    } else {
        // a larger ubatch writes the buffer upstream allocated up to about its share of the asked ubatch's tokens (its
        // activations are [.., n_tokens] tensors), at least what the measure above saw
        large_n = std::max(large_n, n);
        need = R < 0 ? compute_asked
                     : std::min<int64_t>(R, (int64_t) (scale * (double) R * (double) large_n / (double) p.n_ubatch) +
                                                compute_small);
    }
    const int slots = std::clamp((int) (p.base + std::max<int64_t>(0, compute_asked - need - p.pageable) /
                                                 std::max<int64_t>(1, p.row_bytes)), p.base, p.full);
    if (large_n == 0) {
        n_full++;
        full_sum += slots;
    } else {
        n_mid++;
        mid_sum += slots;
    }
    ran_small = n <= SMALL;
    if (slots != active || capped_now) {
        capped_now = false;
        limit_all(vm, slots);  // a lower limit drops its slots' pages before the graph writes the compute buffer
    }
    if (idle_resident) {
        // the slots faulted at attach that this first ubatch may not use: their bytes are the compute buffer's now
        idle_resident = false;
        for (int il = 0; il < (int) vm.layers.size(); ++il) {
            const vis_moe_layer & L = vm.layers[il];
            if (!L.managed) {
                continue;
            }
            for (int s = L.slots.n_active(); s < L.n_slots; ++s) {
                vm.drop_slot_pages(il, s);
            }
        }
    }
}

void vis_moe_borrow::observe_routing(const vis_moe_context & vm, int il, const ggml_tensor * ids,
                                     const ggml_tensor * weights) {
    (void) vm;
    (void) il;
    (void) weights;
    // every time: a buffer the scheduler replaced by a larger one may come back at the same address
    ggml_backend_buffer_t b = ids ? ids->buffer : nullptr;
    if (b && ggml_backend_buffer_is_host(b) && ggml_backend_buffer_get_usage(b) == GGML_BACKEND_BUFFER_USAGE_COMPUTE) {
        compute      = b;
        compute_size = ggml_backend_buffer_get_size(b);
    }
}

int64_t vis_moe_borrow::staging_room(const vis_moe_context & vm) const {
    (void) vm;
    return std::max<int64_t>(0, compute_asked - need - p.pageable - (int64_t) (active - p.base) * p.row_bytes);
}

void vis_moe_borrow::stats_reset() {
    n_full = n_mid = full_sum = mid_sum = n_released = bytes_released = 0;
}

void vis_moe_borrow::stats_print(const vis_moe_context & vm) const {
    (void) vm;
    std::fprintf(stderr, "vis-moe: borrowed slots: the plan at -ub %" PRId64 " gives %d per layer, the slabs hold %d; %"
                         PRId64 " ubatches of <= %" PRId64 " tokens ran %.1f on average (the compute buffer's pages "
                         "dropped %" PRId64 "x; %.1f MiB resident after them), %" PRId64 " larger ones %.1f (compute "
                         "buffer %.0f MiB allocated, %.0f estimated; written %.2fx their share of it)\n",
                 p.n_ubatch, p.base, p.full, n_full, SMALL, n_full > 0 ? full_sum / (double) n_full : 0.0, n_released,
                 small_bytes / 1048576.0, n_mid, n_mid > 0 ? mid_sum / (double) n_mid : 0.0,
                 std::max<int64_t>(0, sched_size(nullptr)) / 1048576.0, compute_asked / 1048576.0, scale);
    if (n_capped > 0) {
        std::fprintf(stderr, "vis-moe: borrowed slots: %d layers hold one slot fewer: the process held %.1f MiB "
                             "more than the budget less the kernel's headroom allows, measured\n", n_capped, over / 1048576.0);
    }
}

const char * vis_moe_borrow_off_reason(const vis_moe_settings & s, const vis_moe_attach_plan & ap) {
    if (!ap.cpu_only) {
        return "the slabs are on a GPU, whose memory is not released page by page";
    }
    if (s.plan.online > 0 || (s.plan.encoder_release > 0 && ap.encoder_held_slots > 0)) {
        return "VIS_MOE_ONLINE or VIS_MOE_ENCODER_RELEASE moves the slot limits";
    }
    if (s.params.n_slots > 0) {
        return "--moe-slots fixes the slots";
    }
    if (s.prec.on() || s.cap.on() || !s.prec.shadow.empty()) {
        return "--moe-precision, --moe-shadow and --moe-capacity plan passes at a fixed slot count";
    }
    return nullptr;
}

bool vis_moe_borrow_applies(const vis_moe_settings & s, const vis_moe_attach_plan & ap) {
    return s.plan.borrow != 0 && !vis_moe_borrow_off_reason(s, ap);
}

std::string vis_moe_borrow_plan(const llama_model & model, const vis_moe_settings & s, vis_moe_attach_plan & ap,
                                const llama_vis_moe_plan_request & rq, const struct llama_vis_moe_plan & plan, int64_t n_ubatch) {
    if (s.plan.borrow == 0) {
        return "";
    }
    struct llama_vis_moe_plan p2 = {};
    const char * off = vis_moe_borrow_off_reason(s, ap);
    if (!off && n_ubatch <= vis_moe_borrow::SMALL) {
        off = "the ubatch is already small";
    }
    if (!off && ap.per_slot <= 0) {
        off = "no slots to grow";
    }
    if (!off) {
        // the same request at a ubatch of SMALL tokens
        llama_vis_moe_plan_request r2 = vis_moe_plan_request(model, s, ap, vis_moe_borrow::SMALL, rq.kv_bytes);
        if (llama_vis_moe_plan(&r2, &p2) != 0 || !p2.ok || p2.host_bytes < plan.host_bytes) {
            off = "no plan at a small ubatch";
        } else if (p2.pageable_bytes > 0) {
            // the resident weights get the bytes first; the page cache holds them as it can (not slots)
            off = "even at a small ubatch the budget leaves resident weights pageable";
        } else if (p2.n_slots <= plan.n_slots) {
            off = "the compute buffer of a small ubatch buys no whole slot row";
        }
        vis_clear_last_error();
    }
    if (off) {
        // auto (the default) says nothing where it does not apply; on says why
        return s.plan.borrow > 0 ? std::string("; VIS_MOE_BORROW: off (") + off + ")" : std::string();
    }
    ap.borrow_base_slots = plan.n_slots;
    ap.n_slots     = p2.n_slots;
    ap.extra_slots = p2.extra_slots;
    char line[240];
    std::snprintf(line, sizeof(line), "; VIS_MOE_BORROW: slabs for %d slots%s (the plan at -ub %" PRId64 "), %d in "
                  "ubatches of more than %" PRId64 " tokens", p2.n_slots,
                  p2.extra_slots > 0 ? (" + 1 in " + std::to_string(p2.extra_slots)).c_str() : "",
                  vis_moe_borrow::SMALL, plan.n_slots, vis_moe_borrow::SMALL);
    return line;
}

void vis_moe_borrow_attach(vis_moe_context & vm, const llama_context * lctx, const llama_model & model, int base, int full,
                           int64_t n_ubatch, int64_t row_bytes, int64_t pageable, bool lock) {
    const auto & hp = model.hparams;
    vis_moe_borrow::plan p;
    p.base          = base;
    p.full          = full;
    p.n_ubatch      = n_ubatch;
    p.row_bytes     = row_bytes;
    p.pageable      = pageable;
    p.n_vocab       = model.vocab.n_tokens();
    p.n_embd        = hp.n_embd;
    p.n_expert_used = hp.n_expert_used_max();
    p.n_ff_exp      = hp.n_ff_exp();
    auto * b = vm.borrow = vm.add(std::make_unique<vis_moe_borrow>(lctx, p));
    for (auto & L : vm.layers) {
        if (L.managed) {
            // the graphs reserve their nodes for the passes at the fewest slots
            L.min_active = L.share(p.base, p.full);
        }
    }
    b->limit_all(vm, p.base);  // nothing is resident yet: the slabs were cleared lazily
    if (lock) {
        // the base slots resident and locked at load, as the whole slabs are without borrowing (the host cache, made
        // after this, adds its own lock to vm.locked)
        vm.locked = b->lock_base(vm);
    }
    b->fault_borrowed(vm);
}

void vis_moe_borrow::fault_borrowed(vis_moe_context & vm) {
    // Now, right after the slabs are made, the memory cgroup still has room: the pages come whole from the kernel's
    // free lists.  Faulted later, at the limit, they are pages its reclaim frees one at a time, and O_DIRECT reads
    // into such scattered pages were measured slower (docs/planning.md#stop-42-the-borrowed-slots-pages-were-physically-scattered-found-and-fixed).
    // Nothing else is resident yet (the compute buffer is reserved, not written); the first ubatch drops the ones it
    // cannot hold (ubatch_prepare).
    for (const auto & L : vm.layers) {
        for (const ggml_tensor * t : L.slab) {
            if (L.managed && t && t->data && ggml_backend_buffer_is_host(t->buffer) && L.slots.n_active() < L.n_slots) {
                const size_t from = (size_t) L.slots.n_active() * t->nb[2];
                std::memset((uint8_t *) t->data + from, 0, (size_t) L.n_slots * t->nb[2] - from);
                idle_resident = true;
            }
        }
    }
}
