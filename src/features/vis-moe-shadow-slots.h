// vis-moe-shadow-slots.h - the shadow slots of a managed layer (docs/precision.md, issue #14 item 2): a second,
// smaller slot pool whose slabs hold low-bit shadow experts (the --moe-shadow sidecar, vis-moe-shadow.h) in the
// shadow type, and the shadow passes that compute from them.
//
// Exactness of a shadow pass.  A shadow pass is a pass like the full-precision ones (vis-moe-passes.h): every pass
// runs the whole ubatch through upstream's mul_mat_id, on a slab [ne0, ne1, n_slots (+ 1)] of the shadow type
// holding byte copies of shadow experts, with ids remapped to shadow slots; pairs of other passes are skipped (CPU,
// id -1) or point at the staging slot.  Each expert served from its shadow therefore sees exactly the rows it sees
// in upstream's mul_mat_id on the shadow tensor itself: the output of such a pair equals upstream's on a model whose
// expert tensors are the shadow's (tests/test_precision.py checks this token for token).
//
// Which experts a ubatch serves from shadows is the precision policy's choice (vis-moe-precision.h); it is made per
// expert, so the passes stay a partition of the ubatch's experts and the merge takes each pair from one pass.
// Graph passes: the full-precision passes first (vis_moe_max_passes with the layer's slots), then the shadow passes
// (the same bound with the shadow slots); the pass index of a shadow pass is first_pass + its number.
#pragma once

#include "llama-vis.h"
#include "vis-moe-slot-pool.h"  // vis_shadow_slots

#include "ggml.h"

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;
struct vis_ubatch_plan;
struct vis_shadow_tensor;
struct llama_model;



// after the full-precision passes of a ubatch plan: the experts with plan.shadow_serve set go into shadow passes
// (plan.shadow_passes; shadow hits first), numbered from first_pass; their plan.pass_of is set accordingly
void vis_shadow_plan(const vis_moe_layer & L, vis_ubatch_plan & plan, int first_pass);

// shadow pass sp of the layer's ubatch plan: its experts made resident in the shadow slots (LRU; misses read from the sidecar
// through the I/O pool) and the id of every pair written (pairs of other passes: -1 on CPU, else the staging slot).
// Throws vis_io_error on a failed read, with the slot table left consistent.
// st: the precision stats of the layer (hits, reads, bytes, time)
void vis_shadow_run_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int sp, const int32_t * ids, int64_t n_pairs,
                         int32_t * out, llama_vis_moe_prec_stats & st);

// context creation: n_slots shadow slots for every managed layer (clamped to the expert count), slabs allocated
// in the buffer type of the layer's slabs.  Throws std::runtime_error when they cannot be allocated.
void vis_shadow_slots_create(vis_moe_context & vm, int n_slots);
