// vis-moe-shadow.cpp - loading and checking a shadow-expert sidecar (vis-moe-shadow.h, docs/shadow.md).
#include "vis-moe-shadow.h"
#include "vis-moe-context.h"
#include "vis-moe-profile.h"

#include "llama-impl.h"

#include "llama-model.h"

#include "ggml.h"
#include "gguf.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <unistd.h>


namespace {

static_assert(VIS_SHADOW_KINDS == VIS_T_COUNT, "shadow tensor kinds are the expert tensors' VIS_T_* kinds");

std::string ne_str(int64_t a, int64_t b, int64_t c) {
    return "[" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + "]";
}

// the per-expert checksums of tensor "vis.shadow.sums" (pyvis shadow writes it last: row j holds the experts of
// the file's j-th tensor), read from the file; empty for a sidecar written before there were checksums
std::vector<uint64_t> read_sums(const vis_profile_file & f, const vis_gguf_file & file, size_t data0,
                                int64_t n_expert) {
    const int64_t id = gguf_find_tensor(f.g, VIS_SHADOW_SUMS);
    if (id < 0) {
        return {};
    }
    const int64_t n_tensors = gguf_get_n_tensors(f.g);
    const ggml_tensor * t = ggml_get_tensor(f.ctx, VIS_SHADOW_SUMS);
    if (!t || t->type != GGML_TYPE_I64 || id != n_tensors - 1 || t->ne[0] != n_expert || t->ne[1] != n_tensors - 1 ||
        t->ne[2] != 1 || t->ne[3] != 1) {
        throw f.error(std::string("tensor ") + VIS_SHADOW_SUMS + " is not the last tensor, I64 [" +
                      std::to_string(n_expert) + " experts, " + std::to_string(n_tensors - 1) + " tensors] (damaged file)");
    }
    const uint64_t off = (uint64_t) data0 + gguf_get_tensor_offset(f.g, id);
    const size_t bytes = ggml_nbytes(t);
    if (off + bytes > file.size) {
        throw f.error(std::string("tensor ") + VIS_SHADOW_SUMS + " ends at byte " + std::to_string(off + bytes) +
                      ", past the end of the file (" + std::to_string(file.size) + " bytes): truncated");
    }
    std::vector<uint64_t> sums(bytes / sizeof(uint64_t));
    size_t done = 0;
    while (done < bytes) {
        const ssize_t r = pread(file.fd, (char *) sums.data() + done, bytes - done, (off_t) (off + done));
        if (r <= 0) {
            throw f.error(std::string("cannot read tensor ") + VIS_SHADOW_SUMS + ": " +
                          (r == 0 ? "unexpected end of file" : std::strerror(errno)));
        }
        done += (size_t) r;
    }
    return sums;
}

} // namespace

const vis_shadow_tensor * vis_moe_shadow::get(int il, int k) const {
    if (il < 0 || il >= (int) layers.size() || k < 0 || k >= VIS_SHADOW_KINDS) {
        return nullptr;
    }
    return layers[il][k].get();
}

size_t vis_moe_shadow::expert_bytes(int il) const {
    size_t b = 0;
    for (int k = 0; k < VIS_SHADOW_KINDS; ++k) {
        const vis_shadow_tensor * t = get(il, k);
        b += t ? t->src.nb2 : 0;
    }
    return b;
}

