// vis-moe-capture.cpp - prefix-layer evaluation ("layer limit") and in-memory
// routing capture, for VisMMOE's affinity-aware token compressor (issue #4,
// Algorithm 1 needs every visual token's experts in the first L MoE layers).
//
// Both are per-context switches kept in llama_cparams (vis_n_layer, vis_capture;
// patch 0011), so graph reuse compares them like any other graph parameter.
//
// Layer limit n > 0, in the graph of every ubatch (patch 0011):
//   - llm_graph_context::n_layer is n, so every architecture's layer loop stops
//     after layer n-1 (the arch code is not touched);
//   - build_inp_out_ids() returns nullptr, so the last evaluated layer does not
//     prune to the output rows: its routes cover every token;
//   - llama_model::build_graph() then cuts the graph after the last node named
//     "<name>-<n-1>" (the output norm and lm_head, which would run over every
//     token, are never computed) and drops the logits/embeddings outputs.
//   KV is written for layers 0..n-1 only; the cells are still allocated, so the
//   caller removes them (llama_memory_seq_rm) before the real decode.
//
// Capture: build_moe_ffn marks a contiguous copy of the routed ids of every MoE
// layer as a graph output ("vis_capture_ids-<il>"); after each ubatch they are
// appended per layer to the context's capture state (llama_context::vis_capture,
// src/api/vis-owner.h).  Nothing of this exists in the graph when both are off.
#include "vis-vlm.h"
#include "vis-error.h"
#include "vis-owner.h"

#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model.h"
#include "llama-arch.h"

#include "ggml-backend.h"
#include "ggml-impl.h"  // ggml_cgraph::n_nodes (cutting the graph)

#include <cstring>
#include <string>
#include <vector>

namespace {
struct layer_routes {
    int32_t k = 0;
    std::vector<int32_t> ids;  // [n_rows][k]
};
} // namespace

struct vis_capture_state {
    std::vector<layer_routes> layers;
};

void vis_deleter::operator()(vis_capture_state * p) const {
    delete p;
}

namespace {

// architectures whose graph is known to honour the limit: the layer loop runs to
// llm_graph_context::n_layer, the last layer prunes rows only through
// build_inp_out_ids(), and every layer names its nodes through cb(..., il).
// The routes of a limited decode are tested against a full decode for the
// fixtures of these (tests/test_vlm_native.py).
const llm_arch SUPPORTED[] = {
    LLM_ARCH_QWEN3MOE, LLM_ARCH_QWEN3VLMOE, LLM_ARCH_QWEN2MOE, LLM_ARCH_LLAMA, LLM_ARCH_DEEPSEEK2, LLM_ARCH_OPENAI_MOE,
};

bool arch_supported(llm_arch a) {
    for (llm_arch s : SUPPORTED) {
        if (s == a) {
            return true;
        }
    }
    return false;
}

std::string supported_names() {
    std::string s;
    for (llm_arch a : SUPPORTED) {
        s += (s.empty() ? "" : ", ") + std::string(llm_arch_name(a));
    }
    return s;
}

llama_cparams & cparams_of(llama_context * ctx) {
    return const_cast<llama_cparams &>(ctx->get_cparams());
}

} // namespace

int64_t vis_graph_n_layer(const llama_cparams & cparams, int64_t n_layer) {
    return cparams.vis_n_layer > 0 && cparams.vis_n_layer < n_layer ? cparams.vis_n_layer : n_layer;
}

void vis_capture_graph_ids(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * selected_experts, int il) {
    ggml_tensor * t = ggml_cont(ctx, selected_experts);  // [k, n_tokens] i32
    ggml_format_name(t, "vis_capture_ids-%d", il);
    ggml_set_output(t);
    ggml_build_forward_expand(gf, t);
}

void vis_layer_limit_finish(const llm_graph_params & params, llm_graph_result * res) {
    const int32_t n = params.cparams.vis_n_layer;
    if (n <= 0) {
        return;
    }
    ggml_cgraph * gf = res->get_gf();
    char suffix[24];
    std::snprintf(suffix, sizeof(suffix), "-%d", n - 1);
    const size_t ls = std::strlen(suffix);
    int last = -1;
    for (int i = 0; i < gf->n_nodes; ++i) {
        const char * name = gf->nodes[i]->name;
        const size_t ln = std::strlen(name);
        if (ln > ls && std::strcmp(name + ln - ls, suffix) == 0) {
            last = i;
        }
    }
    GGML_ASSERT(last >= 0 && "vis-moe layer limit: no node of the last evaluated layer in the graph");
    // nodes are in topological order: everything after the last node of layer n-1
    // belongs to the output head (norm, lm_head, pooling, sampling), which no
    // evaluated layer depends on
    gf->n_nodes = last + 1;
    res->t_logits      = nullptr;
    res->t_embd        = nullptr;
    res->t_embd_pooled = nullptr;
    res->t_h_nextn     = nullptr;
}

