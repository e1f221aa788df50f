// vis-moe-configure-context.cpp - the configurator applied to a context being created (vis-moe-configure.h): the
// same plan request as the attach (vis_moe_plan_request), priced at each candidate ubatch by
// llama_vis_moe_configure; a lower ubatch it chooses is set in the context's parameters before upstream reserves
// the compute buffers, and the attach then plans its slots at that ubatch (the same llama_vis_moe_plan question).
#include "vis-moe-configure.h"
#include "vis-moe-borrow.h"
#include "vis-moe.h"
#include "vis-moe-context.h"
#include "vis-moe-deferred.h"
#include "vis-moe-split.h"
#include "vis-error.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// the file the managed experts are read from (their first deferred tensor's), "" if none is deferred; `type`: that
// tensor's weight type (what the compute probe times)
std::string expert_file(const llama_model & model, const vis_moe_attach_plan & ap, int32_t & type) {
    for (int il : ap.managed) {
        for (const ggml_tensor * t : vis_moe_expert_tensors(model.layers[il])) {
            const vis_deferred_tensor * d = t ? vis_moe_deferred(t) : nullptr;
            if (d && d->file) {
                type = (int32_t) t->type;
                return d->file->path;
            }
        }
    }
    return "";
}

// the weight types on which the CPU backend's outputs are the same bit for bit at any ubatch (docs/planning.md:
// measured on F32 weights; Q8_0 without repacking rounds differently at another ubatch)
bool ubatch_invariant(const llama_model & model) {
    for (const auto & [name, t] : model.tensors_by_name) {
        if (t->type != GGML_TYPE_F32) {
            return false;
        }
    }
    return true;
}

} // namespace

