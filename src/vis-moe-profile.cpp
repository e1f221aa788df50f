// vis-moe-profile.cpp - loading calibrated profiles and the model fingerprint (vis-moe-profile.h).
#include "vis-moe-profile.h"
#include "vis-error.h"
#include "llama-vis.h"

#include "llama-arch.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace {

constexpr uint32_t PROFILE_VERSION = 1;

struct gguf_holder {
    gguf_context * g   = nullptr;
    ggml_context * ctx = nullptr;
    ~gguf_holder() {
        if (g) {
            gguf_free(g);
        }
        if (ctx) {
            ggml_free(ctx);
        }
    }
};

std::runtime_error profile_error(const std::string & path, const std::string & what) {
    return std::runtime_error("vis-moe: --moe-sub-profile " + path + ": " + what);
}

const char * const FIX = "; make one for this model with: pyvis calibrate buddies -m MODEL --out FILE";

std::string get_str(const gguf_holder & h, const std::string & path, const char * key) {
    const int64_t id = gguf_find_key(h.g, key);
    if (id < 0 || gguf_get_kv_type(h.g, id) != GGUF_TYPE_STRING) {
        throw profile_error(path, std::string("missing key ") + key + " (not a vis profile, or a damaged one)" + FIX);
    }
    return gguf_get_val_str(h.g, id);
}

uint64_t get_uint(const gguf_holder & h, const std::string & path, const char * key) {
    const int64_t id = gguf_find_key(h.g, key);
    if (id >= 0 && gguf_get_kv_type(h.g, id) == GGUF_TYPE_UINT32) {
        return gguf_get_val_u32(h.g, id);
    }
    if (id >= 0 && gguf_get_kv_type(h.g, id) == GGUF_TYPE_UINT64) {
        return gguf_get_val_u64(h.g, id);
    }
    throw profile_error(path, std::string("missing key ") + key + " (not a vis profile, or a damaged one)" + FIX);
}

const ggml_tensor * get_tensor(const gguf_holder & h, const std::string & path, const char * name, ggml_type type,
                               int64_t ne0, int64_t ne1, int64_t ne2) {
    const ggml_tensor * t = ggml_get_tensor(h.ctx, name);
    if (!t || t->type != type || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        char buf[256];
        std::snprintf(buf, sizeof(buf), "tensor %s missing or not %s [%lld, %lld, %lld]", name, ggml_type_name(type),
                      (long long) ne0, (long long) ne1, (long long) ne2);
        throw profile_error(path, buf + std::string(FIX));
    }
    return t;
}

} // namespace

uint64_t vis_moe_router_hash(const llama_model & model) {
    uint64_t h = 0xcbf29ce484222325ull;
    bool any = false;
    std::vector<uint8_t> bytes;
    for (size_t il = 0; il < model.layers.size(); ++il) {
        const ggml_tensor * t = model.layers[il].ffn_gate_inp;
        if (!t) {
            continue;
        }
        if (!t->buffer || !t->data) {
            throw std::runtime_error("vis-moe: router of layer " + std::to_string(il) + " has no data to fingerprint: load the model with its weights "
                                     "(not a vocab-only or no-alloc load) to check a profile against it");
        }
        if (std::strstr(ggml_backend_buffer_name(t->buffer), "REPACK")) {
            throw std::runtime_error("vis-moe: router of layer " + std::to_string(il) +
                                     " is repacked for this CPU; its stored bytes cannot be fingerprinted (use --no-repack)");
        }
        const size_t n = ggml_nbytes(t);
        bytes.assign((n + 3) & ~(size_t) 3, 0);
        ggml_backend_tensor_get(t, bytes.data(), 0, n);
        uint64_t sum = (uint64_t) n;
        for (size_t i = 0; i < bytes.size() / 4; ++i) {
            uint32_t w;
            std::memcpy(&w, bytes.data() + 4 * i, 4);  // little endian hosts only (x86-64, aarch64)
            sum += ((uint64_t) w + 1) * (2 * (uint64_t) i + 1);
        }
        h = h * 0x100000001b3ull + sum;
        any = true;
    }
    if (!any) {
        throw std::runtime_error("vis-moe: the model has no routers (ffn_gate_inp) to fingerprint: profiles are for MoE models; "
                                 "drop --moe-sub-profile for this one");
    }
    return h;
}

