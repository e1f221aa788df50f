// vis-moe-kv-pages.cpp - the KV cache's pages resident only where its cells are used (vis-moe-kv-pages.h).
#include "vis-moe-kv-pages.h"
#include "vis-moe.h"
#include "vis-moe-settings.h"
#include "vis-pages.h"

#include "llama-context.h"
#include "llama-kv-cache.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

using ranges = std::vector<std::pair<size_t, size_t>>;  // byte ranges [a, b) of one stream's block of a tensor

// the runs of empty cells of one stream
ranges empty_runs(const llama_kv_cells & cells) {
    ranges runs;
    const uint32_t n = cells.size();
    for (uint32_t i = 0; i < n;) {
        if (!cells.is_empty(i)) {
            ++i;
            continue;
        }
        uint32_t j = i;
        while (j < n && cells.is_empty(j)) {
            ++j;
        }
        runs.emplace_back(i, j);
        i = j;
    }
    return runs;
}

// the bytes of a stream's block of t ([n_embd, kv_size, n_stream]) that hold empty cells only, merged.  trans: the
// block is read as [kv_size, n_embd] (the transposed V of attention without flash attention): cell c of row d at
// (d * kv_size + c) * element size
ranges empty_bytes(const ggml_tensor * t, bool trans, uint32_t kv_size, const ranges & runs) {
    ranges out;
    auto add = [&](size_t a, size_t b) {
        if (!out.empty() && out.back().second == a) {
            out.back().second = b;
        } else {
            out.emplace_back(a, b);
        }
    };
    if (!trans) {
        for (const auto & [c0, c1] : runs) {
            add(c0 * t->nb[1], c1 * t->nb[1]);
        }
        return out;
    }
    const size_t es = ggml_type_size(t->type);
    for (int64_t d = 0; d < t->ne[0]; ++d) {
        for (const auto & [c0, c1] : runs) {
            add(((size_t) d * kv_size + c0) * es, ((size_t) d * kv_size + c1) * es);
        }
    }
    return out;
}

// the whole pages inside [a, b)
size_t whole_pages(uintptr_t a, uintptr_t b) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t a0 = (a + page - 1) & ~(page - 1), a1 = b & ~(page - 1);
    return a1 > a0 ? a1 - a0 : 0;
}

} // namespace

// the cache as its friend sees it: its tensors (K, V per layer), which are read transposed, its streams' empty runs
struct vis_kv_pages::view {
    std::vector<ggml_tensor *> ts;
    std::vector<bool>          trans;
    std::vector<ranges>        runs;  // per stream
    uint32_t kv_size = 0;

    // every host (tensor, stream) block: f(base, block bytes, its empty byte ranges)
    template <typename F> void each_block(F f) const {
        for (size_t i = 0; i < ts.size(); ++i) {
            const ggml_tensor * t = ts[i];
            if (!t || !t->data || !t->buffer || !ggml_backend_buffer_is_host(t->buffer)) {
                continue;
            }
            for (size_t s = 0; s < runs.size(); ++s) {
                f((uint8_t *) t->data + s * t->nb[2], (size_t) t->nb[2], empty_bytes(t, trans[i], kv_size, runs[s]));
            }
        }
    }
};

vis_kv_pages::view vis_kv_pages::view_of(const llama_kv_cache & kv) {
    view v;
    for (const auto & l : kv.layers) {
        v.ts.push_back(l.k);
        v.trans.push_back(false);
        v.ts.push_back(l.v);
        v.trans.push_back(kv.v_trans);
    }
    for (uint32_t s = 0; s < kv.n_stream; ++s) {
        v.runs.push_back(empty_runs(kv.v_cells[s]));
    }
    v.kv_size = kv.get_size();
    return v;
}

int64_t vis_kv_pages::release_empty(const llama_kv_cache & kv) {
    int64_t n = 0;
    view_of(kv).each_block([&](uint8_t * base, size_t, const ranges & empty) {
        for (const auto & [a, b] : empty) {
            n += vis_release_pages(base + a, b - a, false, false);
        }
    });
    return n;
}

int64_t vis_kv_pages::resident(const llama_kv_cache & kv) {
    int64_t n = 0;
    view_of(kv).each_block([&](uint8_t * base, size_t bytes, const ranges & empty) {
        n += (int64_t) bytes;
        for (const auto & [a, b] : empty) {
            n -= (int64_t) whole_pages((uintptr_t) (base + a), (uintptr_t) (base + b));
        }
    });
    return n;
}

int64_t vis_kv_pages::cell_bytes(const llama_kv_cache & kv) {
    int64_t n = 0;
    for (const auto & l : kv.layers) {
        n += l.k ? (int64_t) l.k->nb[1] : 0;
        n += l.v ? (int64_t) (l.v->nb[2] / l.v->ne[1]) : 0;
    }
    return n;
}

int64_t vis_kv_pages::used_cells(const llama_kv_cache & kv) {
    int64_t n = 0;
    for (uint32_t s = 0; s < kv.n_stream; ++s) {
        n += kv.v_cells[s].get_used();
    }
    return n;
}

int64_t vis_kv_pages::total(const llama_kv_cache & kv) {
    int64_t n = 0;
    for (const auto & l : kv.layers) {
        n += (l.k ? (int64_t) ggml_nbytes(l.k) : 0) + (l.v ? (int64_t) ggml_nbytes(l.v) : 0);
    }
    return n;
}

const llama_kv_cache * vis_kv_of(const llama_context * lctx) {
    return lctx ? dynamic_cast<const llama_kv_cache *>(lctx->get_memory()) : nullptr;
}

static bool online_on() {
    return vis_moe_settings_current().plan.online > 0;
}

void vis_kv_seq_removed(const llama_kv_cache & kv) {
    if (online_on()) {
        vis_kv_pages::release_empty(kv);
    }
}

void vis_kv_buffer_clear(ggml_backend_buffer * buf) {
    if (online_on()) {
        vis_buffer_clear_lazy(buf);
    } else {
        ggml_backend_buffer_clear(buf, 0);
    }
}