std::unique_ptr<vis_moe_shadow> vis_moe_shadow_load(const std::string & path, const llama_model & model,
                                                    const std::vector<int> & need) {
    vis_profile_file f(VIS_PROFILE_SHADOW, path);
    vis_profile_open(f, model, /*meta_only =*/ true);
    // the descriptors of the reads; every tensor is checked against the size of the file they read (a file
    // replaced after this point is caught at read time by vis_gguf_file::check_unchanged)
    std::string err;
    auto file = vis_gguf_file_open(path, err);  // buffered and O_DIRECT descriptors, as for the model's own experts
    if (!file) {
        throw f.error("cannot open it for expert reads: " + err);
    }
    auto sh = std::make_unique<vis_moe_shadow>();
    sh->path = path;
    sh->file = file;
    const std::string tname = f.str("vis.shadow.type");
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && strcasecmp(n, tname.c_str()) == 0) {
            sh->type = (ggml_type) t;
        }
    }
    if (sh->type == GGML_TYPE_COUNT || !ggml_is_quantized(sh->type)) {
        throw f.error("vis.shadow.type '" + tname + "' is not a quantized ggml type (damaged file)");
    }
    const size_t data0 = gguf_get_data_offset(f.g);
    const std::vector<uint64_t> sums = read_sums(f, *file, data0, model.hparams.n_expert);
    sh->checked = !sums.empty();
    sh->layers.resize(model.layers.size());
    for (int il : need) {
        if (il < 0 || il >= (int) model.layers.size()) {
            throw std::runtime_error("vis-moe: --moe-shadow: layer " + std::to_string(il) + " is not a layer of the model");
        }
        const auto mts = vis_moe_expert_tensors(model.layers[il]);
        bool any = false;
        for (int k = 0; k < VIS_SHADOW_KINDS; ++k) {
            const ggml_tensor * mt = mts[k];
            if (!mt) {
                continue;
            }
            const char * name = ggml_get_name(mt);
            const int64_t id = gguf_find_tensor(f.g, name);
            if (id < 0) {
                throw f.error(std::string("has no tensor ") + name + ": layer " + std::to_string(il) +
                              " is managed here and the file has no shadow of it (written with --layers that leave it "
                              "out?); write it with --layers all");
            }
            const ggml_tensor * st_ = ggml_get_tensor(f.ctx, name);
            if (!st_ || st_->ne[0] != mt->ne[0] || st_->ne[1] != mt->ne[1] || st_->ne[2] != mt->ne[2] || st_->ne[3] != 1) {
                throw f.error(std::string("tensor ") + name + " has ne " +
                              (st_ ? ne_str(st_->ne[0], st_->ne[1], st_->ne[2]) : std::string("?")) +
                              ", the model's is " + ne_str(mt->ne[0], mt->ne[1], mt->ne[2]));
            }
            if (st_->type != sh->type) {
                throw f.error(std::string("tensor ") + name + " is " + ggml_type_name(st_->type) +
                              ", not the file's vis.shadow.type " + ggml_type_name(sh->type) + " (damaged file)");
            }
            const std::string src_key = std::string("vis.shadow.source_type.") + name;
            const std::string src = f.str(src_key.c_str());
            if (strcasecmp(src.c_str(), ggml_type_name(mt->type)) != 0) {
                throw f.error(std::string("tensor ") + name + " was made from a " + src + " tensor, the model's is " +
                              ggml_type_name(mt->type) + " (another quantisation of the model)");
            }
            const uint64_t off   = (uint64_t) data0 + gguf_get_tensor_offset(f.g, id);
            const uint64_t bytes = ggml_nbytes(st_);
            if (off + bytes > file->size) {
                throw f.error(std::string("tensor ") + name + " ends at byte " + std::to_string(off + bytes) +
                              ", past the end of the file (" + std::to_string(file->size) + " bytes): truncated");
            }
            auto t = std::make_unique<vis_shadow_tensor>();
            t->src.file     = file;
            t->src.name     = name;
            t->src.offs     = off;
            t->src.nb2      = st_->nb[2];
            t->src.n_expert = st_->ne[2];
            if (!sums.empty()) {
                const size_t n_exp = (size_t) model.hparams.n_expert;
                if ((size_t) st_->ne[2] != n_exp) {
                    throw f.error(std::string("tensor ") + name + " has " + std::to_string(st_->ne[2]) +
                                  " experts, the model " + std::to_string(n_exp));
                }
                t->src.sums.assign(sums.begin() + (size_t) id * n_exp, sums.begin() + (size_t) (id + 1) * n_exp);
            }
            t->type         = st_->type;
            t->model_type   = mt->type;
            t->ne0          = st_->ne[0];
            t->ne1          = st_->ne[1];
            sh->bytes       += (int64_t) bytes;
            sh->model_bytes += (int64_t) ggml_nbytes(mt);
            sh->layers[il][k] = std::move(t);
            any = true;
        }
        sh->n_layers += any ? 1 : 0;
    }
    return sh;
}

void vis_moe_shadow_attach(const vis_moe_context & vm, const std::string & path, bool used) {
    std::vector<int> need;
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].managed) {
            need.push_back((int) il);
        }
    }
    if (need.empty() || !vm.shadow) {
        LLAMA_LOG_INFO("vis-moe: --moe-shadow %s not used: no MoE layer is managed (every expert is resident)\n",
                       path.c_str());
        return;
    }
    const vis_moe_shadow & sh = *vm.shadow;
    LLAMA_LOG_INFO("vis-moe: --moe-shadow %s: %s shadows of %d managed layers (%d..%d), %.2f MiB (the model's %.2f MiB), "
                   "%.1f KiB per expert of layer %d; %s\n",
                   path.c_str(), ggml_type_name(sh.type), (int) need.size(), need.front(), need.back(),
                   sh.bytes / 1048576.0, sh.model_bytes / 1048576.0, sh.expert_bytes(need.front()) / 1024.0,
                   need.front(), used ? "misses may run from them (--moe-precision)"
                                      : "validated; --moe-precision is off, so no miss runs from them");
    if (!sh.checked) {
        LLAMA_LOG_WARN("vis-moe: --moe-shadow %s was written before sidecars had per-expert checksums: its experts are "
                       "read unchecked; write it again with pyvis shadow\n", path.c_str());
    }
}
