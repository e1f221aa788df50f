// vis-moe-topk.cpp - fewer experts per token (--moe-topk, vis-moe-topk.h).
#include "vis-moe-topk.h"
#include "vis-moe.h"
#include "vis-moe-context.h"
#include "vis-moe-settings.h"

#include "llama-model.h"

#include <stdexcept>
#include <string>

int vis_moe_topk_attach(const vis_moe_settings & s, const llama_model & model) {
    const int k = (int) model.hparams.n_expert_used_max();
    if (s.topk <= 0 || s.topk == k) {
        return k;
    }
    if (s.topk > k) {
        throw std::invalid_argument("--moe-topk " + std::to_string(s.topk) + ": the model runs " + std::to_string(k) +
                                    " experts per token; give 1.." + std::to_string(k) + " (or 0 = off)");
    }
    return s.topk;
}

void vis_moe_topk_note(vis_moe_context & vm, int k) {
    vm.note("--moe-topk " + std::to_string(vm.topk) + ": each token runs its " + std::to_string(vm.topk) +
            " highest-weighted experts instead of the model's " + std::to_string(k) +
            " (lossy: outputs differ from the model's)");
}

int64_t vis_moe_n_expert_used(const vis_moe_context * vm, int64_t n_expert_used) {
    return vm && vm->topk > 0 && vm->topk < n_expert_used ? vm->topk : n_expert_used;
}
