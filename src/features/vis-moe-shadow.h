// vis-moe-shadow.h - shadow experts (--moe-shadow, docs/shadow.md, issue #14): a GGUF sidecar written by
// `pyvis shadow MODEL --type T` with a low-bit copy of every routed expert of some layers, under the model's tensor
// names (blk.L.ffn_{gate,up,down,gate_up}_exps.weight) with the model's ne and the shadow type.
//
// The loader opens the file, checks the shared sidecar header and the model fingerprint (vis-moe-profile.h), and
// checks every expected tensor: present, the model tensor's ne0 / ne1 / n_expert, a quantized type (the file's
// vis.shadow.type), its data inside the file; and the general.architecture every vis sidecar has.  It reads no
// tensor data but the per-expert checksums (tensor vis.shadow.sums, the last; absent in sidecars written before
// them), which the I/O pool checks each shadow expert it reads against (no mmap of the file): what it exposes per
// layer and tensor kind is what a positioned read of one shadow expert needs, as a vis_deferred_tensor that the
// I/O pool (vis-moe-io-pool.h) reads like the model's own deferred experts: fd (and O_DIRECT fd), offset of expert
// 0, bytes per expert (nb2).
//
// The shadow slots that compute from them: vis-moe-shadow-slots.h; when: vis-moe-precision.h.
#pragma once

#include "vis-moe-deferred.h"
#include "vis-moe-feature.h"

#include "ggml.h"

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct llama_model;
struct vis_moe_context;

// the tensor kinds of a layer, in the order of vis-moe-context.h's VIS_T_* (gate, up, down, gate_up)
constexpr int VIS_SHADOW_KINDS = 4;
// the tensor of per-expert checksums, I64 [n_expert, n_tensors - 1]: row j holds vis_bytes_sum of each expert's
// slice of the file's j-th tensor (stored as u64)
constexpr const char * VIS_SHADOW_SUMS = "vis.shadow.sums";

// one shadow tensor of one layer
struct vis_shadow_tensor {
    vis_deferred_tensor src;        // file, name, offs (file offset of expert 0), nb2 (bytes per expert), n_expert
    ggml_type type       = GGML_TYPE_COUNT;  // the shadow type
    ggml_type model_type = GGML_TYPE_COUNT;  // the model tensor's type
    int64_t   ne0 = 0, ne1 = 0;
};

// a feature (vis-moe-feature.h) without hooks: the context owns the sidecar with the other features
struct vis_moe_shadow : public vis_moe_feature {
    const char * feature_name() const override { return "shadow"; }

    std::string path;
    ggml_type   type = GGML_TYPE_COUNT;
    std::shared_ptr<vis_gguf_file> file;
    // [layer][kind]: null where the layer has no such shadow tensor (the model has none, or the layer was not written)
    std::vector<std::array<std::unique_ptr<vis_shadow_tensor>, VIS_SHADOW_KINDS>> layers;
    int     n_layers    = 0;   // layers with shadow tensors
    int64_t bytes       = 0;   // shadow bytes of those layers
    int64_t model_bytes = 0;   // the model's bytes of the same tensors
    bool    checked     = false;  // the file has per-expert checksums: each read is checked against them

    // the shadow tensor of layer il and kind k (VIS_T_*), or null
    const vis_shadow_tensor * get(int il, int k) const;
    // bytes of one shadow expert of layer il (all its kinds), 0 if the layer has no shadow
    size_t expert_bytes(int il) const;
};

// Open and check `path` against `model`: every routed-expert tensor of the layers in `need` (the context's managed
// layers) must be in the file.  Throws std::runtime_error naming --moe-shadow, the file, what is wrong and the fix.
std::unique_ptr<vis_moe_shadow> vis_moe_shadow_load(const std::string & path, const llama_model & model,
                                                    const std::vector<int> & need);

// --moe-shadow at context creation: the log line of the sidecar attach loaded into vm.shadow (type, layers, bytes,
// whether --moe-precision uses it).  No managed layer: a note that it was not read.
void vis_moe_shadow_attach(const vis_moe_context & vm, const std::string & path, bool used);
