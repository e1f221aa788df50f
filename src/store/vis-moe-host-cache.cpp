// vis-moe-host-cache.cpp - tier 2: the host-RAM expert cache (pinned blocks first, then an anonymous arena
// locked when allowed; one LRU over all layers) and the host-memory helpers (mlock, pinned allocations).
#include "vis-moe-host-cache.h"

#include "llama-impl.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include <sys/mman.h>

// ---------------------------------------------------------------------------
// memory locking
// ---------------------------------------------------------------------------
bool vis_mlock_region(void * addr, size_t size, const char * what) {
    if (size == 0) {
        return true;
    }
    if (mlock(addr, size) == 0) {
        return true;
    }
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
        LLAMA_LOG_WARN("vis-moe: could not lock %.1f MiB of %s in memory (%s); the kernel may swap them out. "
                       "Raise the limit with `ulimit -l unlimited` (or grant CAP_IPC_LOCK), or pass --moe-mlock off to silence this\n",
                       size / 1048576.0, what, std::strerror(errno));
    }
    return false;
}

ggml_backend_buffer_t vis_alloc_pinned(ggml_backend_buffer_type_t buft, size_t bytes) {
    if (!buft || bytes == 0) {
        return nullptr;
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, bytes);
    // CUDA's host buffer type hands out an ordinary CPU buffer when cudaMallocHost is refused: not pinned
    if (buf && (ggml_backend_buffer_get_type(buf) != buft || !ggml_backend_buffer_is_host(buf) ||
                ggml_backend_buffer_get_size(buf) < bytes)) {
        ggml_backend_buffer_free(buf);
        buf = nullptr;
    }
    return buf;
}

// ---------------------------------------------------------------------------
// tier 2: host-RAM expert cache
// ---------------------------------------------------------------------------
vis_host_cache::vis_host_cache(size_t budget_bytes, size_t block_bytes, bool lock, const vis_host_pinning & pin)
    : block(block_bytes) {
    if (block == 0 || budget_bytes < block) {
        return;
    }
    n_blocks = budget_bytes / block;
    if (pin.buft) {
        // discrete GPU: as many blocks as the cap allows in pinned memory, so copies from them are DMA
        const size_t want = std::min(n_blocks, pin.cap / block);
        if (want > 0) {
            pinned_buf = vis_alloc_pinned(pin.buft, want * block);
            refused    = pinned_buf == nullptr;
        }
        if (pinned_buf) {
            pinned   = (uint8_t *) ggml_backend_buffer_get_base(pinned_buf);
            n_pinned = want;
        }
    }
    arena_bytes = (n_blocks - n_pinned) * block;
    is_locked   = true;  // pinned memory is locked by the driver
    if (arena_bytes > 0) {
        void * p = mmap(nullptr, arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            if (pinned_buf) {
                ggml_backend_buffer_free(pinned_buf);
            }
            throw std::runtime_error("vis-moe: cannot allocate the " + std::to_string(arena_bytes >> 20) +
                                     " MiB host expert cache (" + std::strerror(errno) + "); lower --moe-host-mib");
        }
        arena     = (uint8_t *) p;
        is_locked = lock && vis_mlock_region(arena, arena_bytes, "the host expert cache");
    }
    free_blocks.reserve(n_blocks);
    for (size_t i = n_blocks; i-- > 0;) {
        free_blocks.push_back((uint32_t) i);  // block 0 first: pinned blocks are used before anonymous ones
    }
}

vis_host_cache::~vis_host_cache() {
    if (arena) {
        munmap(arena, arena_bytes);
    }
    if (pinned_buf) {
        ggml_backend_buffer_free(pinned_buf);
    }
}

uint8_t * vis_host_cache::find(int il, int e) {
    auto it = map.find(key(il, e));
    if (it == map.end()) {
        return nullptr;
    }
    lru.splice(lru.begin(), lru, it->second);
    return addr(it->second->second);
}

uint8_t * vis_host_cache::insert(int il, int e) {
    if (n_blocks == 0) {
        return nullptr;
    }
    const uint64_t k = key(il, e);
    auto it = map.find(k);
    if (it != map.end()) {
        lru.splice(lru.begin(), lru, it->second);
        return addr(it->second->second);
    }
    uint32_t b;
    if (!free_blocks.empty()) {
        b = free_blocks.back();
        free_blocks.pop_back();
    } else {
        auto & victim = lru.back();
        b = victim.second;
        map.erase(victim.first);
        lru.pop_back();
        n_evictions++;
    }
    lru.emplace_front(k, b);
    map[k] = lru.begin();
    return addr(b);
}

void vis_host_cache::erase(int il, int e) {
    auto it = map.find(key(il, e));
    if (it == map.end()) {
        return;
    }
    free_blocks.push_back(it->second->second);
    lru.erase(it->second);
    map.erase(it);
}
