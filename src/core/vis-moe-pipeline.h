// vis-moe-pipeline.h - prefill passes pipelined (VIS_MOE_OVERLAP, docs/paging.md#prefill-passes-pipelined),
// src/core/vis-moe-pipeline.cpp.
//
// A ubatch that routes more experts than a layer has slots runs in passes of at most n_slots experts (hits first,
// vis-moe-passes.h).  Without this, each pass's op reads its misses and only then do its experts compute: reads and
// compute take turns.  With it, pass 0's op takes every decision the passes would take one after the other (per
// pass: the policy's pass clock, the hits touched, each miss given the policy's victim, evicted, placed, touched:
// the same calls in the same order, so the same victims, misses and bytes as without it), records the slot each
// expert runs from, and splits its first passes in two halves (hits first, then the misses whose slot is free
// soonest): as many as the graph has passes beyond the plain split (it is built for the most experts a ubatch of its
// size could route), so no graph node is added.
// A miss's read may start once every half that ran from its slot before has computed: from the op of the half after
// that one.  So a half's misses are read while the halves before it compute; each half's op waits only for its
// own.  Every half runs the whole ubatch with the other halves' pairs skipped (id -1) and the outputs merged per
// pair (vis-moe-passes.h): byte-identical outputs.  CPU layers whose experts come from the file only (the same
// layers as decode's overlap), no shadows, no stand-ins, no background reads of the plan.
#pragma once

#include <cstdint>

struct vis_moe_context;
struct vis_moe_layer;
struct vis_ubatch_plan;

// after the features' planning chain: does this ubatch plan run pipelined (plan.pipelined)?  Only a plan with a
// miss, no stand-ins, no shadows served and no background reads of its own.
void vis_moe_plan_pipeline(const vis_moe_context & vm, const vis_moe_layer & L, vis_ubatch_plan & plan, bool image);

// apply's part for a pipelined plan (instead of running pass 0): the passes' decisions, the halves (the layer's
// ubatch_plan.passes become them), the reads that may start now; then pass 0 waits for its own and writes its ids.
// Throws on a failed read or a changed file, the slots of unread misses emptied.
void vis_moe_pipeline_apply(vis_moe_context & vm, vis_moe_layer & L, int il, const int32_t * ids, int64_t n_pairs,
                            int32_t * out);

// pass p (> 0) of a pipelined ubatch: start the reads whose slot is free now, wait for this pass's, write the ids
void vis_moe_pipeline_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                           int32_t * out);

// before the layer plans (or after a failure): reads of a ubatch whose passes did not all run are waited for; the
// slots of misses never read are emptied
void vis_moe_pipeline_finish(vis_moe_context & vm, vis_moe_layer & L);
