// vis-moe-attach-plan.cpp - what a context's expert cache will be, from the loaded model and the settings
// (vis-moe-attach-plan.h): the attach and the check before the KV cache ask the --moe-mem plan the same question.
#include "vis-moe-attach-plan.h"
#include "vis-moe.h"
#include "vis-moe-context.h"
#include "vis-moe-deferred.h"
#include "vis-moe-encoder.h"
#include "vis-moe-shadow.h"
#include "vis-moe-split.h"
#include "vis-moe-upload.h"

#include "llama-model.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

int64_t vis_moe_layer_expert_bytes(const llama_layer & l) {
    int64_t b = 0;
    for (const ggml_tensor * t : vis_moe_expert_tensors(l)) {
        b += t ? (int64_t) t->nb[2] : 0;
    }
    return b;
}

bool vis_moe_layer_has_expert_scales(const llama_layer & l) {
    return l.ffn_gate_exps_s || l.ffn_up_exps_s || l.ffn_down_exps_s;
}

bool vis_moe_row_gathered(const llama_model & model, const ggml_tensor * t) {
    return t == model.tok_embd && model.output != nullptr &&
           std::strcmp(ggml_get_name(model.output), ggml_get_name(model.tok_embd)) != 0;  // tied: same name
}

void vis_moe_find_moe_layers(const llama_model & model, vis_moe_attach_plan & ap) {
    const int n_layer = (int) model.hparams.n_layer();
    ap.deferred.assign(n_layer, false);
    for (int il = 0; il < n_layer && il < (int) model.layers.size(); ++il) {
        bool moe = false;
        for (const ggml_tensor * t : vis_moe_expert_tensors(model.layers[il])) {
            moe = moe || t != nullptr;
            if (t && vis_moe_deferred(t)) {
                ap.deferred[il] = ap.any_deferred = true;
            }
        }
        if (moe) {
            ap.moe_layers.push_back(il);
        }
    }
}

bool vis_moe_runs_whole(const vis_moe_settings & s, const vis_moe_attach_plan & ap, const llama_model & model) {
    return vis_moe_settings_mem_only(s) && !ap.any_deferred && model.hparams.n_expert > 0;
}

void vis_moe_choose_managed(const llama_model & model, const vis_moe_settings & s, vis_moe_attach_plan & ap) {
    const int n_moe = (int) ap.moe_layers.size();
    ap.pinned = s.params.n_pinned < 0 ? n_moe : s.params.n_pinned;
    if (ap.pinned > n_moe) {
        throw std::runtime_error("--moe-pinned-layers " + std::to_string(s.params.n_pinned) + " exceeds the model's " +
                                 std::to_string(n_moe) + " MoE layers (valid: 0.." + std::to_string(n_moe) + ", -1 = all)");
    }
    ap.managed.clear();
    ap.unpaged.clear();
    for (auto it = ap.moe_layers.begin() + ap.pinned; it != ap.moe_layers.end(); ++it) {
        (vis_moe_layer_has_expert_scales(model.layers[*it]) ? ap.unpaged : ap.managed).push_back(*it);
    }
    for (int il : ap.moe_layers) {
        if (ap.deferred[il] && std::find(ap.managed.begin(), ap.managed.end(), il) == ap.managed.end()) {
            throw std::runtime_error("vis-moe: layer " + std::to_string(il) + " was deferred to the file at load but is pinned "
                                     "now; create contexts with the --moe-pinned-layers the model was loaded with");
        }
    }
    for (int il : ap.managed) {
        const int64_t b = vis_moe_layer_expert_bytes(model.layers[il]);
        ap.per_slot += b;
        ap.exp_max   = std::max(ap.exp_max, b);
        for (const ggml_tensor * t : vis_moe_expert_tensors(model.layers[il])) {
            ap.slice_max = std::max(ap.slice_max, t ? (int64_t) t->nb[2] : 0);
            ap.n_slab_tensors += t ? 1 : 0;
        }
        ggml_backend_dev_t dev = model.dev_layer(il);
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            ap.all_host_devices = ap.all_host_devices && vis_igpu_unified(dev);
        }
    }
    if (s.tier.unified == 1 && !ap.all_host_devices) {
        throw std::runtime_error("--moe-unified on: the slabs' device is not CPU-writable memory; it needs the CPU backend or "
                                 "an integrated GPU (Jetson) with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1 (use auto or off)");
    }
    // CPU-only run: passes skip other passes' pairs (patch 0006), so no staging slot; with a GPU present the
    // scheduler may offload a host-weight mul_mat_id, and other passes' pairs go to one staging slot per layer
    ap.cpu_only = model.devices.empty();
    ap.staging  = ap.cpu_only ? 0 : 1;
}

