// vis-moe-graph.cpp - the graph of one MoE layer under the expert cache (vis-moe.h:
// vis_moe_layer_graph), and the graph nodes it may add.
#include "vis-moe.h"
#include "vis-moe-context.h"
#include "vis-moe-ops.h"
#include "vis-moe-passes.h"
#include "vis-moe-prefetch.h"
#include "vis-moe-replay.h"
#include "vis-moe-stage.h"

#include <algorithm>

#include "llama-model.h"

uint32_t vis_moe_extra_nodes(const vis_moe_context * vm, uint32_t n_tokens) {
    if (!vm) {
        return 0;
    }
    uint32_t extra = 0;
    if (vm->replay) {
        extra += (uint32_t) vm->layers.size() * vis_moe_replay::NODES_PER_LAYER;
    }
    if (vm->prefetch) {
        // per layer: ids copy, input view, predict op, and per layer ahead a router matmul and its bias (mlp passes the
        // input view instead)
        extra += (uint32_t) vm->layers.size() * (4u + 2u * (uint32_t) vm->prefetch->lookahead());
    }
    for (const auto & L : vm->layers) {
        if (!L.managed) {
            extra += vm->trace ? 4 : 0;
            continue;
        }
        const int64_t pairs = (int64_t) vm->n_expert_used * n_tokens;
        // the most passes any graph may build: at the online controller's lowest limit (vis-moe-online.h), or one
        // pass and the miss passes VIS_MOE_OVERLAP gives a one-pass ubatch.  A ubatch that needs more than
        // --moe-stream-passes streams a layer that can stream, in one pass (vis_moe_streams), except an image ubatch
        // under a pass bound (--moe-capacity), which never streams.  The scheduler's allocations are sized by this
        // capacity (about 0.85 KiB resident per node): on the 48-layer model at 3 slots and -ub 512, reserving all 43
        // passes of graphs that stream held 46 MiB more (docs/planning.md#the-schedulers-node-capacity)
        const int full   = vis_moe_max_passes(L.n_expert, pairs, L.min_active > 0 ? L.min_active : L.n_slots);
        const int text   = vm->stream_passes > 0 && L.can_stream() ? std::min(full, vm->stream_passes) : full;
        const int bound  = vm->image_pass_bound(L);
        const int image  = bound > 0 ? std::min(full, bound) : text;
        const int overlap = vm->overlap > 0 ? 1 + vm->overlap : 0;
        const int passes  = std::max({ text, image, overlap }) + vis_moe_shadow_passes(*vm, L, pairs, false);
        extra += 32u * passes + 16u;  // per pass: the slot op and a copy of upstream's expert nodes
    }
    return extra;
}

uint64_t vis_moe_graph_epoch(const vis_moe_context * vm) {
    return vm ? vm->graph_epoch : 0;
}

