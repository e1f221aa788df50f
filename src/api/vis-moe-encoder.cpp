// vis-moe-encoder.cpp - the vision encoder in the --moe-mem budget (issue #24 item 2, docs/planning.md#the-vision-encoder).
// A VLM tool loads its projector (--mmproj, libmtmd) after the text context, so the plan of that context must know the
// encoder's bytes beforehand: the tool hands the mmproj's path over first (llama_vis_moe_plan_encoder, patch 0015;
// pyvis.vlm.Session through the C API), and every plan after it counts the encoder like compute (anonymous memory
// that must fit).  libllama does not link libmtmd, so the bytes come from the mmproj GGUF alone: its tensors'
// sizes (clip loads them all) and, from its hparams, the compute buffer and the image copies of the largest image
// the projector accepts (--image-max-tokens, else the projector's own limit).
#include "vis-moe-encoder.h"
#include "vis-error.h"

#include "gguf.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

namespace {

// libmtmd's context beside the text model with a small image, over the weights: peak RSS of llama-mtmd-cli minus
// llama-cli's at the same settings, 34, 30 and 33 MiB for three encoders (n_embd 32, 256, 1152; docs/planning.md)
constexpr int64_t VIS_MOE_ENCODER_RUNTIME = 36ll << 20;

std::mutex                        g_mutex;
bool                              g_planned = false;
struct llama_vis_encoder_estimate g_encoder = {};

int64_t u32_key(const gguf_context * g, const char * key, int64_t def) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) {
        return def;
    }
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(g, id);
        default:               return def;
    }
}

// the Qwen-VL mergers (dynamic resolution): clip.cpp's set_limit_image_tokens(8, 4096), spatial merge 2 by default
bool qwen_merger(const std::string & proj) {
    return proj == "qwen2vl_merger" || proj == "qwen2.5vl_merger" || proj == "qwen3vl_merger";
}

} // namespace

