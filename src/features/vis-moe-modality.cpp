// vis-moe-modality.cpp - image tokens, MACS weights and the modality profile (vis-moe-modality.h).
#include "vis-moe-modality.h"
#include "vis-moe-context.h"
#include "vis-moe-profile.h"
#include "vis-error.h"

#include "llama-batch.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

void vis_macs_weights(const float * embd, int64_t n_tokens, int64_t n_embd, int64_t stride, double delta, float * w) {
    if (n_tokens <= 0) {
        return;
    }
    std::vector<double> h(n_tokens, 0.0);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float * z = embd + t * stride;
        double zmax = -INFINITY;
        for (int64_t i = 0; i < n_embd; ++i) {
            zmax = std::max(zmax, (double) z[i]);
        }
        double sum = 0, dot = 0;  // H = log(sum e^(z - zmax)) - sum p (z - zmax)
        for (int64_t i = 0; i < n_embd; ++i) {
            const double e = std::exp((double) z[i] - zmax);
            sum += e;
            dot += e * ((double) z[i] - zmax);
        }
        h[t] = std::isfinite(sum) && sum > 0 ? std::log(sum) - dot / sum : 0.0;
    }
    double mean = 0;
    for (double x : h) {
        mean += x;
    }
    mean /= (double) n_tokens;
    double var = 0;
    for (double x : h) {
        var += (x - mean) * (x - mean);
    }
    const double sd = std::sqrt(var / (double) n_tokens);  // population std, as numpy's default
    for (int64_t t = 0; t < n_tokens; ++t) {
        const double zt = (h[t] - mean) / (sd + 1e-6);
        w[t] = (float) (1.0 / (1.0 + std::exp(delta * zt)));
    }
}

void vis_moe_modality::begin_ubatch(const llama_ubatch & ub, int64_t n_embd) {
    any_image = ub.embd != nullptr && ub.token == nullptr;
    image_tok.assign(ub.n_tokens, any_image ? 1 : 0);
    weight.assign(ub.n_tokens, 1.0f);
    if (any_image && n_embd > 0) {
        vis_macs_weights(ub.embd, ub.n_tokens, n_embd, n_embd, delta, weight.data());
    }
}

vis_modality_profile vis_modality_profile_load(const std::string & path, const llama_model & model) {
    vis_profile_file f(VIS_PROFILE_MODALITY, path);
    vis_profile_open(f, model, /*meta_only =*/ false);
    const int64_t n_layer = model.hparams.n_layer(), n_expert = model.hparams.n_expert;
    const ggml_tensor * t = f.tensor("modality.label", GGML_TYPE_I32, n_expert, n_layer, 1);
    vis_modality_profile p;
    p.path     = path;
    p.n_layer  = (int) n_layer;
    p.n_expert = (int) n_expert;
    p.bias.assign((size_t) (n_layer * n_expert), VIS_BIAS_SHARED);
    const int32_t * lab = (const int32_t *) t->data;
    for (int64_t i = 0; i < n_layer * n_expert; ++i) {
        // labels of pyvis.runtime.modality_profile.LABELS: unused, text, shared, visual, unknown
        if (lab[i] < 0 || lab[i] > 4) {
            throw f.error("modality.label holds " + std::to_string(lab[i]) + ", outside 0..4 (damaged file)");
        }
        p.bias[i] = lab[i] == 3 ? VIS_BIAS_VISUAL : lab[i] == 1 ? VIS_BIAS_TEXT : VIS_BIAS_SHARED;
    }
    return p;
}

void vis_moe_modality::ubatch_begin(vis_moe_context & vm, const llama_ubatch & ub) {
    begin_ubatch(ub, (int64_t) vm.model->hparams.n_embd_inp());
    vm.ub_image = has_image();
}
