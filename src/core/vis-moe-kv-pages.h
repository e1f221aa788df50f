// vis-moe-kv-pages.h - the KV cache's pages resident only where its cells are used (VIS_MOE_ONLINE=on;
// src/core/vis-moe-kv-pages.cpp, patch 0016, docs/planning.md#online-controller).
//
// Upstream allocates the KV cache whole for n_ctx cells and clears it, which writes every page: a server asked for
// -c 4096 -np 4 holds all of it while idle.  With the online controller on:
//   - the clear drops the buffer's pages instead (vis_kv_buffer_clear, vis-pages.h): they read as the same zeros and
//     become resident as cells are written;
//   - after a sequence's cells are removed (seq_rm: a server slot's prompt replaced or cleared), every page that holds
//     only empty cells is dropped again.
// Exactness.  An empty cell is masked out of attention: with the mask's -INF its softmax weight is exactly 0, and
// flash attention skips it; a finite value times 0 adds nothing.  Whether an empty cell holds stale finite values
// (upstream) or zeros (a dropped page) therefore never changes an output; only pages holding no used cell are
// dropped (tests/test_online_controller.py compares logits both ways, with -fa on and off).
#pragma once

#include <cstdint>

class llama_kv_cache;
struct llama_context;

// the friend of llama_kv_cache (patch 0016): reads its layers' tensors and its cells
struct vis_kv_pages {
    // drop the pages of `kv` that hold only empty cells; the bytes dropped
    static int64_t release_empty(const llama_kv_cache & kv);
    // bytes of the pages of `kv` that hold a used cell: what is resident, after release_empty
    static int64_t resident(const llama_kv_cache & kv);
    // bytes one cell takes over all layers (K and V), and the cells in use
    static int64_t cell_bytes(const llama_kv_cache & kv);
    static int64_t used_cells(const llama_kv_cache & kv);
    // bytes of the whole cache
    static int64_t total(const llama_kv_cache & kv);

private:
    struct view;  // its tensors, how each is read, its streams' empty cells (vis-moe-kv-pages.cpp)
    static view view_of(const llama_kv_cache & kv);
};

// the plain KV cache of a context (not iswa, not hybrid), or null
const llama_kv_cache * vis_kv_of(const llama_context * lctx);