vis_moe_layer_graph::vis_moe_layer_graph(const vis_moe_context * vm_, ggml_context * ctx_, ggml_cgraph * gf_, int il_,
                                         ggml_tensor *& selected_experts, ggml_tensor *& weights_,
                                         ggml_tensor * scores_, ggml_tensor * cur, int64_t n_tokens, bool image_ubatch)
    : vm(vm_), ctx(ctx_), gf(gf_), il(il_), cur_in(cur) {
    if (!vm || il < 0 || il >= (int) vm->layers.size()) {
        vm = nullptr;
        return;
    }
    if (vm->replay && vm->replay->replays(il)) {
        // VIS_MOE_REPLAY: the recorded routing replaces the router's, for the caller's graph too (managed or not)
        add_replay(selected_experts, weights_);
    }
    const vis_moe_layer & L = vm->layers[il];
    predicting = vm->prefetch && cur_in;  // every MoE layer: predictors learn from all of them
    if (!L.managed && !vm->trace && !predicting) {
        vm = nullptr;  // bypass: upstream graph
        return;
    }
    weights  = weights_;
    ids_cont = ggml_cont(ctx, selected_experts);
    ggml_format_name(ids_cont, "vis_moe_ids-%d", il);
    if (!L.managed) {
        if (vm->trace) {
            ggml_tensor * t = ggml_map_custom2(ctx, ids_cont, weights, vis_moe_trace_op, 1, vm->ud(il, 0, VIS_OP_TRACE));
            ggml_format_name(t, "vis_moe_trace-%d", il);
            ggml_build_forward_expand(gf, t);
        }
        if (predicting) {
            add_predict(nullptr);
        }
        vm = nullptr;
        return;
    }
    managed = true;
    for (const auto & f : vm->features) {
        if (f->wants_scores(*vm, il)) {
            scores = scores_;  // router substitution and capacity reroutes choose by router score
        }
    }
    const int64_t pairs = selected_experts->ne[0] * n_tokens;  // 0 on a last layer without output rows
    n_pass = vis_moe_full_passes(*vm, L, pairs, image_ubatch);  // the capacity may bound an image ubatch's experts
    n_full = n_pass;
    if (!vis_moe_streams(*vm, L, pairs, image_ubatch)) {
        n_pass += vis_moe_shadow_passes(*vm, L, pairs, image_ubatch);  // the shadow passes follow the full-precision ones
    }
    if (vis_moe_streams(*vm, L, pairs, image_ubatch)) {
        // Prefill streaming: a ubatch that routes (nearly) every expert would need many small passes (tight budgets:
        // one slot per layer -> 128 passes, each re-running the layer's element-wise ops over all pairs).  Run
        // upstream's graph on the mapped tensors instead: the experts are read once, in file order, through the page
        // cache, exactly as upstream's mmap does; the pages are dropped after the layer and the slabs are left as
        // they are.  Same result, bit for bit: it is upstream's graph.
        // With staging buffers in the slabs (vis-moe-stage.h), the same graph reads staged copies of the tensors.
        managed = false;
        stream  = true;
        staged  = vis_moe_stage_ubatch(*vm, pairs, image_ubatch);
        // a streamed ubatch whose every routed expert runs from its shadow (--moe-precision all, or an image ubatch
        // under vision) stages the layer's shadows: fewer bytes, upstream's mul_mat_id on the shadow type
        staged_shadow = staged && vis_moe_stages_shadows(*vm, L, image_ubatch);
        n_pass  = 1;
        n_full  = 1;
        ggml_tensor * t = ggml_map_custom2(ctx, ids_cont, weights, vis_moe_stream_op, 1,
                                           vm->ud(il, staged_shadow ? 2 : staged ? 1 : 0, VIS_OP_STREAM));
        ggml_format_name(t, "vis_moe_stream-%d", il);
        ggml_build_forward_expand(gf, t);
        stream_ids = t;
        if (predicting) {
            add_predict(t);
        }
    }
}


void vis_moe_layer_graph::add_replay(ggml_tensor *& ids, ggml_tensor *& w) {
    if (w->ne[0] != 1 || w->ne[1] != ids->ne[0] || w->ne[2] != ids->ne[1]) {
        // a graph-build failure goes where the ops' failures go: to the context named by their userdata
        vm->ud(il, 0, VIS_OP_REPLAY_IDS)->vm->fail("VIS_MOE_REPLAY: the router weights of layer " + std::to_string(il) + " are not [1, k, n_tokens]; "
                 "replay does not support this architecture");
        return;
    }
    ggml_tensor * id_src[] = { ids };
    ggml_tensor * ri = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], 1, 1, id_src, 1, vis_moe_replay_op, 1,
                                      vm->ud(il, 0, VIS_OP_REPLAY_IDS));
    ggml_format_name(ri, "vis_moe_replay_ids-%d", il);
    ggml_tensor * w_src[] = { w, ri };  // after the ids: a failure's message comes from the ids op
    ggml_tensor * rw = ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[0], w->ne[1], w->ne[2], w->ne[3], w_src, 2,
                                      vis_moe_replay_op, 1, vm->ud(il, 0, VIS_OP_REPLAY_WEIGHTS));
    ggml_format_name(rw, "vis_moe_replay_weights-%d", il);
    ids = ri;
    w   = rw;
}

void vis_moe_layer_graph::add_predict(ggml_tensor * dep) {
    const llama_model & model = *vm->model;
    const int n_layer = (int) vm->layers.size();
    ggml_tensor * x = ggml_reshape_2d(ctx, cur_in, cur_in->ne[0], ggml_nelements(cur_in) / cur_in->ne[0]);
    std::vector<ggml_tensor *> args = { ids_cont, dep ? dep : ids_cont };
    for (int d = 1; d <= vm->prefetch->lookahead(); ++d) {
        const int T = il + d;
        ggml_tensor * lg = ids_cont;  // placeholder: no logits for this distance
        if (vm->prefetch->wants_logits() && T < n_layer && vm->layers[T].managed && model.layers[T].ffn_gate_inp) {
            // the routers of the layers ahead on this layer's FFN input: one small matmul each
            lg = ggml_mul_mat(ctx, model.layers[T].ffn_gate_inp, x);
            if (model.layers[T].ffn_gate_inp_b) {
                lg = ggml_add(ctx, lg, model.layers[T].ffn_gate_inp_b);
            }
            ggml_format_name(lg, "vis_moe_ahead_logits-%d.%d", il, T);
        }
        args.push_back(lg);
    }
    if (vm->prefetch->wants_hidden()) {
        // mlp: this layer's FFN input at a fixed source, after placeholders for the distances not used
        while ((int) args.size() < VIS_PREDICT_SRC_HIDDEN) {
            args.push_back(ids_cont);
        }
        args.push_back(x);
    }
    ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, args.data(), (int) args.size(), vis_moe_predict_op, 1,
                                     vm->ud(il, 0, VIS_OP_PREDICT));
    ggml_format_name(t, "vis_moe_predict-%d", il);
    ggml_build_forward_expand(gf, t);
}

