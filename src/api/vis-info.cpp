// vis-info.cpp - fork identity and a model's MoE shape (llama-vis.h).
#include "llama-vis.h"

#include "llama-model.h"

#include <algorithm>
#include <string>

#ifndef VIS_MOE_VERSION
#define VIS_MOE_VERSION "0.0.0-dev"
#endif
#ifndef VIS_UPSTREAM_COMMIT
#define VIS_UPSTREAM_COMMIT "unknown"
#endif

const char * llama_vis_version(void) {
    return VIS_MOE_VERSION;
}

const char * llama_vis_upstream_commit(void) {
    return VIS_UPSTREAM_COMMIT;
}

const char * llama_vis_system_info(void) {
    static const std::string s = std::string("VIS_MOE : VERSION = ") + VIS_MOE_VERSION +
                                 " | UPSTREAM = " + VIS_UPSTREAM_COMMIT + " | ";
    return s.c_str();
}

static int64_t expert_slice_bytes(const ggml_tensor * t) {
    // expert e of a *_exps tensor is the contiguous range [e*nb[2], (e+1)*nb[2])
    return t ? (int64_t) t->nb[2] : 0;
}

int32_t llama_vis_model_moe_info(const llama_model * model, llama_vis_moe_info * info) {
    if (model == nullptr || info == nullptr) {
        return -1;
    }
    const auto & hp = model->hparams;
    *info = {};
    info->n_layer         = (int32_t) hp.n_layer();
    info->first_moe_layer = -1;
    info->n_expert        = (int32_t) hp.n_expert;
    info->n_expert_used   = hp.n_expert > 0 ? (int32_t) hp.n_expert_used_max() : 0;
    info->n_expert_shared = (int32_t) hp.n_expert_shared;

    for (int32_t il = 0; il < (int32_t) model->layers.size(); ++il) {
        const auto & l = model->layers[il];
        const bool moe = l.ffn_gate_exps || l.ffn_up_exps || l.ffn_down_exps || l.ffn_gate_up_exps;
        if (l.ffn_gate_shexp || l.ffn_up_shexp || l.ffn_down_shexp) {
            info->has_shared_exp = 1;
        }
        if (!moe) {
            continue;
        }
        info->n_moe_layers++;
        if (info->first_moe_layer < 0) {
            info->first_moe_layer = il;
        }
        if (l.ffn_gate_exps_b || l.ffn_up_exps_b || l.ffn_down_exps_b || l.ffn_gate_up_exps_b) {
            info->has_exp_bias = 1;
        }
        if (l.ffn_gate_up_exps) {
            info->has_gate_up_exp = 1;
        }
        const int64_t eb = expert_slice_bytes(l.ffn_gate_exps) + expert_slice_bytes(l.ffn_up_exps) +
                           expert_slice_bytes(l.ffn_down_exps) + expert_slice_bytes(l.ffn_gate_up_exps);
        info->expert_bytes = std::max(info->expert_bytes, eb);
        for (const ggml_tensor * t : { l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps, l.ffn_gate_up_exps }) {
            info->routed_bytes += t ? (int64_t) ggml_nbytes(t) : 0;
        }
    }
    return 0;
}
