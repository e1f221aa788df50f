// vis-moe-lend.h - slab lending: under a tight memory plan, a ubatch that streams a layer (prefill streaming,
// docs/paging.md#prefill-streaming) first hands the slabs' pages back to the kernel, so that the page cache has
// room for the streamed experts; the slabs refill on demand afterwards (src/features/vis-moe-lend.cpp).
//
// Why.  Streaming reads a layer's experts through the mapping and the page cache.  The memory plan spends the
// whole budget on resident weights, KV, compute and slabs, so at tight budgets (12.5 % of a Qwen3-30B-A3B-sized
// model: 1.97 of 2.03 GB locked) the streamed pages are reclaimed before they are used and the layer is read
// again and again (193 GB read in six minutes for a 64-token prompt).  The slabs are not used while a layer
// streams, and a prompt long enough to stream routes almost every expert anyway, so their contents are worth
// little against that.
//
// When (--moe-stream-lend auto).  Decided at attach (vis_moe_lend_decide): a CPU-only run with a --moe-mem plan, streaming on, and a plan
// whose free bytes (budget minus everything it placed) are less than the layers streaming keeps in the page cache
// at once (one layer's experts; two with --moe-stream-ahead).  Then the first layer a ubatch streams through the
// mapping calls vis_moe_lend_slabs and the end of the ubatch vis_moe_return_slabs; a ubatch that stages its layers
// in the slabs (vis-moe-stage.h) does not lend.
//
// Exactness.  Every slot is emptied in the slot table and the policy before its pages go, after the layer's
// background reads were collected (waited for, or cancelled when not started); an emptied slot is refilled from
// tier 2 or the file like any miss.  The dropped pages read back as zeros (anonymous memory), the value the slabs
// were created with.  What is computed never changes, only what is resident.
#pragma once

#include "vis-moe-feature.h"

#include <cstdint>

struct vis_moe_context;

// the lending of a context that lends (vis_moe_lend_decide): whether the running ubatch lent the slabs, and how often
class vis_moe_lender : public vis_moe_feature {
public:
    bool    lent       = false;  // the current ubatch lent them
    int64_t n_lent     = 0;      // ubatches that lent them
    int64_t bytes_lent = 0;

    // the feature (vis-moe-feature.h): the slabs back at the end of a ubatch that lent them; the lending line
    const char * feature_name() const override { return "lending"; }
    void ubatch_end(vis_moe_context & vm) override;
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override { n_lent = bytes_lent = 0; }
    // the first layer a ubatch streams through the mapping lends the slabs (tight plans: the page cache gets them)
    void stream_layer(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<int> & routed, vis_stream_how how,
                      const ggml_tensor * ids, const ggml_tensor * weights) override;
};

// at attach, after the plan, the slabs and the stager (a staged ubatch never lends; one that cannot stage streams
// through the mapping and lends): whether streamed ubatches lend the slabs (adds vm.lend and logs the reason).  mode: --moe-stream-lend (-1 auto: the rule above; 0 never; 1 whenever a layer can stream).
// plan_free: budget bytes the plan left unplaced (< 0: no --moe-mem plan).
void vis_moe_lend_decide(vis_moe_context & vm, int mode, int64_t plan_free);

// every managed layer's background reads collected (waited for, or cancelled when not started), then every slot
// and every shadow slot emptied in the slot tables and the policies: nothing is resident in or being written to the
// slabs (the shadow slabs included: their pages are lent, or staging overwrites them).  Compute thread;
// throws vis_io_error on a failed background read (after its slot was released).  Staging uses it too.
void vis_moe_empty_slots(vis_moe_context & vm);

// the first streamed layer of a ubatch, compute thread: empty every slot, release the slabs' pages (once per ubatch)
void vis_moe_lend_slabs(vis_moe_context & vm);

// the end of a ubatch that lent them: lock the slabs again (their pages come back as zeros; the slots stay empty)
void vis_moe_return_slabs(vis_moe_context & vm);