double vis_buddy_profile::tae_percentile(int il, double pct) const {
    const double * qs = tae_quantiles.data() + (size_t) il * 101;
    const double x = std::min(100.0, std::max(0.0, pct));
    const int lo = (int) std::floor(x);
    const int hi = std::min(100, lo + 1);
    const double f = x - lo;
    return qs[lo] + (qs[hi] - qs[lo]) * f;
}

vis_buddy_profile vis_buddy_profile_load(const std::string & path, const llama_model & model) {
    gguf_holder h;
    gguf_init_params ip = { /*no_alloc =*/ false, /*ctx =*/ &h.ctx };
    h.g = gguf_init_from_file(path.c_str(), ip);
    if (!h.g) {
        throw profile_error(path, "cannot read it as GGUF (missing, unreadable, truncated or not a GGUF file)" +
                                      std::string(FIX));
    }
    const std::string kind = get_str(h, path, "vis.profile.kind");
    if (kind != "buddies") {
        throw profile_error(path, "is a '" + kind + "' profile, not a buddy profile" + FIX);
    }
    const uint64_t version = get_uint(h, path, "vis.profile.version");
    if (version != PROFILE_VERSION) {
        throw profile_error(path, "profile version " + std::to_string(version) + ", this build reads version " +
                                      std::to_string(PROFILE_VERSION) + FIX);
    }
    const auto & hp = model.hparams;
    const std::string arch = llm_arch_name(model.arch);
    const std::string p_arch = get_str(h, path, "vis.model.arch");
    const uint64_t p_layer = get_uint(h, path, "vis.model.n_layer");
    const uint64_t p_expert = get_uint(h, path, "vis.model.n_expert");
    auto other_model = [&](const std::string & what) {
        return profile_error(path, "was made for another model (" + what + ")" + FIX);
    };
    if (p_arch != arch) {
        throw other_model("architecture " + p_arch + ", this model is " + arch);
    }
    if (p_layer != hp.n_layer()) {
        throw other_model(std::to_string(p_layer) + " layers, this model has " + std::to_string(hp.n_layer()));
    }
    if (p_expert != hp.n_expert) {
        throw other_model(std::to_string(p_expert) + " experts, this model has " + std::to_string(hp.n_expert));
    }
    const std::string p_hash = get_str(h, path, "vis.model.router_hash");
    char hash[17];
    std::snprintf(hash, sizeof(hash), "%016llx", (unsigned long long) vis_moe_router_hash(model));
    if (p_hash != hash) {
        throw other_model("router hash " + p_hash + ", this model's is " + hash);
    }

    vis_buddy_profile p;
    p.n_layer  = (int) p_layer;
    p.n_expert = (int) p_expert;
    p.k_max    = (int) get_uint(h, path, "vis.buddy.k_max");
    p.k        = (int) get_uint(h, path, "vis.profile.k");
    if (p.k_max < 1 || p.k_max > p.n_expert) {
        throw profile_error(path, "vis.buddy.k_max " + std::to_string(p.k_max) + " outside 1.." +
                                      std::to_string(p.n_expert) + FIX);
    }
    const ggml_tensor * ids = get_tensor(h, path, "buddy.ids", GGML_TYPE_I32, p.k_max, p.n_expert, p.n_layer);
    const ggml_tensor * q   = get_tensor(h, path, "buddy.q", GGML_TYPE_F32, p.k_max, p.n_expert, p.n_layer);
    const ggml_tensor * tq  = get_tensor(h, path, "tae.quantiles", GGML_TYPE_F64, 101, p.n_layer, 1);
    const size_t n = (size_t) p.n_layer * p.n_expert * p.k_max;
    p.ids.assign((const int32_t *) ids->data, (const int32_t *) ids->data + n);
    p.q.assign((const float *) q->data, (const float *) q->data + n);
    p.tae_quantiles.assign((const double *) tq->data, (const double *) tq->data + (size_t) p.n_layer * 101);
    for (size_t i = 0; i < n; ++i) {
        if (p.ids[i] < -1 || p.ids[i] >= p.n_expert) {
            throw profile_error(path, "buddy id " + std::to_string(p.ids[i]) + " out of range (damaged file)" + FIX);
        }
    }
    return p;
}

// ---- C API ---------------------------------------------------------------------
int32_t llama_vis_moe_router_hash(const llama_model * model, uint64_t * out) {
    vis_clear_last_error();
    if (!model || !out) {
        vis_set_last_error("llama_vis_moe_router_hash: NULL model or output");
        return -1;
    }
    try {
        *out = vis_moe_router_hash(*model);
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        return -1;
    }
    return 0;
}
