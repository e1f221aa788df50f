// vis-moe-encoder-release.h - the vision encoder's bytes handed to the expert slots once a VLM tool has freed it
// (issue #24 item 2, VIS_MOE_ENCODER_RELEASE=on; docs/planning.md#freeing-the-encoder-after-the-image).
//
// A VLM's --moe-mem plan counts the encoder (weights, compute buffer, image copies: vis-moe-encoder.cpp) next to the
// text model, so the decode runs on the slots left beside it.  In a single-turn llama-mtmd-cli run the encoder has
// nothing left to do once the prompt's images are in the KV cache.  With the knob on, the slabs are made for the
// slots the plan gives without the encoder (their pages resident only when a slot is used, as for the online
// controller), and every managed layer is limited to the slots the plan gives with it; when the tool has freed the
// encoder (llama_vis_moe_encoder_freed, patch 0015) the limit rises to the slabs' size.  Outputs are unchanged: the
// limit moves between ubatches and a graph built at the old limit is not reused (vis_moe_graph_epoch), as in
// vis-moe-online.h.
#pragma once

#include "vis-moe-feature.h"

#include <cstdint>
#include <string>

struct vis_moe_attach_plan;
struct vis_moe_context;
struct vis_moe_settings;

class vis_moe_encoder_release : public vis_moe_feature {
public:
    vis_moe_encoder_release(int held, int freed, int64_t encoder_bytes, int64_t row_bytes)
        : held(held), planned_held(held), freed_slots(freed), encoder_bytes(encoder_bytes), row_bytes(row_bytes) {}

    const char * feature_name() const override { return "encoder-release"; }
    // while the encoder is loaded: the slots the plan held beside it that staging lowered `held` to leave free
    // (staged streaming writes its buffers over whole slabs and drops those pages after the ubatch, vis-moe-stage.h)
    int64_t staging_room(const vis_moe_context & vm) const override;
    void stats_print(const vis_moe_context & vm) const override;

    // the tool freed the encoder: every managed layer's limit rises to its slabs' size (once; later calls do nothing)
    void freed(vis_moe_context & vm);
    // Staged streaming (vis-moe-stage.cpp) puts n_buf buffers of `stride` bytes over the first slabs, the slots above
    // the limit included, so while the encoder is loaded those pages are resident too.  Returns the buffers that fit
    // the memory held (planned_held slots), lowering `held` to make room; 0: none fits (stream through the page cache).
    int fit_staging(vis_moe_context & vm, int n_buf, int64_t stride);

    int           held;           // slots per layer while the encoder is loaded (a layer with the average count)
    const int     planned_held;   // ... as the plan gave them (staging may lower `held`)
    const int     freed_slots;    // ... once it is freed: the slabs' size
    const int64_t encoder_bytes;  // what the plan counted for it
    const int64_t row_bytes;      // one slot in every managed layer
    bool          done = false;   // freed() ran
};

// At planning (vis-moe-attach.cpp): where it applies, the slabs grow to the slots of the plan without the encoder
// (`without`; 0: that plan leaves resident weights pageable or fails), at most those its bytes buy, into ap.n_slots, and
// ap.encoder_held_slots keeps the count with the encoder; returns the plan line's suffix.  Throws where the knob
// cannot work (VIS_MOE_ONLINE=on also moves the limits).
std::string vis_moe_encoder_release_plan(const vis_moe_settings & s, vis_moe_attach_plan & ap, int without,
                                         int64_t encoder_bytes, int n_expert);
// After the slabs exist, before the staging: the feature, and every managed layer limited to its share of `held`.
void vis_moe_encoder_release_attach(vis_moe_context & vm, int held, int freed, int64_t encoder_bytes, int64_t row_bytes);