std::string vis_moe_unpaged_line(const llama_model & model, const vis_moe_attach_plan & ap) {
    std::string layers;
    int64_t bytes = 0;
    for (int il : ap.unpaged) {
        layers += (layers.empty() ? "" : ",") + std::to_string(il);
        bytes += (int64_t) model.hparams.n_expert * vis_moe_layer_expert_bytes(model.layers[il]);
    }
    const llama_layer & l = model.layers[ap.unpaged.front()];
    const ggml_tensor * s = l.ffn_gate_exps_s ? l.ffn_gate_exps_s : l.ffn_up_exps_s ? l.ffn_up_exps_s : l.ffn_down_exps_s;
    char mib[32];
    std::snprintf(mib, sizeof(mib), "%.1f", bytes / 1048576.0);
    return "layer" + std::string(ap.unpaged.size() > 1 ? "s " : " ") + layers +
           (ap.unpaged.size() > 1 ? " run" : " runs") + " upstream's path with " +
           "every expert resident (" + mib + " MiB): per-expert scales (" + ggml_get_name(s) + ") are a layout the " +
           "expert cache does not page";
}

std::unique_ptr<vis_moe_shadow> vis_moe_plan_shadow(const llama_model & model, const vis_moe_settings & s,
                                                    vis_moe_attach_plan & ap) {
    if (s.prec.shadow.empty() || model.hparams.no_alloc || ap.managed.empty()) {
        return nullptr;
    }
    auto shadow = vis_moe_shadow_load(s.prec.shadow, model, ap.managed);  // throws on a bad sidecar
    if (s.prec.on()) {
        ap.shadow_per_slot = 0;
        for (int il : ap.managed) {
            ap.shadow_per_slot += (int64_t) shadow->expert_bytes(il);
        }
        ap.shadow_slots = s.prec.shadow_slots;
    }
    return shadow;
}

std::vector<int> vis_moe_managed_positions(const vis_moe_attach_plan & ap) {
    std::vector<int> pos;
    for (int il : ap.managed) {
        pos.push_back((int) (std::find(ap.moe_layers.begin(), ap.moe_layers.end(), il) - ap.moe_layers.begin()));
    }
    return pos;
}

std::string vis_moe_apply_slot_split(const llama_model & model, const vis_moe_settings & s, vis_moe_attach_plan & ap) {
    ap.layer_slots.clear();
    const int n_exp = (int) model.hparams.n_expert;
    const bool extra = ap.extra_slots > 0 && ap.n_slots < n_exp;
    if ((s.plan.slot_split.empty() && !extra) || ap.managed.empty() || model.hparams.no_alloc) {
        return "";
    }
    const std::vector<int> pos = vis_moe_managed_positions(ap);
    std::vector<int64_t> row;
    for (int il : ap.managed) {
        row.push_back(vis_moe_layer_expert_bytes(model.layers[il]));
    }
    std::vector<int> got(ap.managed.size(), std::min(ap.n_slots, n_exp));
    std::vector<double> cv;  // the file's curves of the managed layers
    std::string out;
    if (!s.plan.slot_split.empty()) {
        const vis_moe_split_file f = vis_moe_split_file_load(s.plan.slot_split, (int) ap.moe_layers.size(), n_exp);
        if (ap.n_slots >= n_exp) {
            return "VIS_MOE_SLOT_SPLIT " + s.plan.slot_split + ": not applied: every managed layer holds all " +
                   std::to_string(n_exp) + " experts";
        }
        cv  = vis_moe_split_curves(f, pos);
        got = vis_moe_split_apply(f, pos, ap.n_slots, row);
        int lo = n_exp, hi = 0;
        int64_t even = 0, split = 0;
        std::string list;
        for (size_t i = 0; i < got.size(); ++i) {
            list += (i ? "," : "") + std::to_string(got[i]);
            lo = std::min(lo, got[i]);
            hi = std::max(hi, got[i]);
            even  += (int64_t) ap.n_slots * row[i];
            split += (int64_t) got[i] * row[i];
        }
        char mib[96];
        std::snprintf(mib, sizeof(mib), "%.2f MiB of slots against %.2f MiB equal", split / 1048576.0, even / 1048576.0);
        out = "VIS_MOE_SLOT_SPLIT " + s.plan.slot_split + ": " + std::to_string(ap.n_slots) + " slots per layer split " +
              std::to_string(lo) + ".." + std::to_string(hi) + " by its miss curves (" + mib + "); managed layers " +
              std::to_string(ap.managed.front()) + ".." + std::to_string(ap.managed.back()) + ": " + list;
    }
    if (extra) {
        std::vector<int32_t> in(got.begin(), got.end()), res(got.size());
        if (llama_vis_moe_extra_slots(cv.empty() ? nullptr : cv.data(), (int32_t) got.size(), n_exp, in.data(),
                                      ap.extra_slots, res.data()) != 0) {
            throw std::runtime_error(std::string("vis-moe: ") + llama_vis_last_error());
        }
        std::string list;
        int n_more = 0;
        for (size_t i = 0; i < res.size(); ++i) {
            if (res[i] > got[i]) {
                list += (n_more++ ? "," : "") + std::to_string(ap.managed[i]);
            }
            got[i] = res[i];
        }
        out += std::string(out.empty() ? "" : "\n") + "--moe-mem: the bytes left after whole slot rows give one more slot "
               "to " + std::to_string(n_more) + " of " + std::to_string(got.size()) + " managed layers (" +
               (cv.empty() ? "spread over depth" : "by the split file's curves") + "): " + list;
    }
    ap.layer_slots.assign(model.layers.size(), 0);
    for (size_t i = 0; i < ap.managed.size(); ++i) {
        ap.layer_slots[ap.managed[i]] = got[i];
    }
    return out;
}

