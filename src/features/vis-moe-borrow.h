// vis-moe-borrow.h - borrowed slots: expert slots in the bytes the --moe-mem plan reserves for the compute buffer
// and the running ubatch leaves unused (VIS_MOE_BORROW; docs/planning.md#borrowed-slots;
// src/features/vis-moe-borrow.cpp).
//
// Why.  The plan prices the compute buffer of the asked ubatch by an estimate made before upstream lays the buffer
// out (llama_vis_moe_estimate_reserve: logits for every token of the ubatch, as a run that outputs every row needs).
// A tool that generates outputs one row per sequence (llama-cli, llama-server) gets a smaller compute buffer
// (upstream reserves it for n_outputs_max rows: at -ub 512 25-27 MiB against an estimate of 106 on the testbed, 72
// against 147 on the 48-layer model), and a decode step writes 0.2-0.5 MiB of it (mincore).  The difference is
// budget that holds nothing.  Lowering -ub frees part of it for good but
// changes how the prompt is cut, which on quantized weights changes the logits (docs/planning.md#outputs).
// Here the slabs are made for the slots the plan gives at the compute estimate of a small ubatch (SMALL tokens),
// and before each ubatch (patch 0017) every managed layer is limited to its share of:
//     base + (estimate at the asked ubatch - what this ubatch may hold of the compute buffer - the resident weights
//     that plan left pageable) / slot row, at most the slabs' slots, where what a ubatch may hold is
//   - at most SMALL tokens, once the compute buffer's pages that a larger ubatch wrote were dropped (nothing in it
//     is live then: the last outputs were copied out, the inputs are not yet set): the estimate at SMALL tokens, or
//     what small ubatches were measured to leave resident (mincore) if more;
//   - larger: its tokens' share of the buffer upstream really allocated (ggml_backend_sched_get_buffer_size: it
//     only grows; activations are [.., n_tokens] tensors), scaled up where a ubatch was measured to leave more
//     resident, plus the estimate at SMALL tokens; never more than that buffer.
// Slots above a lowered limit are emptied and their pages dropped before the graph is built, so peak memory stays
// the plan's.  The extra slots refill on demand like any miss.
//
// Exactness.  Limits change only before a graph is built (patch 0017) and a graph built at other limits is not
// reused (vis_moe_graph_epoch); each expert still sees exactly the rows it sees upstream (vis-moe-passes.h).  The
// dropped compute pages read back as zeros and are written before they are read.  What is computed never changes,
// only what is resident.
//
// Residency.  Every slot is faulted right after the slabs are made (fault_borrowed), while a memory cgroup still has
// room: pages faulted later, at its limit, are the ones its reclaim frees one at a time, and O_DIRECT reads into
// such scattered pages were measured slower (docs/planning.md#stop-42-the-borrowed-slots-pages-were-physically-scattered-found-and-fixed).
// The first ubatch drops those it cannot hold.  Before each ubatch the process's RSS is measured: where it holds more
// than the budget less the kernel's headroom, as many layers as that takes hold one slot fewer than each ubatch
// would give them (fit_measured).
//
// Locking (--moe-mlock, on by default): each layer's slots up to the asked ubatch's share (base) are locked, as the
// whole slabs are without borrowing; the slots above stay unlocked (a lower limit drops their pages).
#pragma once

#include "vis-moe-feature.h"

#include <cstdint>
#include <string>

struct llama_context;
struct llama_model;
struct llama_vis_moe_plan;
struct llama_vis_moe_plan_request;
struct vis_moe_attach_plan;
struct vis_moe_context;
struct vis_moe_settings;

class vis_moe_borrow : public vis_moe_feature {
public:
    static constexpr int64_t SMALL = 16;  // ubatches of at most this many tokens may run every slot of the slabs

    // what the plan decided (vis-moe-attach.cpp)
    struct plan {
        int     base = 1, full = 1;  // slots per layer at the asked ubatch's compute estimate, and at SMALL's (the slabs)
        int64_t n_ubatch  = 512;
        int64_t row_bytes = 0;       // one slot in every managed layer
        int64_t pageable  = 0;       // resident weights the asked ubatch's plan leaves to the page cache: they get the
                                     // idle compute bytes of a larger ubatch first
        int64_t n_vocab = 0, n_embd = 0, n_expert_used = 0, n_ff_exp = 0;  // the estimate's shape
    };
    vis_moe_borrow(const llama_context * lctx, const plan & p);