bool vis_moe_configure_ubatch(const llama_model & model, const vis_moe_settings & s, const vis_moe_attach_plan & ap,
                              llama_cparams & cp, int64_t kv_bytes) {
    if (!s.plan.configure || !cp.causal_attn || ap.managed.empty() || cp.n_ubatch <= 1) {
        return false;  // off; embeddings (a non-causal ubatch must hold the whole input); nothing paged; already small
    }
    int32_t type = GGML_TYPE_F32;
    const std::string path = expert_file(model, ap, type);
    if (path.empty()) {
        return false;  // nothing deferred: no reads to price
    }
    llama_vis_moe_configure_request rq = {};
    rq.plan         = vis_moe_plan_request(model, s, ap, cp.n_ubatch, kv_bytes);
    rq.n_vocab      = model.vocab.n_tokens();
    rq.n_embd       = model.hparams.n_embd;
    rq.n_ff_exp     = model.hparams.n_ff_exp();
    rq.n_ubatch     = (int32_t) cp.n_ubatch;
    rq.n_ubatch_min = 0;  // the runtime's smallest
    rq.borrow       = vis_moe_borrow_applies(s, ap) ? 1 : 0;
    if (rq.plan.n_managed_layers == 0 ||
        llama_vis_moe_cost_probe(path.c_str(), type, rq.n_embd, rq.n_ff_exp, rq.plan.n_expert_used,
                                 std::max<int32_t>(1, (int32_t) cp.n_threads), &rq.cost) != 0) {
        if (rq.plan.n_managed_layers != 0) {
            LLAMA_LOG_WARN("vis-moe: configurator off for this context: %s\n", llama_vis_last_error());
        }
        return false;
    }
    // a routing profile where one is given: VIS_MOE_SLOT_SPLIT's per-layer miss curves, rescaled from the profile's
    // top-k to the model's (as `pyvis plan --profile` prices them); else the uniform prior.  A bad file is left to
    // the attach, which refuses it with its own message right after
    std::vector<float> curve;
    if (!s.plan.slot_split.empty()) {
        try {
            const int n_exp = (int) model.hparams.n_expert;
            const vis_moe_split_file f = vis_moe_split_file_load(s.plan.slot_split, (int) ap.moe_layers.size(), n_exp);
            const double scale = (double) rq.plan.n_expert_used / std::max(f.top_k, 1);
            for (double m : vis_moe_split_curves(f, vis_moe_managed_positions(ap))) {
                curve.push_back((float) (m * scale));
            }
            rq.miss_curve = curve.data();
        } catch (const std::exception &) {
            curve.clear();
        }
    }
    llama_vis_moe_configuration c;
    if (llama_vis_moe_configure(&rq, &c) != 0) {
        LLAMA_LOG_WARN("vis-moe: configurator off for this context: %s\n", llama_vis_last_error());
        return false;
    }
    const bool all_f32 = ubatch_invariant(model);
    const int32_t verdict = llama_vis_moe_configure_applies(&rq, &c, s.plan.configure, all_f32);
    if (!c.ok) {
        if (verdict == LLAMA_VIS_MOE_CONFIGURE_APPLIED) {
            cp.n_ubatch = (uint32_t) c.n_ubatch;  // the refusal names the smallest budget: at the smallest ubatch
        }
        return false;
    }
    if ((uint32_t) c.n_ubatch >= cp.n_ubatch) {
        return false;
    }
    const double freed = (llama_vis_moe_estimate_reserve(cp.n_ubatch, rq.n_vocab, rq.n_embd, rq.plan.n_expert_used,
                                                         rq.n_ff_exp) -
                          llama_vis_moe_estimate_reserve(c.n_ubatch, rq.n_vocab, rq.n_embd, rq.plan.n_expert_used,
                                                         rq.n_ff_exp)) / 1048576.0;
    // " (+ 1 in X layers)": the layers a plan's bytes left after whole rows give one more slot (llama_vis_moe_plan)
    auto more = [](int32_t extra) {
        return extra > 0 ? " (+ 1 in " + std::to_string(extra) + (extra == 1 ? " layer)" : " layers)") : std::string();
    };
    char was[200];
    if (c.asked_n_slots > 0) {
        std::snprintf(was, sizeof(was), "instead of %d%s (predicted decode %.1f tok/s instead of %.1f, prefill %.1f "
                      "instead of %.1f", c.asked_n_slots, more(c.asked_extra_slots).c_str(), c.decode_tps,
                      c.asked_decode_tps, c.prefill_tps, c.asked_prefill_tps);
    } else {
        std::snprintf(was, sizeof(was), "where -ub %u does not fit (predicted decode %.1f tok/s, prefill %.1f",
                      cp.n_ubatch, c.decode_tps, c.prefill_tps);
    }
    char msg[512];
    std::snprintf(msg, sizeof(msg), "--moe-mem: -ub %u lowered to %d: its compute buffer (%.0f MiB less) buys %d expert "
                  "slot%s per layer%s %s)", cp.n_ubatch, c.n_ubatch, freed, c.plan.n_slots, c.plan.n_slots == 1 ? "" : "s",
                  more(c.plan.extra_slots).c_str(), was);
    if (verdict != LLAMA_VIS_MOE_CONFIGURE_APPLIED) {
        std::string m(msg);
        m.replace(m.find("lowered to"), 10, "could be lowered to");
        vis_tell_user(m + ": not applied: this model's weights are not all F32, and on them outputs differ in the last "
                      "bits at another -ub; VIS_MOE_CONFIGURE=on applies it (docs/planning.md)");
        return false;
    }
    vis_tell_user(std::string(msg) + (!all_f32
                  ? ": outputs are upstream's at -ub " + std::to_string(c.n_ubatch) + " (VIS_MOE_CONFIGURE=on)"
                  : std::string(": outputs unchanged (all-F32 weights; VIS_MOE_CONFIGURE=off keeps -ub)")));
    cp.n_ubatch = (uint32_t) c.n_ubatch;
    return true;
}

bool vis_moe_configure_resident_ubatch(const llama_model & model, const vis_moe_settings & s, llama_cparams & cp,
                                       uint32_t fit_ub) {
    if (!s.plan.configure || !cp.causal_attn || fit_ub == 0 || fit_ub >= cp.n_ubatch) {
        return false;  // off; embeddings (a non-causal ubatch must hold the whole input); nothing to lower
    }
    const bool all_f32 = ubatch_invariant(model);
    if (s.plan.configure < 0 && !all_f32) {
        return false;  // auto keeps -ub where outputs would differ in the last bits; the refusal names fit_ub
    }
    vis_tell_user("--moe-mem: -ub " + std::to_string(cp.n_ubatch) + " lowered to " + std::to_string(fit_ub) +
                  ": the whole model is resident, and -ub " + std::to_string(cp.n_ubatch) + "'s compute buffer does "
                  "not fit next to it and the KV cache" +
                  (all_f32 ? std::string(": outputs unchanged (all-F32 weights; VIS_MOE_CONFIGURE=off keeps -ub)")
                           : ": outputs are upstream's at -ub " + std::to_string(fit_ub) + " (VIS_MOE_CONFIGURE=on)"));
    cp.n_ubatch = fit_ub;
    return true;
}
