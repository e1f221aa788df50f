// vis-moe-host-cache.h - tier 2 of the expert cache (docs/paging.md): the host-RAM expert cache (its own byte
// budget and LRU, pinned blocks first on a discrete GPU), and the host-memory helpers it and the slabs use
// (mlock, pinned allocations from a device's host buffer type).
#pragma once

#include "ggml-backend.h"

#include <cstdint>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

// where tier 2's arena comes from: up to `cap` bytes of pinned host memory from `buft` (a discrete GPU's host
// buffer type, vis-moe-upload.h), the rest anonymous memory.  The default (no buft) is anonymous memory only:
// CPU and unified memory, whose slabs the CPU writes directly.
struct vis_host_pinning {
    ggml_backend_buffer_type_t buft = nullptr;
    size_t cap = 0;
};

// Fixed-size blocks keyed by (layer, expert), one LRU over all layers.  The blocks live in a pinned arena (the
// first ones, see vis_host_pinning) and an anonymous arena (the rest; locked in memory when allowed).
class vis_host_cache {
public:
    vis_host_cache(size_t budget_bytes, size_t block_bytes, bool lock, const vis_host_pinning & pin = {});
    ~vis_host_cache();
    vis_host_cache(const vis_host_cache &) = delete;
    vis_host_cache & operator=(const vis_host_cache &) = delete;
    size_t capacity_blocks() const { return n_blocks; }
    size_t used_blocks() const { return map.size(); }
    size_t block_bytes() const { return block; }
    bool   locked() const { return is_locked; }
    size_t pinned_bytes() const { return n_pinned * block; }
    bool   pin_refused() const { return refused; }  // pinning was asked for and the allocation failed
    // the block of (il, e) or nullptr; a hit moves it to the front of the LRU
    uint8_t * find(int il, int e);
    // a block for (il, e), evicting the least recently used one; nullptr if the cache has no blocks
    uint8_t * insert(int il, int e);
    void erase(int il, int e);

    int64_t n_evictions = 0;

private:
    static uint64_t key(int il, int e) { return ((uint64_t) (uint32_t) il << 32) | (uint32_t) e; }
    uint8_t * addr(uint32_t b) const { return b < n_pinned ? pinned + (size_t) b * block : arena + (size_t) (b - n_pinned) * block; }
    size_t    block = 0, n_blocks = 0;
    uint8_t * arena = nullptr;           // anonymous: blocks n_pinned..n_blocks-1
    size_t    arena_bytes = 0;
    ggml_backend_buffer_t pinned_buf = nullptr;
    uint8_t * pinned   = nullptr;        // pinned: blocks 0..n_pinned-1 (handed out first)
    size_t    n_pinned = 0;
    bool      refused  = false;
    bool      is_locked = false;
    std::vector<uint32_t> free_blocks;
    std::list<std::pair<uint64_t, uint32_t>> lru;  // front = most recent; (key, block)
    std::unordered_map<uint64_t, std::list<std::pair<uint64_t, uint32_t>>::iterator> map;
};

// ---- host memory --------------------------------------------------------------

// lock [addr, addr+size) in memory; warns once per process if refused. true if locked.
bool vis_mlock_region(void * addr, size_t size, const char * what);

// `bytes` of pinned host memory from `buft` (a device's host buffer type).  nullptr when buft is null, the
// allocation fails, or the backend fell back to ordinary memory (CUDA does so silently when cudaMallocHost is
// refused): what comes back is pinned or nothing.
ggml_backend_buffer_t vis_alloc_pinned(ggml_backend_buffer_type_t buft, size_t bytes);
