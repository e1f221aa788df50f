// vis-mtmd-saliency.cpp - per-image-token "attention received" from the vision
// encoder (VisMMOE Algorithm 1, line 2), for visual-token pruning (issue #4).
//
// libmtmd (tools/mtmd) calls in through patch 0010:
//   mtmd_context:      owns a vis_saliency_state (member vis_saliency, src/api/vis-owner.h),
//                      created by llama_vis_mtmd_saliency_attach(), freed with the context;
//                      attach receives libmtmd's accessor of that member (vis_saliency_of)
//   mtmd_encode_impl:  llama_vis_mtmd_saliency_begin(state) ... encode ... _end(state, ok)
//   clip build_attn:   llama_vis_clip_saliency_layer() decides per layer (false = the
//                      upstream graph, unchanged); the selected layers hand their
//                      softmax attention to _collect() (or, on the flash-attention path,
//                      _attn() computes it next to flash attention)
//   clip_encode:       llama_vis_clip_saliency_fetch() reads the results after compute
// The clip hooks know no mtmd context: the encode in progress is thread-local.  The public
// getters reach a context's state through libmtmd's accessor (libmtmd links libllama, so only
// its code can look inside an mtmd_context); no state is kept outside the contexts.
//
// In the graph: kq [n_kv, n_q, n_head, B] -> out_prod with a constant column
// 1/(n_q*n_head) -> "vis_saliency-<il>" [n_kv, 1, B], the mean over heads and
// queries of the attention each patch receives.  The host maps patches to output
// tokens (mean of each token's merged patches) and averages over the layers.
#include "vis-vlm.h"
#include "vis-error.h"
#include "vis-owner.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct sal_result {
    bool ok = false;
    std::string error;
    std::vector<float> raw;  // per output token
};

struct sal_current {
    const vis_saliency_state * owner = nullptr;  // state of the mtmd context being encoded
    int n_layers = 0;
    std::string unsupported;       // projector name when not supported
    std::vector<float> raw;        // per output token, all entries of the batch
    int n_layers_found = 0;
    std::string error;
};

} // namespace

struct vis_saliency_state {
    std::atomic<int> n_layers{-1};  // -1: the process-wide default
    std::mutex mutex;               // guards encoded and last (written by the encode, read by the getters)
    bool       encoded  = false;
    sal_result last;                // last encode
};

