// vis-moe-encoder-release.cpp - the vision encoder's bytes handed to the expert slots (vis-moe-encoder-release.h).
#include "vis-moe-encoder-release.h"
#include "vis-moe-attach-plan.h"
#include "vis-moe-context.h"
#include "vis-moe-settings.h"
#include "vis-error.h"
#include "llama-vis.h"

#include "llama-impl.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

std::string vis_moe_encoder_release_plan(const vis_moe_settings & s, vis_moe_attach_plan & ap, int without,
                                         int64_t encoder_bytes, int n_expert) {
    if (s.plan.online > 0) {
        throw std::runtime_error("VIS_MOE_ENCODER_RELEASE=on cannot run with VIS_MOE_ONLINE=on (both move the slot "
                                 "limits); unset one of them");
    }
    const char * off = nullptr;
    if (!ap.cpu_only) {
        off = "the slabs are on a GPU, whose memory is not released page by page";
    } else if (s.params.n_slots > 0) {
        off = "--moe-slots fixes the slots";
    } else if (ap.per_slot <= 0) {
        off = "no slots to grow";
    }
    if (off) {
        return std::string("; VIS_MOE_ENCODER_RELEASE: off (") + off + ")";
    }
    const int freed = (int) std::min<int64_t>({ (int64_t) n_expert, (int64_t) without,
                                                ap.n_slots + encoder_bytes / ap.per_slot });
    if (freed <= ap.n_slots) {
        return without <= 0 ? "; VIS_MOE_ENCODER_RELEASE: off (without the encoder the budget still leaves resident "
                              "weights pageable: its bytes go to them)"
                            : "; VIS_MOE_ENCODER_RELEASE: off (the encoder's bytes buy no slot)";
    }
    ap.encoder_held_slots = ap.n_slots;
    ap.n_slots            = freed;
    char line[200];
    std::snprintf(line, sizeof(line), "; VIS_MOE_ENCODER_RELEASE: slabs for %d slots, %d active until the vision "
                  "encoder is freed", freed, ap.encoder_held_slots);
    return line;
}

// every managed layer limited to its share of `slots` (the graphs reserve passes for the fewest)
static void limit_all(vis_moe_context & vm, int slots, int of) {
    for (int il = 0; il < (int) vm.layers.size(); ++il) {
        vis_moe_layer & L = vm.layers[il];
        if (L.managed) {
            L.min_active = L.share(slots, of);
            vm.limit_slots(il, L.min_active);
        }
    }
}

void vis_moe_encoder_release_attach(vis_moe_context & vm, int held, int freed, int64_t encoder_bytes, int64_t row_bytes) {
    vm.encoder_release = vm.add(std::make_unique<vis_moe_encoder_release>(held, freed, encoder_bytes, row_bytes));
    limit_all(vm, held, freed);  // nothing is resident yet: the slabs were cleared lazily
}

int vis_moe_encoder_release::fit_staging(vis_moe_context & vm, int n_buf, int64_t stride) {
    const int64_t budget = (int64_t) planned_held * row_bytes;
    const int64_t layer  = vm.n_managed > 0 ? row_bytes / vm.n_managed : row_bytes;  // one slot of one layer
    for (int n = n_buf; n >= 1; --n) {
        // the buffers span whole slabs: beside the h active slots counted in h rows, the inactive share of the
        // region (one layer's inactive slots more where it ends inside a layer)
        const int64_t region = (int64_t) n * stride;
        for (int h = planned_held; h >= 1; --h) {
            const int64_t over = region * (freed_slots - h) / freed_slots + (int64_t) (freed_slots - h) * layer;
            if ((int64_t) h * row_bytes + over <= budget) {
                if (h != held) {
                    LLAMA_LOG_INFO("vis-moe: VIS_MOE_ENCODER_RELEASE: %d slots per layer instead of %d until the "
                                   "vision encoder is freed, for %d staging buffer%s of %.0f MiB over the slabs\n", h,
                                   planned_held, n, n == 1 ? "" : "s", stride / 1048576.0);
                    held = h;
                    limit_all(vm, h, freed_slots);
                }
                return n;
            }
        }
    }
    return 0;
}

int64_t vis_moe_encoder_release::staging_room(const vis_moe_context & vm) const {
    (void) vm;
    return done ? INT64_MAX : (int64_t) (planned_held - held) * row_bytes;
}

void vis_moe_encoder_release::freed(vis_moe_context & vm) {
    if (done) {
        return;
    }
    done = true;
    for (int il = 0; il < (int) vm.layers.size(); ++il) {
        vis_moe_layer & L = vm.layers[il];
        if (L.managed) {
            L.min_active = 0;  // no lower limit follows: the graphs plan their passes for the slabs' slots again
            vm.limit_slots(il, L.n_slots);
        }
    }
    // seen without -v, like the online controller's resize lines
    std::fprintf(stderr, "vis-moe: the vision encoder is freed: slots %d -> %d per layer (the plan without its %.0f MiB)\n",
                 held, freed_slots, encoder_bytes / 1048576.0);
    std::fflush(stderr);
}

void vis_moe_encoder_release::stats_print(const vis_moe_context & vm) const {
    (void) vm;
    std::fprintf(stderr, "vis-moe: encoder release: %d slots per layer while the vision encoder was loaded (the plan: %d), "
                 "%d %s\n", held, planned_held, freed_slots,
                 done ? "after it was freed" : "planned for after it (it was not freed)");
}

int32_t llama_vis_moe_encoder_releasable(const struct llama_context * ctx) {
    const vis_moe_context * vm = ctx ? vis_moe_of(ctx) : nullptr;
    return vm && vm->encoder_release && !vm->encoder_release->done ? 1 : 0;
}

int32_t llama_vis_moe_encoder_freed(struct llama_context * ctx) {
    vis_clear_last_error();
    vis_moe_context * vm = ctx ? vis_moe_of(ctx) : nullptr;
    if (!vm || !vm->encoder_release) {
        vis_set_last_error("llama_vis_moe_encoder_freed: this context's plan does not hand the vision encoder's bytes "
                           "to the slots (VIS_MOE_ENCODER_RELEASE=on with --moe-mem and an --mmproj on the CPU)");
        return -1;
    }
    vm->encoder_release->freed(*vm);
    return 0;
}
