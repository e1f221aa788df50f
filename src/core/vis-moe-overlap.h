// vis-moe-overlap.h - reads overlapped with compute in decode (VIS_MOE_OVERLAP, docs/paging.md#reads-overlapped-
// with-compute-in-decode), src/core/vis-moe-overlap.cpp.
//
// Without it a one-pass ubatch (a decode step) reads its misses in pass 0, before any of the layer's experts
// compute: compute and reads take turns.  With it the ubatch plan (vis-moe-ubatch-plan.h) gets more passes: pass 0
// runs the hits, then up to vis_moe_overlap_passes() miss passes run the misses.  The misses' reads are issued in
// pass 0's op, right after the hits are touched and before the hits' mul_mat_id start, into slots reserved in the
// slot pool (no id points at them), through the I/O pool's queue (vis_io_pool::submit); each miss pass waits only
// for its own experts' reads.  Victims, touches and tiers are taken in the same order as pass 0 takes them without
// overlap, so the policy, the misses and the bytes read are the same; every pass runs the whole ubatch with foreign
// pairs skipped and outputs merged per pair (vis-moe-passes.h): byte-identical outputs.
#pragma once

#include "vis-moe-overlap-state.h"

#include <cstdint>

struct vis_moe_context;
struct vis_moe_layer;
struct vis_ubatch_plan;

// the plan's passes of an overlapped ubatch: pass 0 (hits first, then misses) split into the hits and up to
// vis_moe_overlap_passes() miss passes, later ones at least as large (plan.overlap_first = 1); nothing when the
// ubatch is not overlapped.  After the features' planning chain: they see the ubatch's passes as without overlap.
void vis_moe_plan_overlap(const vis_moe_context & vm, const vis_moe_layer & L, vis_ubatch_plan & plan, bool image);

// apply's part (after pass 0 ran the hits): every miss of the miss passes gets its victim, evicted, reserved and
// touched in order, then is served from memory or its reads are queued.  Throws when the file changed.
void vis_moe_overlap_issue(vis_moe_context & vm, vis_moe_layer & L, int il);

// miss pass p: wait for the reads of its experts, settle their slots, write the slot ids (foreign pairs:
// L.foreign_id()).  Throws vis_io_error on a failed read, its slot released.
void vis_moe_overlap_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                          int32_t * out);

// before the layer plans: reads of an earlier ubatch whose passes did not run (an aborted compute) are waited for
// and settled (a failed one released)
void vis_moe_overlap_finish(vis_moe_context & vm, vis_moe_layer & L);

// monotonic microseconds (the stats' timestamps)
int64_t vis_moe_now_us();