namespace {

std::atomic<llama_vis_mtmd_saliency_of> g_state_of{nullptr};  // libmtmd's accessor: one function for every context
std::atomic<int> g_default{-1};                 // -1: not read from the environment yet
thread_local sal_current tl;

// the saliency state an mtmd context owns, or nullptr when no mtmd context was ever made
vis_saliency_state * state_of(const mtmd_context * ctx) {
    const llama_vis_mtmd_saliency_of fn = g_state_of.load();
    return fn ? fn(ctx) : nullptr;
}

// a value of VIS_MTMD_SALIENCY: a layer count (digits only), or -1 with `err` naming the variable
int env_layers(const char * e, std::string & err) {
    char * end = nullptr;
    errno = 0;
    const long v = std::isdigit((unsigned char) e[0]) ? std::strtol(e, &end, 10) : -1;
    if (v < 0 || *end != '\0' || errno == ERANGE || v > INT_MAX) {
        err = std::string("VIS_MTMD_SALIENCY: expected an integer >= 0 (the last k encoder layers averaged for "
                          "the saliency, 0 = off), got '") + e + "'. Fix: set it to a layer count, or unset it";
        return -1;
    }
    return (int) v;
}

// the process-wide default: llama_vis_mtmd_saliency_enable(NULL, k), else VIS_MTMD_SALIENCY; -1 with `err`
// when the variable is invalid (not kept: every encode that relies on it reports it until it is fixed)
int default_layers(std::string & err) {
    int v = g_default.load();
    if (v < 0) {
        const char * e = std::getenv("VIS_MTMD_SALIENCY");
        v = (e && *e) ? env_layers(e, err) : 0;
        if (v < 0) {
            return -1;
        }
        int expected = -1;
        g_default.compare_exchange_strong(expected, v);
        v = g_default.load();
    }
    return v;
}

const char * const SUPPORTED[] = { "qwen3vl_merger", "qwen2vl_merger" };

bool supported(const char * proj) {
    for (const char * s : SUPPORTED) {
        if (proj && std::strcmp(proj, s) == 0) {
            return true;
        }
    }
    return false;
}

int32_t copy_out(const std::vector<float> & v, float * out, int32_t n_max) {
    if (out && n_max > 0) {
        std::copy_n(v.begin(), std::min<size_t>(v.size(), (size_t) n_max), out);
    }
    return (int32_t) v.size();
}

int32_t get_impl(const mtmd_context * ctx, float * out, int32_t n_max, bool normalise) {
    vis_clear_last_error();
    if (!ctx) {
        vis_set_last_error("llama_vis_mtmd_get_saliency: NULL mtmd context");
        return -1;
    }
    vis_saliency_state * st = state_of(ctx);
    std::vector<float> v;
    {
        std::unique_lock<std::mutex> lock;
        if (st) {
            lock = std::unique_lock<std::mutex>(st->mutex);
        }
        if (!st || !st->encoded) {
            vis_set_last_error("saliency: no image has been encoded by this mtmd context yet");
            return -1;
        }
        if (!st->last.ok) {
            vis_set_last_error(st->last.error);
            return -1;
        }
        v = st->last.raw;
    }
    if (normalise && !v.empty()) {
        const auto [mn, mx] = std::minmax_element(v.begin(), v.end());
        const float lo = *mn, hi = *mx;
        for (float & x : v) {
            x = hi > lo ? (x - lo) / (hi - lo) : 1.0f;
        }
    }
    return copy_out(v, out, n_max);
}

} // namespace

int32_t llama_vis_mtmd_saliency_enable(const mtmd_context * ctx, int32_t n_layers) {
    vis_clear_last_error();
    if (n_layers < 0) {
        vis_set_last_error("llama_vis_mtmd_saliency_enable: n_layers must be >= 0 (0 = off, k = last k encoder layers), got " +
                           std::to_string(n_layers));
        return -1;
    }
    if (!ctx) {
        g_default.store(n_layers);
        return 0;
    }
    vis_saliency_state * st = state_of(ctx);
    if (!st) {
        vis_set_last_error("llama_vis_mtmd_saliency_enable: not an mtmd context (libmtmd has made none)");
        return -1;
    }
    st->n_layers.store(n_layers);
    return 0;
}

vis_saliency_state * llama_vis_mtmd_saliency_attach(llama_vis_mtmd_saliency_of state_of) {
    g_state_of.store(state_of);
    return new vis_saliency_state();
}

void vis_deleter::operator()(vis_saliency_state * st) const {
    delete st;
}

int32_t llama_vis_mtmd_get_saliency(const mtmd_context * ctx, float * out, int32_t n_max) {
    return get_impl(ctx, out, n_max, true);
}

int32_t llama_vis_mtmd_get_saliency_raw(const mtmd_context * ctx, float * out, int32_t n_max) {
    return get_impl(ctx, out, n_max, false);
}

void llama_vis_mtmd_saliency_begin(vis_saliency_state * st) {
    tl = sal_current();
    if (!st) {
        return;
    }
    const int n = st->n_layers.load();
    tl.owner    = st;
    tl.n_layers = n >= 0 ? n : default_layers(tl.error);
}

