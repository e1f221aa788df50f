// vis-pages.h - giving pages of host memory back to the kernel (src/store/vis-pages.cpp).
//
// The expert slabs and the KV cache are private anonymous memory (ggml's CPU buffers).  A page dropped with
// madvise(MADV_DONTNEED) reads back as zeros and becomes resident again only when written, so "released" memory
// costs nothing until it is used again, and holds what ggml_backend_buffer_clear(buf, 0) would have written.
// One function for every caller: slab lending (vis-moe-lend.cpp), the online controller's inactive slots and the
// KV cache's empty cells (docs/planning.md#online-controller).
#pragma once

#include "ggml-backend.h"

#include <cstddef>
#include <cstdint>

// drop the whole pages inside [p, p + n) (munlocked first when `unlock`); with zero_edges the partial pages at
// both ends are zeroed with memset, so that all of [p, p + n) reads as zeros afterwards.  Returns the bytes dropped.
int64_t vis_release_pages(void * p, size_t n, bool unlock, bool zero_edges);

// ggml_backend_buffer_clear(buf, 0) without touching every page: a host buffer's whole pages are dropped and its
// partial pages zeroed (the same zeros, resident only once written); any other buffer is cleared as upstream does
void vis_buffer_clear_lazy(ggml_backend_buffer_t buf);

// the bytes of the whole pages inside [p, p + n) that are resident (mincore; anonymous memory included); -1 on error
int64_t vis_resident_bytes(const void * p, size_t n);

// this process's resident bytes (VmRSS, from /proc/self/statm: one read, 5 us measured on the dev VM, cheap enough
// for every ubatch); -1 on error
int64_t vis_process_rss();