void vis_capture_collect(llama_context * lctx, ggml_cgraph * gf) {
    if (!lctx->get_cparams().vis_capture || !lctx->vis_capture) {
        return;
    }
    vis_capture_state & st = *lctx->vis_capture;
    bool synced = false;
    std::vector<int32_t> buf;
    const int n_nodes = ggml_graph_n_nodes(gf);
    for (int i = 0; i < n_nodes; ++i) {
        ggml_tensor * t = ggml_graph_node(gf, i);
        if (std::strncmp(t->name, "vis_capture_ids-", 16) != 0) {
            continue;
        }
        const int il = std::atoi(t->name + 16);
        if (il < 0 || il >= (int) st.layers.size()) {
            continue;
        }
        if (!synced) {
            ggml_backend_sched_synchronize(lctx->get_sched());  // the copies below are synchronous
            synced = true;
        }
        layer_routes & L = st.layers[il];
        const int32_t k = (int32_t) t->ne[0];
        if (L.k != 0 && L.k != k) {
            continue;  // cannot happen for one model
        }
        L.k = k;
        const size_t n = (size_t) ggml_nelements(t);
        const size_t off = L.ids.size();
        L.ids.resize(off + n);
        if (n > 0) {
            ggml_backend_tensor_get(t, L.ids.data() + off, 0, n * sizeof(int32_t));
        }
    }
}

// ---------------------------------------------------------------------------
// public API
// ---------------------------------------------------------------------------
int32_t llama_vis_set_layer_limit(llama_context * ctx, int32_t n_layers) {
    vis_clear_last_error();
    if (!ctx) {
        vis_set_last_error("llama_vis_set_layer_limit: NULL context");
        return -1;
    }
    const llama_model & model = ctx->get_model();
    const int32_t n_layer = (int32_t) model.hparams.n_layer();
    if (n_layers < 0 || n_layers > n_layer) {
        vis_set_last_error("llama_vis_set_layer_limit: n_layers must be in 0.." + std::to_string(n_layer) +
                           " (0 = all layers; the model has " + std::to_string(n_layer) + "), got " +
                           std::to_string(n_layers));
        return -1;
    }
    if (n_layers > 0 && !arch_supported(model.arch)) {
        vis_set_last_error(std::string("llama_vis_set_layer_limit: architecture '") + llm_arch_name(model.arch) +
                           "' is not supported (supported: " + supported_names() + ")");
        return -1;
    }
    cparams_of(ctx).vis_n_layer = n_layers;
    return 0;
}

int32_t llama_vis_get_layer_limit(const llama_context * ctx) {
    return ctx ? ctx->get_cparams().vis_n_layer : 0;
}

int32_t llama_vis_moe_capture(llama_context * ctx, int32_t on) {
    vis_clear_last_error();
    if (!ctx) {
        vis_set_last_error("llama_vis_moe_capture: NULL context");
        return -1;
    }
    const llama_model & model = ctx->get_model();
    if (on && model.hparams.n_expert == 0) {
        vis_set_last_error(std::string("llama_vis_moe_capture: the model (") + llm_arch_name(model.arch) +
                           ") has no routed experts");
        return -1;
    }
    if (on) {
        ctx->vis_capture.reset(new vis_capture_state());
        ctx->vis_capture->layers.resize(model.hparams.n_layer());
    } else {
        ctx->vis_capture.reset();
    }
    cparams_of(ctx).vis_capture = on != 0;
    return 0;
}

void llama_vis_moe_capture_reset(llama_context * ctx) {
    if (ctx && ctx->vis_capture) {
        for (auto & L : ctx->vis_capture->layers) {
            L = layer_routes();
        }
    }
}

static const layer_routes * routes_of(const llama_context * ctx, int32_t il, const char * fn) {
    vis_clear_last_error();
    if (!ctx || !ctx->vis_capture || !ctx->get_cparams().vis_capture) {
        vis_set_last_error(std::string(fn) + ": routing capture is off for this context (llama_vis_moe_capture(ctx, 1))");
        return nullptr;
    }
    const auto & layers = ctx->vis_capture->layers;
    if (il < 0 || il >= (int32_t) layers.size()) {
        vis_set_last_error(std::string(fn) + ": layer " + std::to_string(il) + " out of range 0.." +
                           std::to_string((int) layers.size() - 1));
        return nullptr;
    }
    return &layers[il];
}

int32_t llama_vis_moe_get_routes(const llama_context * ctx, int32_t il, int32_t * ids, int32_t n_max) {
    const layer_routes * L = routes_of(ctx, il, "llama_vis_moe_get_routes");
    if (!L) {
        return -1;
    }
    if (L->k == 0) {
        return 0;
    }
    if (ids && n_max > 0) {
        std::memcpy(ids, L->ids.data(), std::min<size_t>(L->ids.size(), (size_t) n_max) * sizeof(int32_t));
    }
    return (int32_t) (L->ids.size() / L->k);
}

int32_t llama_vis_moe_routes_k(const llama_context * ctx, int32_t il) {
    const layer_routes * L = routes_of(ctx, il, "llama_vis_moe_routes_k");
    return L ? L->k : -1;
}