bool vis_moe_uses_memory_plan(const llama_model & model, const vis_moe_settings & s, const vis_moe_attach_plan & ap) {
    return s.tier.mem_mib != 0 && !model.hparams.no_alloc && !(s.params.cache_mib > 0 && !ap.managed.empty());
}

llama_vis_moe_plan_request vis_moe_plan_request(const llama_model & model, const vis_moe_settings & s,
                                                const vis_moe_attach_plan & ap, int64_t n_ubatch, int64_t kv_bytes) {
    const int n_exp = (int) model.hparams.n_expert;
    int64_t model_bytes = 0, deferred_bytes = 0;
    // weights that stay resident: every tensor but the deferred experts (mapped buffers span file ranges, so
    // buffer sizes would overcount)
    for (const auto & [name, t] : model.tensors_by_name) {
        if (!vis_moe_row_gathered(model, t)) {
            model_bytes += (int64_t) ggml_nbytes(t);
        }
    }
    for (int il : ap.managed) {
        if (ap.deferred[il]) {
            deferred_bytes += (int64_t) n_exp * vis_moe_layer_expert_bytes(model.layers[il]);
        }
    }
    // --moe-slots >= experts on layers loaded whole: every expert has a slot, none pages (upstream's graph runs,
    // no slab is made): the plan with nothing to page, as with every layer pinned
    const bool none_pages = ap.managed.empty() || (s.params.n_slots >= n_exp && !ap.any_deferred);
    const auto & hp = model.hparams;
    llama_vis_moe_plan_request rq = {};
    rq.budget           = s.tier.mem_mib > 0 ? (s.tier.mem_mib << 20) : 0;
    rq.resident_bytes   = std::max<int64_t>(0, model_bytes - deferred_bytes) +
                          (ap.shadow_slots > 0 ? (int64_t) ap.shadow_slots * ap.shadow_per_slot : 0);
    rq.kv_bytes         = kv_bytes;
    rq.reserve_bytes    = llama_vis_moe_estimate_reserve(n_ubatch, model.vocab.n_tokens(), hp.n_embd,
                                                         hp.n_expert_used_max(), hp.n_ff_exp());
    rq.expert_bytes     = none_pages ? 0 : (ap.per_slot + (ap.shadow_slots > 0 ? 0 : ap.shadow_per_slot)) /
                                           (int64_t) ap.managed.size();
    rq.n_managed_layers = none_pages ? 0 : (int32_t) ap.managed.size();
    rq.n_expert         = n_exp;
    rq.n_expert_used    = (int32_t) hp.n_expert_used_max();
    rq.unified          = ap.all_host_devices ? 1 : 0;
    rq.host_mib         = s.tier.host_mib;
    rq.n_slots          = s.params.n_slots;
    rq.no_staging       = ap.cpu_only ? 1 : 0;
    rq.encoder_bytes    = vis_moe_encoder_bytes();  // a VLM tool's --mmproj, handed over before the model
    if (!none_pages && ap.any_deferred) {
        // experts read from the file: bounce buffers, and the slabs placed for reads in place
        rq.io_bytes = llama_vis_moe_io_buffer_bytes(s.tier.io_threads, ap.slice_max, ap.n_slab_tensors);
    }
    if (!ap.all_host_devices && !none_pages) {
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(model.dev_layer(ap.managed.front()), &free, &total);
        rq.device_bytes = (int64_t) (free * 9 / 10);
    }
    return rq;
}