void llama_vis_mtmd_saliency_end(vis_saliency_state * st, bool ok) {
    if (!st) {
        return;
    }
    sal_result r;
    if (tl.owner != st) {
        r.error = "saliency: internal error (encode of another context in between)";
    } else if (!ok) {
        r.error = "saliency: the last image encode failed";
    } else if (tl.n_layers < 0) {
        r.error = tl.error;   // the default came from an invalid VIS_MTMD_SALIENCY
    } else if (tl.n_layers == 0) {
        r.error = "saliency: it was off for the last image encode of this context "
                  "(enable it with llama_vis_mtmd_saliency_enable / pyvis._native.saliency_enable before encoding)";
    } else if (!tl.unsupported.empty()) {
        r.error = "saliency: projector '" + tl.unsupported + "' is not supported (supported: qwen3vl_merger, qwen2vl_merger)";
    } else if (!tl.error.empty()) {
        r.error = tl.error;
    } else if (tl.n_layers_found == 0 || tl.raw.empty()) {
        r.error = "saliency: the encoder graph produced no attention scores";
    } else {
        r.ok  = true;
        r.raw = std::move(tl.raw);
    }
    tl = sal_current();
    std::lock_guard<std::mutex> lock(st->mutex);
    st->last    = std::move(r);
    st->encoded = true;
}

bool llama_vis_clip_saliency_active(void) {
    return tl.owner != nullptr && tl.n_layers > 0;
}

bool llama_vis_clip_saliency_layer(const char * projector, int il, int n_layer) {
    if (!llama_vis_clip_saliency_active() || il < 0 || il >= n_layer) {
        return false;
    }
    if (!supported(projector)) {
        tl.unsupported = projector ? projector : "?";
        return false;
    }
    return il >= n_layer - tl.n_layers;
}

// mean over heads and queries of the attention each key patch receives:
// kq [n_kv, n_q, n_head, B] (contiguous soft_max output) -> [n_kv, 1, B], scaled by 1/denom
static ggml_tensor * received(ggml_context * ctx, ggml_tensor * kq, float denom) {
    GGML_ASSERT(kq->type == GGML_TYPE_F32 && ggml_is_contiguous(kq));
    const int64_t n_kv = kq->ne[0];
    const int64_t n_qh = kq->ne[1] * kq->ne[2];
    const int64_t nb   = kq->ne[3];
    ggml_tensor * a = ggml_reshape_3d(ctx, kq, n_kv, n_qh, nb);
    // a constant column 1/denom: ggml_fill only takes its shape from this (contiguous) view
    ggml_tensor * w = ggml_view_3d(ctx, a, 1, n_qh, nb, sizeof(float), sizeof(float) * n_qh, 0);
    w = ggml_fill(ctx, w, 1.0f / denom);
    // out_prod contracts the second dimension: s[j] = sum_{q,h} a[j, (q,h)] / denom
    return ggml_out_prod(ctx, a, w);  // [n_kv, 1, B]
}

static void finish(ggml_cgraph * gf, ggml_tensor * s, int il) {
    ggml_format_name(s, "vis_saliency-%d", il);
    ggml_set_output(s);
    ggml_build_forward_expand(gf, s);
}

void llama_vis_clip_saliency_collect(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * kq, int il) {
    finish(gf, received(ctx, kq, (float) (kq->ne[1] * kq->ne[2])), il);
}

// budget of one chunk of the attention matrix computed beside flash attention
static int64_t chunk_bytes() {
    const char * e = std::getenv("VIS_MTMD_SALIENCY_CHUNK_MIB");  // may be fractional (tests use tiny chunks)
    const double mib = (e && *e) ? std::atof(e) : 32.0;
    return std::max<int64_t>(1, (int64_t) (mib * 1048576.0));
}

