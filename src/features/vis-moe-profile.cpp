// vis-moe-profile.cpp - loading calibrated profiles and the model fingerprint (vis-moe-profile.h).
#include "vis-moe-profile.h"
#include "vis-moe-deferred.h"
#include "vis-error.h"
#include "llama-vis.h"

#include "llama-arch.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <sys/stat.h>

namespace {

constexpr uint32_t PROFILE_VERSION = 1;

const vis_profile_kind BUDDY   = { "buddies", "VIS_MOE_SUB_PROFILE", "pyvis calibrate buddies -m MODEL --out FILE" };
const vis_profile_kind PREDICT = { "predictor", "--moe-predict-profile",
                                   "pyvis calibrate predictor -m MODEL --trace FILE (or --corpus TEXT) --out FILE" };
using profile_file = vis_profile_file;

// how an error names the setting and its file: "--moe-shadow FILE" for a flag, "VIS_MOE_SUB_PROFILE=FILE" for a knob
std::string vis_profile_setting(const vis_profile_kind & pk, const std::string & path) {
    return std::string(pk.flag) + (pk.flag[0] == '-' ? " " : "=") + path;
}

} // namespace

const vis_profile_kind VIS_PROFILE_SHADOW = { "shadow", "--moe-shadow", "pyvis shadow MODEL --type TYPE --out FILE" };
const vis_profile_kind VIS_PROFILE_MODALITY = { "modality", "VIS_MOE_CAP_PROFILE",
                                                "pyvis calibrate modality --trace TRACE -m MODEL --out FILE" };

vis_profile_file::~vis_profile_file() {
    if (g) {
        gguf_free(g);
    }
    if (ctx) {
        ggml_free(ctx);
    }
}

std::runtime_error vis_profile_file::error(const std::string & what) const {
    return std::runtime_error("vis-moe: " + vis_profile_setting(pk, path) + ": " + what +
                              "; make one for this model with: " + pk.make);
}

std::string vis_profile_file::str(const char * key) const {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) {
        throw error(std::string("missing key ") + key + " (not a vis profile, or a damaged one)");
    }
    return gguf_get_val_str(g, id);
}

uint64_t vis_profile_file::uint(const char * key) const {
    const int64_t id = gguf_find_key(g, key);
    if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_UINT32) {
        return gguf_get_val_u32(g, id);
    }
    if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_UINT64) {
        return gguf_get_val_u64(g, id);
    }
    throw error(std::string("missing key ") + key + " (not a vis profile, or a damaged one)");
}

const ggml_tensor * vis_profile_file::tensor(const char * name, ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2,
                                             int64_t ne3) const {
    const ggml_tensor * t = ggml_get_tensor(ctx, name);
    if (!t || t->type != type || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != ne3) {
        char buf[320];
        std::snprintf(buf, sizeof(buf), "tensor %s missing or not %s ne = [%lld, %lld, %lld, %lld]", name,
                      ggml_type_name(type), (long long) ne0, (long long) ne1, (long long) ne2, (long long) ne3);
        std::string got = " (the file has ";
        if (t) {
            char b2[200];
            std::snprintf(b2, sizeof(b2), "%s [%lld, %lld, %lld, %lld])", ggml_type_name(t->type),
                          (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3]);
            got += b2;
        } else {
            got += "no such tensor)";
        }
        throw error(buf + got);
    }
    return t;
}

// why `path` cannot be read as GGUF, for the error: missing, a directory, unreadable, no GGUF magic, or truncated
static std::string why_unreadable(const std::string & path) {
    struct stat st = {};
    if (stat(path.c_str(), &st) != 0) {
        return std::string("cannot read it as GGUF: ") + std::strerror(errno);
    }
    if (S_ISDIR(st.st_mode)) {
        return "cannot read it as GGUF: it is a directory, not a file";
    }
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        return std::string("cannot read it as GGUF: cannot open it: ") + std::strerror(errno);
    }
    char magic[4] = {};
    const size_t n = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (n < 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        return "cannot read it as GGUF: not a GGUF file";
    }
    return "cannot read it as GGUF: truncated or damaged";
}

