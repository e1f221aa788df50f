// vis-moe-kv-check.cpp - under --moe-mem, the context's whole memory plan is checked before upstream allocates and
// clears its KV cache (vis-moe.h; issue #25: -c 32768 in a 357 MiB cgroup was killed while the 512 MiB KV cache
// was cleared, before the context's plan could refuse it).  The plan is the one the attach runs afterwards
// (vis_moe_plan_request + llama_vis_moe_plan, as `pyvis plan` asks it), with the KV cache upstream is about to
// create, measured by upstream's own code on a no-alloc dry run.
#include "vis-moe.h"
#include "vis-moe-attach-plan.h"
#include "vis-moe-configure.h"
#include "vis-moe-settings.h"
#include "vis-moe-shadow.h"
#include "vis-error.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-memory.h"
#include "llama-model.h"

#include <memory>
#include <stdexcept>
#include <string>

namespace {

// The bytes of the KV cache (every memory module: KV, SWA, recurrent states) that upstream creates for a context
// of n_ctx_seq tokens per sequence: the memory is created on the model's no-alloc path (tensors without data, as
// upstream's --fit probe does) and its breakdown summed.  Its log lines are held back: the real one follows.
int64_t kv_bytes_at(const llama_model & model, const llama_memory_params & pm, llama_cparams cp, uint32_t n_ctx_seq) {
    // llama_context's constructor: one sequence's cells, n_seq_max of them unless the cache is unified
    cp.n_ctx_seq = n_ctx_seq;
    cp.n_ctx     = cp.kv_unified ? n_ctx_seq : n_ctx_seq * cp.n_seq_max;
    struct quiet_no_alloc {
        llama_hparams & hp;
        ggml_log_callback cb = nullptr;
        void * ud = nullptr;
        explicit quiet_no_alloc(llama_hparams & h) : hp(h) {
            llama_log_get(&cb, &ud);
            llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
            hp.no_alloc = true;
        }
        ~quiet_no_alloc() {
            hp.no_alloc = false;
            llama_log_set(cb, ud);
        }
    } guard(const_cast<llama_hparams &>(model.hparams));  // the loaded model's flag, set for this call only
    std::unique_ptr<llama_memory_i> mem(model.create_memory(pm, cp));
    int64_t bytes = 0;
    if (mem) {
        for (const auto & [buft, size] : mem->memory_breakdown()) {
            bytes += (int64_t) size;
        }
    }
    return bytes;
}

std::string mib_up(int64_t b) {
    return std::to_string((b + (1 << 20) - 1) >> 20) + " MiB";
}

} // namespace

void vis_moe_check_kv(const llama_model & model, const llama_memory_params & pm, llama_cparams & cp) {
    const auto & hp = model.hparams;
    if (hp.no_alloc || hp.vocab_only || hp.n_expert == 0) {
        return;  // the --fit probe; no model; a model without routed experts (the --moe-* options are ignored)
    }
    const vis_moe_settings s = vis_moe_settings_current();
    if (s.tier.mem_mib == 0 || s.tier.store != 0) {
        return;  // only under --moe-mem with the file store
    }
    // what the attach will plan: with the whole model loaded (it fits the budget alone) nothing is managed
    vis_moe_attach_plan ap;
    vis_moe_find_moe_layers(model, ap);
    if (!vis_moe_runs_whole(s, ap, model)) {
        vis_moe_choose_managed(model, s, ap);
        vis_moe_plan_shadow(model, s, ap);  // the shadow slots' bytes (the sidecar is loaded again at attach)
        if (!vis_moe_uses_memory_plan(model, s, ap)) {
            return;  // --moe-cache-mib sizes the slots
        }
    }
    auto plan_at = [&](uint32_t n_ctx_seq, struct llama_vis_moe_plan & plan) {
        const llama_vis_moe_plan_request rq =
            vis_moe_plan_request(model, s, ap, cp.n_ubatch, kv_bytes_at(model, pm, cp, n_ctx_seq));
        if (llama_vis_moe_plan(&rq, &plan) != 0) {
            throw std::runtime_error(std::string("vis-moe: ") + llama_vis_last_error());
        }
        return rq;
    };
    // the configurator first: a lower ubatch where it buys slots (or the smallest, for the refusal's numbers)
    vis_moe_configure_ubatch(model, s, ap, cp, kv_bytes_at(model, pm, cp, cp.n_ctx_seq));
    struct llama_vis_moe_plan plan;
    const llama_vis_moe_plan_request rq = plan_at(cp.n_ctx_seq, plan);
    if (plan.ok) {
        return;
    }
    const std::string why = llama_vis_last_error();
    // the largest smaller ubatch (halving down to 16) whose compute buffer lets this context fit the budget
    uint32_t fit_ub = 0;
    for (uint32_t ub = cp.n_ubatch / 2; ub >= 16 && fit_ub == 0; ub /= 2) {
        const llama_vis_moe_plan_request r = vis_moe_plan_request(model, s, ap, ub, rq.kv_bytes);  // the same KV
        struct llama_vis_moe_plan p;
        if (llama_vis_moe_plan(&r, &p) == 0 && p.ok) {
            fit_ub = ub;
        }
    }
    // a model loaded whole (it fits the budget alone) has nothing to page, so the configurator above did not run:
    // where the asked ubatch's compute buffer is what does not fit, that ubatch is lowered instead of refusing
    if (fit_ub > 0 && vis_moe_runs_whole(s, ap, model) && vis_moe_configure_resident_ubatch(model, s, cp, fit_ub)) {
        return;
    }
    // the largest context this budget holds: a multiple of 256 tokens per sequence (upstream pads to it)
    const uint32_t pad = 256, n_seq = cp.kv_unified ? 1 : cp.n_seq_max;
    uint32_t lo = 0, hi = cp.n_ctx_seq / pad;  // lo fits (0: none known), hi does not
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        struct llama_vis_moe_plan p;
        plan_at(mid * pad, p);
        (p.ok ? lo : hi) = mid;
    }
    std::string largest;
    if (lo > 0) {
        largest = "-c " + std::to_string(lo * pad * n_seq);
    } else {
        struct llama_vis_moe_plan p;
        plan_at(pad, p);
        largest = "none (" + std::to_string(pad * n_seq) + " tokens need " + mib_up(p.min_budget) + ")";
    }
    const std::string smaller_ub = fit_ub > 0 ? "; or -ub " + std::to_string(fit_ub) + " at this context" : "";
    const std::string mem = s.tier.mem_mib < 0 ? std::string("auto") : std::to_string(s.tier.mem_mib);
    const std::string msg = "--moe-mem " + mem + ": " + why + (vis_moe_runs_whole(s, ap, model)
                             ? " (the whole model fits the budget alone, so it was loaded whole)" : std::string()) +
                             "; smallest budget for this " + std::to_string(cp.n_ctx_seq * n_seq) + "-token context: " +
                             mib_up(plan.min_budget) + " (KV cache " + mib_up(rq.kv_bytes) +
                             (rq.encoder_bytes > 0 ? ", vision encoder " + mib_up(rq.encoder_bytes) : std::string()) +
                             "); largest context for " +
                             mib_up(plan.budget) + ": " + largest + smaller_ub;
    vis_tell_user(msg);  // llama-bench silences the llama log
    vis_set_last_error("vis-moe: " + msg);  // pyvis.moe.load raises it as VisError
    throw std::runtime_error("vis-moe: " + msg);
}
