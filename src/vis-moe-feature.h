// vis-moe-feature.h - the interface every mechanism of the expert cache implements (issue #23 items 2 and 8).
//
// The cache core (vis-moe-context.h: slabs, slot pools, passes, tiers) knows its features only through this
// class: the context owns them (vis_moe_context::features, in attach order) and its lifetime hooks are loops
// over them:
//   vis_moe_begin_ubatch   -> ubatch_begin   (every feature, attach order)
//   vis_moe_end_ubatch     -> ubatch_end     (after the core's own bookkeeping; a failure goes to vm.fail)
//   --moe-stats            -> stats_print    (after the cache table, before the tiers footer)
//   llama_vis_moe_reset_stats -> stats_reset
//   vis_moe_context_detach -> detach         (before the stats are printed)
// and the graph's pass count asks them through image_pass_bound and streams_early.  A feature keeps its own
// state (per-layer state as a vector indexed by layer) and its own stats (its C struct of llama-vis.h, its own
// section of the --moe-stats table); the context holds a typed, non-owning handle to it for the graph ops that
// call it by name.  Adding a feature: one class (its own files), its attach call, its settings row.
//
// Dependencies point one way (docs/architecture.md): features include the context; the context includes
// this header and no feature's.
#pragma once

struct vis_moe_context;
struct vis_moe_layer;
struct llama_ubatch;

class vis_moe_feature {
public:
    virtual ~vis_moe_feature() = default;

    // a short name for logs ("substitution", "prefetch", ...)
    virtual const char * feature_name() const = 0;

    // before the ubatch is computed (after the core's step clocks)
    virtual void ubatch_begin(vis_moe_context & vm, const llama_ubatch & ub) {
        (void) vm;
        (void) ub;
    }
    // after it was computed; a failure is reported with vm.fail(msg)
    virtual void ubatch_end(vis_moe_context & vm) { (void) vm; }

    // its section of the --moe-stats table (stderr), and back to zero for llama_vis_moe_reset_stats
    virtual void stats_print(const vis_moe_context & vm) const { (void) vm; }
    virtual void stats_reset() {}

    // the context goes away (before the stats are printed)
    virtual void detach(vis_moe_context & vm) { (void) vm; }

    // the full-precision passes an image ubatch of layer L is bounded to (0: no bound; --moe-capacity)
    virtual int image_pass_bound(const vis_moe_context & vm, const vis_moe_layer & L) const {
        (void) vm;
        (void) L;
        return 0;
    }
    // does a ubatch stream layer L as soon as it needs a second pass (staged shadows beat shadow passes)?
    virtual bool streams_early(const vis_moe_context & vm, const vis_moe_layer & L, bool image) const {
        (void) vm;
        (void) L;
        (void) image;
        return false;
    }
};