// open `f.path` and check it: a GGUF, a profile of kind f.pk, this build's version, made for `model` (architecture,
// layers, experts, router hash: the first that differs is named)
void vis_profile_open(vis_profile_file & f, const llama_model & model, bool meta_only) {
    gguf_init_params ip = { /*no_alloc =*/ meta_only, /*ctx =*/ &f.ctx };
    f.g = gguf_init_from_file(f.path.c_str(), ip);
    if (!f.g) {
        throw f.error(why_unreadable(f.path));
    }
    const std::string kind = f.str("vis.profile.kind");
    if (kind != f.pk.kind) {
        std::string where;
        for (const vis_profile_kind * o : { &BUDDY, &PREDICT, &VIS_PROFILE_SHADOW, &VIS_PROFILE_MODALITY }) {
            if (kind == o->kind) {
                where = " (it goes to " + std::string(o->flag) + ")";
            }
        }
        throw f.error("is a '" + kind + "' profile, not a '" + f.pk.kind + "' one" + where);
    }
    const uint64_t version = f.uint("vis.profile.version");
    if (version != PROFILE_VERSION) {
        throw f.error("profile version " + std::to_string(version) + ", this build reads version " +
                      std::to_string(PROFILE_VERSION));
    }
    const std::string arch_key = f.str("general.architecture");
    if (arch_key != "vis-profile") {  // every vis sidecar has it (pyvis.runtime.profile.PROFILE_ARCH)
        throw f.error("general.architecture is '" + arch_key + "', a vis sidecar has 'vis-profile' (damaged file)");
    }
    const auto & hp = model.hparams;
    const std::string arch = llm_arch_name(model.arch);
    const std::string p_arch = f.str("vis.model.arch");
    const uint64_t p_layer = f.uint("vis.model.n_layer");
    const uint64_t p_expert = f.uint("vis.model.n_expert");
    auto other_model = [&](const std::string & what) { return f.error("was made for another model (" + what + ")"); };
    if (p_arch != arch) {
        throw other_model("architecture " + p_arch + ", this model is " + arch);
    }
    if (p_layer != hp.n_layer()) {
        throw other_model(std::to_string(p_layer) + " layers, this model has " + std::to_string(hp.n_layer()));
    }
    if (p_expert != hp.n_expert) {
        throw other_model(std::to_string(p_expert) + " experts, this model has " + std::to_string(hp.n_expert));
    }
    const std::string p_hash = f.str("vis.model.router_hash");
    char hash[17];
    std::snprintf(hash, sizeof(hash), "%016llx", (unsigned long long) vis_moe_router_hash(model));
    if (p_hash != hash) {
        throw other_model("router hash " + p_hash + ", this model's is " + hash);
    }
}

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
        bytes.resize(n);
        ggml_backend_tensor_get(t, bytes.data(), 0, n);
        h = h * 0x100000001b3ull + vis_bytes_sum(bytes.data(), n);
        any = true;
    }
    if (!any) {
        throw std::runtime_error("vis-moe: the model has no routers (ffn_gate_inp) to fingerprint: profiles are for MoE models; "
                                 "unset VIS_MOE_SUB_PROFILE / drop --moe-predict-profile for this one");
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
    profile_file f(BUDDY, path);
    vis_profile_open(f, model, false);
    vis_buddy_profile p;
    p.n_layer  = (int) f.uint("vis.model.n_layer");
    p.n_expert = (int) f.uint("vis.model.n_expert");
    p.k_max    = (int) f.uint("vis.buddy.k_max");
    p.k        = (int) f.uint("vis.profile.k");
    if (p.k_max < 1 || p.k_max > p.n_expert) {
        throw f.error("vis.buddy.k_max " + std::to_string(p.k_max) + " outside 1.." + std::to_string(p.n_expert));
    }
    const ggml_tensor * ids = f.tensor("buddy.ids", GGML_TYPE_I32, p.k_max, p.n_expert, p.n_layer);
    const ggml_tensor * q   = f.tensor("buddy.q", GGML_TYPE_F32, p.k_max, p.n_expert, p.n_layer);
    const ggml_tensor * tq  = f.tensor("tae.quantiles", GGML_TYPE_F64, 101, p.n_layer, 1);
    const size_t n = (size_t) p.n_layer * p.n_expert * p.k_max;
    p.ids.assign((const int32_t *) ids->data, (const int32_t *) ids->data + n);
    p.q.assign((const float *) q->data, (const float *) q->data + n);
    p.tae_quantiles.assign((const double *) tq->data, (const double *) tq->data + (size_t) p.n_layer * 101);
    for (size_t i = 0; i < n; ++i) {
        if (p.ids[i] < -1 || p.ids[i] >= p.n_expert) {
            throw f.error("buddy id " + std::to_string(p.ids[i]) + " out of range (damaged file)");
        }
    }
    return p;
}

