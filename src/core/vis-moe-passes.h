// vis-moe-passes.h - the pass planner and slot table of a managed layer
// (src/core/vis-moe-passes.cpp).
//
// Exactness.  A managed layer's three mul_mat_id read a slab [ne0, ne1, n_slots
// (+ 1)] holding byte-identical copies of resident experts, with ids remapped to
// slots.  Output column (i, t) of mul_mat_id depends only on the matrix bytes and
// the input column, and - on CPU - the kernel chosen per expert depends on the rows
// routed to it, never on n_as.  When a ubatch routes more distinct experts than there
// are slots, its experts are split into passes of at most n_slots experts; every pass
// runs the *whole* ubatch, and pairs whose expert belongs to another pass are skipped
// (CPU, id -1, patch 0006) or point at a dedicated staging slot (the "+ 1", never
// holding a real expert); the outputs are merged per pair from the pass that owned its
// expert.  Each real expert therefore sees exactly the rows it sees upstream.
#pragma once

#include <cstdint>

struct vis_moe_context;
struct vis_moe_layer;
struct vis_ubatch_plan;

// passes a ubatch of n_pairs (token, expert) pairs needs at most, with n_slots slots of n_expert experts
int vis_moe_max_passes(int n_expert, int64_t n_pairs, int n_slots);

// passes a ubatch of n_pairs pairs needs at most in layer L's full-precision slabs, and in its shadow slots after
// them (0 without shadow slots).  image: the ubatch is image embeddings (a feature may bound its passes:
// --moe-capacity, vis_moe_feature::image_pass_bound).  The graph builds that many; pass 0 plans within them.
// miss passes a ubatch of n_pairs pairs of layer L gets on top of its pass 0 when its misses are read while the
// layer computes (VIS_MOE_OVERLAP, vis-moe-overlap.h): a one-pass ubatch of a CPU layer whose experts come from the
// file, not an image ubatch; 0 otherwise
int vis_moe_overlap_passes(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image);
// (counted in:)
int vis_moe_full_passes(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image);
int vis_moe_shadow_passes(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image);
// does such a ubatch stream layer L (more than --moe-stream-passes passes needed, or more than one when a feature
// streams the layer early: vis_moe_feature::streams_early)?  A pass-bounded image ubatch never streams.
bool vis_moe_streams(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image = false);
// the ubatch plan's passes: the distinct experts of ids [n_pairs] (the ids the pairs run) in passes of at most
// L.slots.n_active() (every slot unless the online controller limits them; hits first: plan.passes, plan.pass_of); experts the plan serves from shadows (plan.shadow_serve, on a
// layer with shadow slots: vis-moe-shadow-slots.h) are left out, with pass_of -1
void vis_moe_plan_passes(const vis_moe_layer & L, vis_ubatch_plan & plan, const int32_t * ids, int64_t n_pairs);

// the ids of pass p of the layer's ubatch plan: each pair's slot if its expert runs in pass p, else L.foreign_id()
// (made distinct per token where the layer's mul_mat_id may run on a GPU: vis_moe_distinct_foreign)
void vis_moe_pass_ids(const vis_moe_layer & L, int p, const int32_t * ids, int64_t n_pairs, int32_t * out);

// The slab ids of a pass on a layer whose mul_mat_id may run on a GPU (no id -1 there: patch 0006 is CPU-only).
// Upstream's CUDA mul_mat_id for a batch (mmid.cu's mm_ids_helper and the scatter that quantizes each token once)
// assumes a token never names one matrix twice: two pairs of a token on the one staging slot left a row of its
// index maps unwritten, and the kernels wrote out of bounds (seen on an H100: illegal memory access, compute-sanitizer
// in quantize_mmq_q8_1; wrong logits where it did not crash).  So each token's pairs that are not in the pass
// (`marker`) get ids distinct from each other and from the token's own ids, among [0, n_ids) (the staging slots
// first, from the top): their products are computed and dropped, as the staging slot's were.  Rows of k pairs; needs
// n_ids >= k (vis_moe_staging_slots sizes the slabs so); returns false, changing nothing, where n_ids < k.
bool vis_moe_distinct_foreign(int32_t * out, int64_t n_pairs, int64_t k, int32_t n_ids, int32_t marker);

// The staging slots a managed layer's slabs get beside its n_slots: none on a CPU-only run (id -1 skips), else
// enough for vis_moe_distinct_foreign: max(1, k - n_slots) for top-k routing.
int vis_moe_staging_slots(bool cpu_only, int n_slots, int k);

// evict the expert in slot s (unified memory: it moves down to tier 2 instead of being dropped)
void vis_moe_evict_slot(vis_moe_context & vm, vis_moe_layer & L, int il, int s);

// make the experts of pass p of the layer's ubatch plan resident (evicting through the layer's policy, filling
// through the tiers) and write the slot id of every pair (foreign pairs: L.foreign_id()).  Throws on a load failure, with
// the slot table left consistent.
void vis_moe_run_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                      int32_t * out);