ggml_tensor * vis_moe_layer_graph::mm_ids(int p, ggml_tensor * selected_experts) {
    if (stream_ids) {
        return stream_ids;  // the routed ids, once the stream op has made the layer's experts readable
    }
    if (!managed) {
        return selected_experts;
    }
    cur_pass = p;
    ggml_tensor * t = nullptr;
    if (p >= n_full) {
        // a shadow pass (vis-moe-shadow-slots.h): shadow slot ids, after the passes before it
        t = ggml_map_custom2(ctx, ids_cont, last, vis_moe_shadow_pass_op, 1, vm->ud(il, p - n_full, VIS_OP_SHADOW));
        ggml_format_name(t, "vis_moe_shadow-%d.%d", il, p - n_full);
        return t;
    }
    if (p == 0 && scores) {
        t = ggml_map_custom3(ctx, ids_cont, weights, scores, vis_moe_pass0_scored_op, 1, vm->ud(il, p, VIS_OP_PASS));
    } else {
        ggml_tensor * dep = p == 0 ? weights : last;
        t = ggml_map_custom2(ctx, ids_cont, dep, vis_moe_pass_op, 1, vm->ud(il, p, VIS_OP_PASS));
    }
    ggml_format_name(t, "vis_moe_slots-%d.%d", il, p);
    if (p == 0 && predicting) {
        add_predict(t);  // after this layer's own loads: demand reads come first
    }
    return t;
}

ggml_tensor * vis_moe_layer_graph::weight(ggml_tensor * w) const {
    if (staged && w) {
        const vis_moe_layer & L = vm->layers[il];
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            if (L.orig[ti] == w && vm->stage->weight(il, ti, staged_shadow)) {
                return vm->stage->weight(il, ti, staged_shadow);
            }
        }
        return w;
    }
    if (!managed || w == nullptr) {
        return w;
    }
    const vis_moe_layer & L = vm->layers[il];
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (L.orig[ti] == w) {
            return cur_pass >= n_full ? L.shadow.slab[ti] : L.slab[ti];
        }
    }
    return w;
}

void vis_moe_layer_graph::push_output(ggml_tensor * experts) {
    if (managed && vm->layers[il].cpu_passes && !outs.empty()) {
        // merge this pass into the accumulator in place: one pass's outputs alive at a time
        const int p = (int) n_merged + 1;
        ggml_tensor * acc = ggml_map_custom3_inplace(ctx, outs[0], experts, ids_cont, vis_moe_merge_op, GGML_N_TASKS_MAX,
                                                     vm->ud(il, p, VIS_OP_MERGE));
        ggml_format_name(acc, "vis_moe_merge-%d.%d", il, p);
        n_merged++;
        outs[0] = acc;
        last    = acc;
        return;
    }
    outs.push_back(experts);
    last = experts;
}

ggml_tensor * vis_moe_layer_graph::output() {
    GGML_ASSERT(!outs.empty());
    if (stream && !staged) {
        // after the layer's experts ran: drop their pages (the returned view orders the drop before later use)
        ggml_tensor * t = ggml_map_custom1_inplace(ctx, outs[0], vis_moe_drop_op, 1, vm->ud(il, 0, VIS_OP_DROP));
        ggml_format_name(t, "vis_moe_drop-%d", il);
        return t;
    }
    if (!managed || outs.size() == 1) {
        return outs[0];  // one pass, or the CPU in-place merge
    }
    ggml_tensor * cat = outs[0];
    for (size_t p = 1; p < outs.size(); ++p) {
        cat = ggml_concat(ctx, cat, outs[p], 2);
    }
    const int64_t n_embd = outs[0]->ne[0], k = outs[0]->ne[1], n_tokens = outs[0]->ne[2];
    ggml_tensor * sel = ggml_map_custom2(ctx, ids_cont, last, vis_moe_select_op, 1, vm->ud(il, 0, VIS_OP_SELECT));
    ggml_format_name(sel, "vis_moe_select-%d", il);
    ggml_tensor * rows = ggml_reshape_2d(ctx, cat, n_embd, k * n_tokens * (int64_t) outs.size());
    ggml_tensor * got  = ggml_get_rows(ctx, rows, ggml_reshape_1d(ctx, sel, k * n_tokens));
    got = ggml_reshape_3d(ctx, got, n_embd, k, n_tokens);
    ggml_format_name(got, "vis_moe_experts-%d", il);
    return got;
}
