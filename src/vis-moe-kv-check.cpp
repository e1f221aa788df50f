// vis-moe-kv-check.cpp - under --moe-mem, a context whose KV cache alone cannot fit the budget is refused before
// upstream allocates and clears it (vis-moe.h; issue #25: -c 32768 in a 357 MiB cgroup was killed while the
// 512 MiB KV cache was cleared, before the context's plan could refuse it).
#include "vis-moe.h"
#include "vis-moe-settings.h"

#include "llama-model.h"

#include <algorithm>
#include <stdexcept>
#include <string>

void vis_moe_check_kv(const llama_model & model, uint32_t n_ctx, ggml_type type_k, ggml_type type_v) {
    const auto & hp = model.hparams;
    if (hp.no_alloc || hp.vocab_only) {
        return;
    }
    const vis_moe_settings s = vis_moe_settings_current();
    if (s.tier.mem_mib == 0 || s.tier.store != 0) {
        return;  // only under --moe-mem with the file store
    }
    // a lower bound of the KV cache: n_ctx rows of K and V in each attention layer with its own cache that is not
    // sliding-window (SWA and recurrent layers hold less: counted as nothing), so no context that fits is refused
    int64_t per_token = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.has_kv(il) || hp.is_swa(il) || hp.is_recr(il)) {
            continue;
        }
        per_token += (int64_t) (ggml_row_size(type_k, hp.n_embd_k_gqa(il)) + ggml_row_size(type_v, hp.n_embd_v_gqa(il)));
    }
    if (per_token <= 0) {
        return;
    }
    // the plan with nothing else in it (llama_vis_moe_plan: the budget as the context's plan will see it, clamped)
    llama_vis_moe_plan_request rq = {};
    rq.budget        = s.tier.mem_mib > 0 ? (s.tier.mem_mib << 20) : 0;
    rq.kv_bytes      = per_token * (int64_t) n_ctx;
    rq.reserve_bytes = llama_vis_moe_estimate_reserve(0, 0, 0, 0, 0);  // the runtime floor
    rq.host_mib      = -1;
    struct llama_vis_moe_plan plan;
    if (llama_vis_moe_plan(&rq, &plan) == 0 && plan.ok) {
        return;
    }
    const int64_t fit = (plan.budget - rq.reserve_bytes) / per_token;
    const std::string mem = s.tier.mem_mib < 0 ? std::string("auto") : std::to_string(s.tier.mem_mib);
    throw std::runtime_error("vis-moe: --moe-mem " + mem + ": the memory budget of " + std::to_string(plan.budget >> 20) +
                             " MiB is too small: the KV cache of a " + std::to_string(n_ctx) +
                             "-token context needs at least " + std::to_string((rq.kv_bytes + (1 << 20) - 1) >> 20) +
                             " MiB next to the runtime (" + std::to_string(rq.reserve_bytes >> 20) +
                             " MiB), before any weight; " +
                             (fit > 0 ? "use -c " + std::to_string(fit) + " or less (the weights need room too: pyvis "
                                        "plan MODEL -c N says how much), or raise --moe-mem"
                                      : std::string("raise --moe-mem")));
}