// the optional MLP of a predictor profile (keys vis.predict.mlp.*, tensors predict.mlp.*; docs/prediction.md)
static void load_mlp(const profile_file & f, vis_predict_profile & p) {
    if (gguf_find_key(f.g, "vis.predict.mlp.lookahead") < 0) {
        return;  // a profile fitted without --mlp: coact / freq only
    }
    auto in = [&](const char * key, uint64_t lo, uint64_t hi) {
        const uint64_t v = f.uint(key);
        if (v < lo || v > hi) {
            throw f.error(std::string(key) + " = " + std::to_string(v) + " outside " + std::to_string(lo) + ".." +
                          std::to_string(hi) + " (damaged file)");
        }
        return (int) v;
    };
    p.mlp_lookahead = in("vis.predict.mlp.lookahead", 1, 64);
    p.mlp_hidden    = in("vis.predict.mlp.hidden", 1, 4096);
    p.mlp_n_embd    = in("vis.predict.mlp.n_embd", 1, 1 << 16);
    p.mlp_history   = in("vis.predict.mlp.history", 1, 64);
    const int64_t id = gguf_find_key(f.g, "vis.predict.mlp.history_decay");
    if (id < 0 || gguf_get_kv_type(f.g, id) != GGUF_TYPE_FLOAT32) {
        throw f.error("missing key vis.predict.mlp.history_decay (damaged file)");
    }
    p.mlp_history_decay = gguf_get_val_f32(f.g, id);
    if (!(p.mlp_history_decay >= 0.0f && p.mlp_history_decay <= 1.0f)) {
        throw f.error("vis.predict.mlp.history_decay outside 0..1 (damaged file)");
    }
    const int64_t L = p.n_layer, E = p.n_expert, H = p.mlp_hidden, D = E + p.mlp_n_embd, O = p.mlp_lookahead * E;
    // numpy [L, a, b] is ne = [b, a, L]; numpy [L, a] is ne = [a, L]
    auto get = [&](const char * name, int64_t ne0, int64_t ne1, int64_t ne2, std::vector<float> & out) {
        const ggml_tensor * t = f.tensor(name, GGML_TYPE_F32, ne0, ne1, ne2);
        out.assign((const float *) t->data, (const float *) t->data + ne0 * ne1 * ne2);
        for (float v : out) {
            if (!std::isfinite(v)) {
                throw f.error(std::string("tensor ") + name + " holds a non-finite value (damaged file)");
            }
        }
    };
    const ggml_tensor * lay = f.tensor("predict.mlp.layers", GGML_TYPE_I32, L, 1, 1);
    p.mlp_layer.assign((const int32_t *) lay->data, (const int32_t *) lay->data + L);
    get("predict.mlp.w1", D, H, L, p.mlp_w1);
    get("predict.mlp.b1", H, L, 1, p.mlp_b1);
    get("predict.mlp.w2", H, O, L, p.mlp_w2);
    get("predict.mlp.b2", O, L, 1, p.mlp_b2);
    for (int64_t il = 0; il < L; ++il) {
        if (p.mlp_layer[il] != 0 && p.mlp_layer[il] != 1) {
            throw f.error("predict.mlp.layers[" + std::to_string(il) + "] is not 0 or 1 (damaged file)");
        }
    }
}

vis_predict_profile vis_predict_profile_load(const std::string & path, const llama_model & model) {
    profile_file f(PREDICT, path);
    vis_profile_open(f, model, false);
    vis_predict_profile p;
    p.path      = path;
    p.n_layer   = (int) f.uint("vis.model.n_layer");
    p.n_expert  = (int) f.uint("vis.model.n_expert");
    p.k         = (int) f.uint("vis.profile.k");
    p.n_tokens  = f.uint("vis.profile.n_tokens");
    const uint64_t W = f.uint("vis.predict.lookahead");
    if (W < 1 || W > 64) {
        throw f.error("vis.predict.lookahead " + std::to_string(W) + " outside 1..64 (damaged file)");
    }
    p.lookahead = (int) W;
    p.weighting = f.str("vis.predict.weighting");
    if (p.weighting != "conditional" && p.weighting != "count") {
        throw f.error("vis.predict.weighting '" + p.weighting + "': expected conditional or count (damaged file)");
    }
    if (p.k < 1 || p.k > p.n_expert) {
        throw f.error("vis.profile.k " + std::to_string(p.k) + " outside 1.." + std::to_string(p.n_expert));
    }
    const int64_t L = p.n_layer, E = p.n_expert;
    const ggml_tensor * fr = f.tensor("expert.freq", GGML_TYPE_F32, E, L, 1);
    const ggml_tensor * co = f.tensor("predict.coact", GGML_TYPE_F32, E, E, L, p.lookahead);
    p.freq.assign((const float *) fr->data, (const float *) fr->data + L * E);
    p.coact.assign((const float *) co->data, (const float *) co->data + (size_t) p.lookahead * L * E * E);
    for (size_t i = 0; i < p.freq.size(); ++i) {
        if (!(p.freq[i] >= 0.0f && p.freq[i] <= 1.0f + 1e-3f)) {
            throw f.error("expert.freq[" + std::to_string(i / E) + ", " + std::to_string(i % E) + "] = " +
                          std::to_string(p.freq[i]) + " is not a share in 0..1 (damaged file)");
        }
    }
    for (size_t r = 0; r < p.coact.size() / E; ++r) {
        double sum = 0;
        bool neg = false;
        for (int64_t j = 0; j < E; ++j) {
            const float v = p.coact[r * E + j];
            sum += v;
            neg = neg || !(v >= 0.0f);
        }
        if (neg || !(sum == 0.0 || std::fabs(sum - 1.0) <= 1e-3)) {
            const size_t i = r % E, il = (r / E) % L, d = r / E / L;
            throw f.error("predict.coact[" + std::to_string(d) + ", " + std::to_string(il) + ", " + std::to_string(i) +
                          "] is not a distribution (sums to " + std::to_string(sum) + ", or has a negative entry; "
                          "damaged file)");
        }
    }
    load_mlp(f, p);
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