int32_t llama_vis_moe_encoder_estimate(const char * path, int32_t image_max_tokens, int32_t flash_attn, int32_t warmup,
                                       struct llama_vis_encoder_estimate * out) {
    vis_clear_last_error();
    if (!path || !out) {
        vis_set_last_error("llama_vis_moe_encoder_estimate: NULL argument");
        return -1;
    }
    if (image_max_tokens < -1 || flash_attn < -1 || flash_attn > 1 || warmup < 0 || warmup > 1) {
        vis_set_last_error("llama_vis_moe_encoder_estimate: image_max_tokens must be >= -1 (-1 or 0: the projector's "
                           "limit), flash_attn -1, 0 or 1 and warmup 0 or 1, got " + std::to_string(image_max_tokens) +
                           ", " + std::to_string(flash_attn) + " and " + std::to_string(warmup));
        return -1;
    }
    gguf_init_params gp = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_context * g = gguf_init_from_file(path, gp);
    if (!g) {
        vis_set_last_error(std::string("--mmproj ") + path + ": cannot read it as a GGUF file (missing, unreadable or "
                           "not GGUF); the vision encoder's memory cannot be planned");
        return -1;
    }
    struct llama_vis_encoder_estimate e = {};
    const int64_t pid = gguf_find_key(g, "clip.projector_type");
    const int64_t vid = gguf_find_key(g, "clip.vision.projector_type");
    const int64_t use = vid >= 0 ? vid : pid;
    const std::string proj = use >= 0 && gguf_get_kv_type(g, use) == GGUF_TYPE_STRING ? gguf_get_val_str(g, use) : "";
    const int64_t n_embd  = u32_key(g, "clip.vision.embedding_length", 0);
    const int64_t n_ff    = u32_key(g, "clip.vision.feed_forward_length", 0);
    const int64_t n_head  = u32_key(g, "clip.vision.attention.head_count", 1);
    const int64_t patch   = u32_key(g, "clip.vision.patch_size", 0);
    const int64_t side    = u32_key(g, "clip.vision.image_size", 0);
    const int64_t n_proj  = u32_key(g, "clip.vision.projection_dim", n_embd);
    const bool audio = gguf_find_key(g, "clip.audio.projector_type") >= 0 || gguf_find_key(g, "clip.has_audio_encoder") >= 0;
    if (proj.empty() && !audio) {
        gguf_free(g);
        vis_set_last_error(std::string("--mmproj ") + path + ": not a multimodal projector (no clip.projector_type); " +
                           "give the mmproj GGUF of the model");
        return -1;
    }
    const bool vision = n_embd > 0 && patch > 0;
    const int64_t merge = u32_key(g, "clip.vision.spatial_merge_size",
                                  u32_key(g, "clip.vision.projector.scale_factor", qwen_merger(proj) ? 2 : 1));
    int64_t n_deepstack = 0;
    bool    f32_weights = true;
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        e.weight_bytes += (int64_t) gguf_get_tensor_size(g, i);
        const char * name = gguf_get_tensor_name(g, i);
        int il = 0;
        char rest[64] = {};
        if (std::sscanf(name, "v.deepstack.%d.%63s", &il, rest) == 2 && std::strcmp(rest, "fc1.weight") == 0) {
            ++n_deepstack;
        }
        if (std::strncmp(name, "v.blk.", 6) == 0 && std::strstr(name, ".weight") &&
            gguf_get_tensor_type(g, i) != GGML_TYPE_F32 && std::strstr(name, "ln") == nullptr) {
            f32_weights = false;  // a matmul weight in F16 or quantized: the CPU converts each activation to it
        }
    }
    const int64_t max_pixels = u32_key(g, "clip.vision.image_max_pixels", 0);
    gguf_free(g);
    std::snprintf(e.projector, sizeof(e.projector), "%s", proj.c_str());
    e.total_bytes = e.weight_bytes;
    if (!vision) {
        *out = e;  // an audio encoder: its weights only (its compute is not estimated)
        return 0;
    }

    // the largest image the encoder is given, in output tokens (after the merge)
    const int64_t unit = patch * merge;  // pixels per output token per side
    int64_t tokens;
    if (image_max_tokens > 0) {
        tokens = image_max_tokens;
        e.limit_known = 1;
    } else if (qwen_merger(proj)) {
        tokens = 4096;
        e.limit_known = 1;
    } else if (max_pixels > 0) {
        tokens = std::max<int64_t>(1, max_pixels / (unit * unit));
        e.limit_known = 1;
    } else {
        tokens = std::max<int64_t>(1, (side / unit) * (side / unit));  // fixed-size encoders; others: a guess
        e.limit_known = 0;
    }
    const int64_t n_patches = tokens * merge * merge;
    e.image_tokens = (int32_t) tokens;
    e.n_patches    = (int32_t) n_patches;
    // clip's warmup lays its compute buffer out for a warmup image (the Qwen-VL mergers: 46 x 46 tokens, others
    // image_size); a smaller image reuses that layout, spread over the whole buffer (measured: a 1024-token image
    // in Qwen3-VL's dims touched the 285 MiB reserved for 2116 tokens), so the buffer is the larger of the two
    const int64_t warm_tokens = !warmup ? 0 : qwen_merger(proj) ? 46 * 46 : (side / unit) * (side / unit);
    e.warmup_tokens = (int32_t) warm_tokens;
    const int64_t c_patches = std::max(tokens, warm_tokens) * merge * merge;
    e.flash_attn   = flash_attn != 0 ? 1 : 0;  // auto: the CPU backend runs clip's flash attention
    // Compute buffer, f32 rows per patch at the widest of three stages: the patch embedding (the image, 3 p^2, and
    // half as much again of its im2col, + the n_embd output), attention (residual, fused QKV, roped Q and K, the
    // output: 7 n_embd) and the MLP (residual, normed input, n_ff), the later two next to the image where the
    // allocator has not reused its rows; 5 % on top.  Against clip's own reservation on three shapes
    // (tests/test_encoder_plan.py): 1.05x (tiny), 1.39x (mid), 1.05x (Qwen3-VL's dims).  Without flash attention
    // the scores of one layer, n_head x n_patches^2, are materialised too, and the stages no longer overlap.
    const int64_t img     = 3 * patch * patch;
    const int64_t s_patch = img * 3 / 2 + n_embd, s_attn = 7 * n_embd, s_mlp = std::max<int64_t>(n_ff, 0) + 2 * n_embd;
    const int64_t rows    = e.flash_attn ? std::max({ s_patch, s_attn + img, s_mlp + img }) : s_patch + s_attn + s_mlp;
    e.compute_bytes = c_patches * 4 * rows * (e.flash_attn ? 105 : 110) / 100 +
                      (e.flash_attn ? 0 : n_head * c_patches * c_patches * 4) +
                      (f32_weights ? 0 : c_patches * std::max(n_ff, n_embd) * 2) +  // activations converted to F16
                      VIS_MOE_ENCODER_RUNTIME;
    // host copies of one image: the preprocessed f32 image (mtmd keeps it in the chunk) and the output embeddings
    const int64_t n_embd_out = n_proj * (1 + n_deepstack);
    e.image_bytes = n_patches * 3 * patch * patch * 4 + tokens * n_embd_out * 4;
    e.total_bytes = e.weight_bytes + e.compute_bytes + e.image_bytes;
    *out = e;
    return 0;
}

int32_t llama_vis_moe_plan_encoder(const char * path, int32_t image_max_tokens, int32_t flash_attn, int32_t warmup) {
    struct llama_vis_encoder_estimate e = {};
    if (path && *path && llama_vis_moe_encoder_estimate(path, image_max_tokens, flash_attn, warmup, &e) != 0) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_planned = path && *path;
    g_encoder = g_planned ? e : llama_vis_encoder_estimate{};
    return 0;
}

int64_t llama_vis_moe_planned_encoder(struct llama_vis_encoder_estimate * out) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (out) {
        *out = g_encoder;
    }
    return g_planned ? g_encoder.total_bytes : 0;
}

int64_t vis_moe_encoder_bytes() {
    return llama_vis_moe_planned_encoder(nullptr);
}

std::string vis_moe_encoder_line(int64_t encoder_bytes) {
    if (encoder_bytes <= 0) {
        return "";
    }
    char buf[64];
    std::snprintf(buf, sizeof(buf), " + vision encoder %.0f", encoder_bytes / 1048576.0);
    return buf;
}