    const char * feature_name() const override { return "borrow"; }
    void ubatch_prepare(vis_moe_context & vm, const llama_ubatch & ub) override;
    // the compute buffer: the buffer of the routing tensor, a node of the ubatch's graph
    void observe_routing(const vis_moe_context & vm, int il, const ggml_tensor * ids, const ggml_tensor * weights) override;
    // a staged ubatch may write above the limits what neither the compute buffer nor the active slots use
    int64_t staging_room(const vis_moe_context & vm) const override;
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override;

    // every managed layer limited to its share of `slots` of the slabs' `full` (>= 1 each)
    void limit_all(vis_moe_context & vm, int slots);
    // lock each managed layer's slots below its share of base (host slabs); false if a lock failed
    bool lock_base(vis_moe_context & vm) const;
    // fault the slots above the limit too, at attach (the first ubatch drops those it cannot hold)
    void fault_borrowed(vis_moe_context & vm);
    // before each ubatch: the layers that must hold one slot fewer for what the process holds, measured, to keep the
    // kernel's headroom of the budget (n_capped; a backstop behind the plan)
    void fit_measured(const vis_moe_context & vm);

    int active = 0;  // the slots per layer the running ubatch may use

private:
    // the compute buffers the scheduler allocated in buffer type buft (nullptr: every host one), -1 before any
    int64_t sched_size(struct ggml_backend_buffer_type * buft) const;
    // the compute buffer seen is still the scheduler's (a reserve may have made a larger one)
    bool compute_is_current() const;

    const llama_context * lctx;
    plan    p;
    int64_t compute_asked;        // the estimate's compute bytes at the asked ubatch (the reserve less its fixed part)
    int64_t compute_small;        // ... and at SMALL tokens
    struct ggml_backend_buffer * compute = nullptr;  // the compute buffer seen by the last ubatch
    size_t  compute_size = 0;
    int64_t large_n     = 0;      // the most tokens of a ubatch over SMALL since the compute pages were dropped
    bool    ran_small   = false;  // the last ubatch had at most SMALL tokens
    double  scale       = 1.0;    // compute bytes a larger ubatch left resident over its token share of the buffer
    int64_t small_bytes = 0;      // compute bytes resident after small ubatches (measured: mincore)
    int64_t need        = 0;      // compute bytes the running ubatch may hold
    int64_t n_full = 0, n_mid = 0, full_sum = 0, mid_sum = 0;  // ubatches of <= SMALL tokens and larger, their slots
    int64_t n_released = 0, bytes_released = 0;  // compute buffer pages dropped
    bool    idle_resident = false;  // slots above the limit were faulted at attach, not yet dropped or used
    int     n_capped = 0;         // the first n_capped managed layers hold one slot fewer than their share (fit_measured)
    int64_t over     = 0;         // the bytes over the budget measured then
    bool    capped_now = false;   // n_capped grew: the limits are set again
};

// why borrowing cannot run with these settings and this attach plan (a GPU, --moe-slots, another controller of the
// slot limits, a feature that plans passes at a fixed slot count); nullptr: it can
const char * vis_moe_borrow_off_reason(const vis_moe_settings & s, const vis_moe_attach_plan & ap);
// VIS_MOE_BORROW is on and can run: the configurator prices decode with the borrowed slots (vis-moe-configure.cpp)
bool vis_moe_borrow_applies(const vis_moe_settings & s, const vis_moe_attach_plan & ap);

// at attach, in the --moe-mem plan (vis-moe-attach.cpp), after `plan` was made for the asked ubatch (n_ubatch)
// with request rq: with VIS_MOE_BORROW on, the plan at a ubatch of SMALL tokens; where it gives more slots per
// layer, the slabs are made for those (ap.n_slots, ap.extra_slots) and ap.borrow_base_slots keeps the asked
// ubatch's.  Returns the plan line's suffix ("" when the knob is off)
std::string vis_moe_borrow_plan(const llama_model & model, const vis_moe_settings & s, vis_moe_attach_plan & ap,
                                const llama_vis_moe_plan_request & rq, const struct llama_vis_moe_plan & plan,
                                int64_t n_ubatch);

// at attach, after the slabs (made for `full` slots per layer, `base` at the asked ubatch of n_ubatch tokens; a slot
// row of row_bytes; `pageable` resident weights left unlocked): the feature, limited to base until the first ubatch,
// the base slots locked with `lock` (vm.locked says whether they are)
void vis_moe_borrow_attach(vis_moe_context & vm, const llama_context * lctx, const llama_model & model, int base, int full,
                           int64_t n_ubatch, int64_t row_bytes, int64_t pageable, bool lock);
