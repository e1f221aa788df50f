// vis-moe-feature.h - the interface every mechanism of the expert cache implements (issue #23 items 2 and 8).
//
// The cache core (vis-moe-context.h: slabs, slot pools, passes, tiers) knows its features only through this
// class: the context owns them (vis_moe_context::features, in attach order) and its lifetime hooks are loops
// over them:
//   vis_moe_prepare_ubatch -> ubatch_prepare (before the graph is built or reused: slot limits for this ubatch)
//   vis_moe_begin_ubatch   -> ubatch_begin   (every feature, attach order)
//   vis_moe_end_ubatch     -> ubatch_end     (after the core's own bookkeeping; a failure goes to vm.fail)
//   --moe-stats            -> stats_print    (after the cache table, before the tiers footer)
//   llama_vis_moe_reset_stats -> stats_reset
//   vis_moe_context_detach -> detach         (before the stats are printed)
// pass 0 of a managed layer makes its ubatch plan (vis-moe-ubatch-plan.h) as a chain of planning steps, each a
// loop over the features (vis-moe-ops.cpp): observe_routing, plan_collected, plan_route, plan_routed, plan_serve;
// the core splits the experts into passes; plan_reads adds the background reads.  A planner gets a const context
// and layer and writes only into the plan (and its own state).  The context's apply() is the one mutator: it loads
// pass 0 and starts the reads; plan_applied tells each feature what was started.
// A streamed layer tells them with stream_layer.  The graph's pass count asks them through image_pass_bound and
// streams_early.  A feature keeps its own
// state (per-layer state as a vector indexed by layer) and its own stats (its C struct of llama-vis.h, its own
// section of the --moe-stats table); the context holds a typed, non-owning handle to it for the graph ops that
// call it by name.  Adding a feature: one class (its own files), its attach call, its settings row.
//
// Dependencies point one way (docs/architecture.md): features include the context; the context includes
// this header and no feature's.
#pragma once

#include <cstdint>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;
struct llama_ubatch;
struct ggml_tensor;
struct vis_fetch_done;  // vis-moe-fetch-slots.h
struct vis_ubatch_plan;  // vis-moe-ubatch-plan.h

// how a streamed layer reads its experts (the stream op, vis-moe-ops.cpp)
enum vis_stream_how { VIS_STREAM_MAPPED = 0, VIS_STREAM_STAGED = 1, VIS_STREAM_STAGED_SHADOW = 2 };

class vis_moe_feature {
public:
    virtual ~vis_moe_feature() = default;

    // a short name for logs ("substitution", "prefetch", ...)
    virtual const char * feature_name() const = 0;

    // before the ubatch's graph is built or reused and its inputs are set (patch 0017): a slot limit set here is the
    // one its graph is built for; the compute buffer holds nothing live (the last ubatch's outputs were copied out).
    // A failure is reported with vm.fail(msg)
    virtual void ubatch_prepare(vis_moe_context & vm, const llama_ubatch & ub) {
        (void) vm;
        (void) ub;
    }
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

    // ---- planning a ubatch, per layer (pass 0 of a managed layer; ids [k, n_tokens], weights [1, k, n_tokens]).
    // A planner reads the context and the layer and writes only into the ubatch plan (vis-moe-ubatch-plan.h) and its
    // own state; the context's apply() changes the slot pools and starts the plan's reads.  (The gate weights of
    // pairs a planner drops are zeroed in `weights`, the ubatch's own data.)
    // the routing of layer il, as the router (or the replay) chose it: any layer with ops (the trace's REC1)
    virtual void observe_routing(const vis_moe_context & vm, int il, const ggml_tensor * ids, const ggml_tensor * weights) {
        (void) vm;
        (void) il;
        (void) ids;
        (void) weights;
    }
    // the layer's background reads were collected before it plans (waited_us: how long pass 0 waited for them)
    virtual void plan_collected(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                const std::vector<vis_fetch_done> & done, int64_t waited_us, const int32_t * ids,
                                int64_t n_pairs) {
        (void) vm;
        (void) L;
        (void) il;
        (void) done;
        (void) waited_us;
        (void) ids;
        (void) n_pairs;
    }
    // route: which expert each pair runs (plan.exec, plan.outcome, plan.sub_active; dropped pairs' gate weights
    // zeroed in weights): substitution, then capacity.  scores: [n_expert, n_tokens] when a feature asked for them
    // (wants_scores)
    virtual void plan_route(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                            const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * scores) {
        (void) vm;
        (void) L;
        (void) il;
        (void) plan;
        (void) ids;
        (void) weights;
        (void) scores;
    }
    // after every plan_route: what the pairs run (the trace's SUB1)
    virtual void plan_routed(const vis_moe_context & vm, const vis_moe_layer & L, int il, const vis_ubatch_plan & plan,
                             const ggml_tensor * ids) {
        (void) vm;
        (void) L;
        (void) il;
        (void) plan;
        (void) ids;
    }
    // serve: where each expert is served from: the misses the shadow slots serve (plan.shadow_serve).  The pairs
    // run plan.run_ids(ids->data)
    virtual void plan_serve(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                            const ggml_tensor * ids, const ggml_tensor * weights) {
        (void) vm;
        (void) L;
        (void) il;
        (void) plan;
        (void) ids;
        (void) weights;
    }
    // the passes are split (plan.passes, plan.shadow_passes): the reads to start in the background once pass 0 is
    // loaded (plan.read: substitution's stand-ins' experts, precision's full-precision refetch)
    virtual void plan_reads(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan) {
        (void) vm;
        (void) L;
        (void) il;
        (void) plan;
    }
    // apply() ran the plan: what became of each read (plan.reads[i].done), for the feature's stats
    virtual void plan_applied(const vis_moe_context & vm, const vis_moe_layer & L, int il, const vis_ubatch_plan & plan) {
        (void) vm;
        (void) L;
        (void) il;
        (void) plan;
    }
    // layer il streams this ubatch (routed: its distinct experts; ids and weights as above)
    virtual void stream_layer(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<int> & routed,
                              vis_stream_how how, const ggml_tensor * ids, const ggml_tensor * weights) {
        (void) vm;
        (void) L;
        (void) il;
        (void) routed;
        (void) how;
        (void) ids;
        (void) weights;
    }
    // does pass 0 of layer il need the router's scores (router substitution, capacity reroutes)?
    virtual bool wants_scores(const vis_moe_context & vm, int il) const {
        (void) vm;
        (void) il;
        return false;
    }

    // the full-precision passes an image ubatch of layer L is bounded to (0: no bound; --moe-capacity)
    virtual int image_pass_bound(const vis_moe_context & vm, const vis_moe_layer & L) const {
        (void) vm;
        (void) L;
        return 0;
    }
    // the bytes a staged ubatch may commit in slab memory above the slot limits (staging buffers span whole slabs,
    // inactive slots too: vis-moe-stage.h); a controller that lowered the limits to give memory to something else
    // says how much of it is spare now.  The least over the features decides; a ubatch that would commit more
    // streams through the page cache instead
    virtual int64_t staging_room(const vis_moe_context & vm) const {
        (void) vm;
        return INT64_MAX;
    }
    // after every feature's ubatch_end: would a graph built before now be built otherwise (then none is reused)?
    virtual bool graphs_stale(const vis_moe_context & vm) const {
        (void) vm;
        return false;
    }
    // does a ubatch stream layer L as soon as it needs a second pass (staged shadows beat shadow passes)?
    virtual bool streams_early(const vis_moe_context & vm, const vis_moe_layer & L, bool image) const {
        (void) vm;
        (void) L;
        (void) image;
        return false;
    }
};