void llama_vis_clip_saliency_attn(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * q, ggml_tensor * k,
                                  ggml_tensor * kq_mask, float kq_scale, ggml_tensor * sinks, int il) {
    // Flash attention never materialises the attention matrix: compute softmax(K^T Q) beside it,
    // in F32, in chunks of queries so that at most one chunk [n_kv, n_qc, n_head] is alive (each
    // chunk's reduction is added to the previous one, so the allocator reuses its memory).
    // q: [d_head, n_q, n_head, B], k: [d_head, n_kv, n_head, B] (permuted views).
    const int64_t n_q = q->ne[1], n_kv = k->ne[1], n_head = q->ne[2], nb = q->ne[3];
    const int64_t row = n_kv * n_head * nb * (int64_t) sizeof(float);   // bytes per query
    int64_t qc = std::max<int64_t>(1, chunk_bytes() / row);
    qc = std::max(qc, (n_q + 255) / 256);                               // at most 256 chunks (graph size)
    qc = std::min(qc, n_q);
    ggml_tensor * acc = nullptr;
    for (int64_t i0 = 0; i0 < n_q; i0 += qc) {
        const int64_t n = std::min(qc, n_q - i0);
        ggml_tensor * qv = ggml_view_4d(ctx, q, q->ne[0], n, n_head, nb, q->nb[1], q->nb[2], q->nb[3], i0 * q->nb[1]);
        ggml_tensor * kq = ggml_mul_mat(ctx, k, qv);                    // [n_kv, n, n_head, B]
        ggml_prec_set_acc(kq, GGML_PREC_F32);                           // F32 accumulation (op param 0)
        ggml_tensor * m = nullptr;
        if (kq_mask) {
            m = ggml_view_2d(ctx, kq_mask, kq_mask->ne[0], n, kq_mask->nb[1], i0 * kq_mask->nb[1]);
        }
        kq = ggml_soft_max_ext(ctx, kq, m, kq_scale, 0.0f);
        if (sinks) {
            ggml_soft_max_add_sinks(kq, sinks);
        }
        ggml_tensor * r = received(ctx, kq, (float) (n_q * n_head));
        acc = acc ? ggml_add(ctx, acc, r) : r;
    }
    finish(gf, acc, il);
}

void llama_vis_clip_saliency_fetch(ggml_cgraph * gf, int n_tokens_out) {
    if (!llama_vis_clip_saliency_active()) {
        return;
    }
    // per-patch scores [n_kv, B] summed over the selected layers
    std::vector<float> sum, buf;
    int64_t n_kv = -1, nb = -1;
    int found = 0;
    const int n_nodes = ggml_graph_n_nodes(gf);
    for (int i = 0; i < n_nodes; ++i) {
        ggml_tensor * t = ggml_graph_node(gf, i);
        if (std::strncmp(ggml_get_name(t), "vis_saliency-", 13) != 0) {
            continue;
        }
        if (n_kv < 0) {
            n_kv = t->ne[0];
            nb   = t->ne[2];
            sum.assign((size_t) (n_kv * nb), 0.0f);
        }
        if (t->ne[0] != n_kv || t->ne[2] != nb) {
            tl.error = "saliency: layers disagree on the number of patches";
            return;
        }
        buf.resize(sum.size());
        ggml_backend_tensor_get(t, buf.data(), 0, buf.size() * sizeof(float));
        for (size_t j = 0; j < sum.size(); ++j) {
            sum[j] += buf[j];
        }
        found++;
    }
    if (found == 0) {
        return;  // end() reports it (or the projector was not supported)
    }
    if (n_tokens_out <= 0 || n_kv % n_tokens_out != 0) {
        tl.error = "saliency: " + std::to_string(n_kv) + " encoder patches do not map onto " +
                   std::to_string(n_tokens_out) + " output tokens";
        return;
    }
    // the qwen2vl/qwen3vl encoders reorder patches so that the patches merged into
    // output token t are the consecutive rows [t*m, (t+1)*m)
    const int64_t m = n_kv / n_tokens_out;
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t t = 0; t < n_tokens_out; ++t) {
            double acc = 0.0;
            for (int64_t j = 0; j < m; ++j) {
                acc += sum[(size_t) (b * n_kv + t * m + j)];
            }
            tl.raw.push_back((float) (acc / ((double) m * found)));
        }
    }
    tl.n_layers_found = std::max(tl.n_layers_found, found);
}
