// vis-moe-attach-plan.h - what a context's expert cache will be, decided from the loaded model and the settings
// alone: the MoE layers, the managed ones, the shadow slots' bytes and the --moe-mem plan request.  Two callers:
// the attach (vis-moe-attach.cpp), and the check before upstream allocates the KV cache (vis-moe-kv-check.cpp),
// so that both ask llama_vis_moe_plan the same question.
#pragma once

#include "llama-vis.h"
#include "vis-moe-policy.h"
#include "vis-moe-settings.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct ggml_tensor;
struct llama_layer;
struct llama_model;
struct vis_moe_shadow;

// what attach decides, step by step
struct vis_moe_attach_plan {
    std::vector<int>  moe_layers;   // layers with routed experts
    std::vector<bool> deferred;     // per layer: experts deferred to the file at load (patch 0004)
    bool any_deferred = false;
    std::vector<int>  managed;      // MoE layers after the pinned prefix that the cache can page
    std::vector<int>  unpaged;      // MoE layers after the pinned prefix it cannot (per-expert scales): upstream's path
    int  pinned = 0;
    int64_t per_slot = 0;           // bytes of one slot in every managed layer
    int64_t exp_max  = 0;           // largest expert of a managed layer
    int64_t slice_max = 0;          // largest expert slice (one tensor of one expert) of a managed layer: a read
    int     n_slab_tensors = 0;     // expert tensors of the managed layers: one slab each
    bool all_host_devices = true;   // every managed layer's device is CPU-writable memory
    bool cpu_only = false;          // no GPU at all: no staging slot
    int  staging  = 0;
    int  n_slots  = 0;              // slots per managed layer (on average, with layer_slots)
    std::vector<int> layer_slots;   // slots of each layer (indexed by layer; VIS_MOE_SLOT_SPLIT, extra_slots), empty: n_slots each
    int  extra_slots = 0;           // the --moe-mem plan's: one more slot in this many managed layers (llama_vis_moe_extra_slots)
    int64_t host_bytes = 0;
    bool planned  = false;          // slots from --moe-cache-mib or --moe-mem rather than --moe-slots
    int64_t pageable = 0;           // resident weights left unlocked because the budget cannot hold them
    int64_t shadow_per_slot = 0;    // --moe-precision: bytes of one shadow slot in every managed layer
    int     shadow_slots    = -1;   // --moe-shadow-slots (-1: one per full slot)
    int     online_min_slots = 0;   // VIS_MOE_ONLINE: slots at the whole KV cache (0: no controller); n_slots is at its floor
    int64_t online_fixed     = 0;   // ... and what the plan holds besides the KV cache and the slabs
    int     encoder_held_slots = 0; // VIS_MOE_ENCODER_RELEASE: slots while the vision encoder is loaded (0: no
                                    // release); n_slots is what the slabs hold once it is freed
    int     borrow_base_slots = 0;  // VIS_MOE_BORROW: slots in ubatches over its SMALL tokens (0: no borrowing);
                                    // n_slots is what the slabs hold for smaller ones
    int32_t policy = VIS_POLICY_LFU_ADAPT; // VIS_MOE_POLICY: eviction order of the full slots (overwritten from the settings)
    int slots(int il) const { return layer_slots.empty() ? n_slots : layer_slots[il]; }
};

// bytes of one expert of a layer (all its expert tensors)
int64_t vis_moe_layer_expert_bytes(const llama_layer & l);

// The token embeddings of a model with its own output matrix: a token reads one row of them, so they are
// neither counted as resident weights nor locked (a few touched pages stay in the page cache).
bool vis_moe_row_gathered(const llama_model & model, const ggml_tensor * t);

// step 1: MoE layers, and which of them the loader deferred to the file
void vis_moe_find_moe_layers(const llama_model & model, vis_moe_attach_plan & ap);

// --moe-mem alone and nothing deferred: the loader found that the whole model fits the budget, so the context runs
// upstream's path with every expert resident (no expert cache)
bool vis_moe_runs_whole(const vis_moe_settings & s, const vis_moe_attach_plan & ap, const llama_model & model);

// does a layer's expert layout keep it out of the cache?  Per-expert scales (`blk.N.ffn_*_exps.scale`, e.g. NVFP4
// files) are gathered by upstream's graph with the expert ids, which on a managed layer would be slot ids
bool vis_moe_layer_has_expert_scales(const llama_layer & l);

// step 2: the managed layers (after the pinned prefix, without layouts the cache cannot page: `unpaged`) and the
// devices their slabs live on
void vis_moe_choose_managed(const llama_model & model, const vis_moe_settings & s, vis_moe_attach_plan & ap);

// the one line that says which layers the cache leaves to upstream's path, and why (`ap.unpaged` not empty)
std::string vis_moe_unpaged_line(const llama_model & model, const vis_moe_attach_plan & ap);

// --moe-shadow of the managed layers (header and tensor table only; throws on a bad sidecar); with
// --moe-precision on, its slots' bytes go into `ap` (they share the budget).  Null when nothing is managed.
std::unique_ptr<vis_moe_shadow> vis_moe_plan_shadow(const llama_model & model, const vis_moe_settings & s,
                                                    vis_moe_attach_plan & ap);

// the managed layers' positions among the model's MoE layers (what a split file's curves are indexed by)
std::vector<int> vis_moe_managed_positions(const vis_moe_attach_plan & ap);

// step 3, last: VIS_MOE_SLOT_SPLIT splits the managed layers' n_slots each by the split file's miss curves
// (vis-moe-split.h) into ap.layer_slots, and the plan's extra_slots go to the layers llama_vis_moe_extra_slots picks
// (by the file's curves, else spread over depth); throws on a file for another model.  Returns the lines that say so
// ("": every managed layer holds n_slots)
std::string vis_moe_apply_slot_split(const llama_model & model, const vis_moe_settings & s, vis_moe_attach_plan & ap);

// step 3 decides the slots with the --moe-mem plan (not --moe-slots or --moe-cache-mib)
bool vis_moe_uses_memory_plan(const llama_model & model, const vis_moe_settings & s, const vis_moe_attach_plan & ap);

// The --moe-mem plan request of a context with n_ubatch and a KV cache of kv_bytes: resident weights (every tensor
// but the deferred experts and row-gathered embeddings, + fixed shadow slots), KV, compute estimate, managed layers.
// No managed layer, or --moe-slots >= experts on layers loaded whole: a plan with nothing to page (every expert
// resident).
llama_vis_moe_plan_request vis_moe_plan_request(const llama_model & model, const vis_moe_settings & s,
                                                const vis_moe_attach_plan & ap, int64_t n_ubatch, int64_t kv_bytes);
