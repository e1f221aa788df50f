// vis-moe-modality.h - what the runtime knows of a ubatch's modality (docs/precision.md, issue #14 items 2-3):
// which tokens are image embeddings, MACS's entropy-weighted importance of each image token, and the calibrated
// modality bias of each expert (visual / text / shared, from `pyvis calibrate modality`).
//
// Image tokens: libmtmd (llama-mtmd-cli, llama-server, pyvis) decodes an image's embeddings in ubatches of their own,
// so a ubatch with embeddings is all image tokens and one with token ids all text.
//
// MACS weight of an image token: H = the Shannon entropy of softmax(its embedding row), z-scored over the image
// tokens of the ubatch, w = sigmoid(-delta * z) (low-entropy, peaked rows weigh more); text tokens weigh 1.  The same
// H as pyvis's pruning score (pyvis.vlm.prune.token_entropy); pyvis.vlm.prune.macs_weights computes w in Python and
// a test holds the two equal.  Computed here from the ubatch itself, so every tool gets it, not only pyvis.
#pragma once

#include "vis-moe-feature.h"
#include "llama-vis.h"

#include <cstdint>
#include <string>
#include <vector>

struct llama_model;
struct llama_ubatch;

// w [n_tokens] of n_tokens rows of n_embd floats (row stride `stride` floats): see above.  One row: w = 0.5.
void vis_macs_weights(const float * embd, int64_t n_tokens, int64_t n_embd, int64_t stride, double delta, float * w);

// modality bias of an expert: +1 visual, -1 text, 0 shared (or unknown, unused)
enum { VIS_BIAS_TEXT = -1, VIS_BIAS_SHARED = 0, VIS_BIAS_VISUAL = 1 };

// the modality profile of `pyvis calibrate modality`: bias [n_layer][n_expert]
struct vis_modality_profile {
    std::string path;
    int n_layer = 0, n_expert = 0;
    std::vector<int8_t> bias;
    const int8_t * layer(int il) const { return bias.data() + (size_t) il * n_expert; }
};
// open and check (kind, version, fingerprint, shape, labels in range); throws std::runtime_error naming the flag
// (--moe-cap-profile), the file and the fix
vis_modality_profile vis_modality_profile_load(const std::string & path, const llama_model & model);

// the modality of the ubatch being computed
class vis_moe_modality : public vis_moe_feature {
public:
    explicit vis_moe_modality(double delta_) : delta(delta_) {}
    void begin_ubatch(const llama_ubatch & ub, int64_t n_embd);
    // the feature (vis-moe-feature.h): each ubatch's image tokens, before the planners of its layers read them
    const char * feature_name() const override { return "modality"; }
    void ubatch_begin(vis_moe_context & vm, const llama_ubatch & ub) override;
    // per token: 1 = image embedding; null when every token is text
    const uint8_t * image() const { return any_image ? image_tok.data() : nullptr; }
    // per token: MACS weight (text 1)
    const float * weights() const { return weight.data(); }
    bool has_image() const { return any_image; }

private:
    double delta;
    bool any_image = false;
    std::vector<uint8_t> image_tok;
    std::vector<float>   weight;
};
