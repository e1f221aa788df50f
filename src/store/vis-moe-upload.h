// vis-moe-upload.h - the upload stream of a discrete-GPU cache (docs/paging.md#discrete-gpus).
//
// On a discrete GPU the slabs are device memory the CPU cannot write: an expert goes from the file (or tier 2)
// into host memory, and from there to its slot.  Three things make that copy cheap and let it overlap compute:
//   - pinned host memory: tier 2 (vis_host_cache) and the staging blocks (vis_staging_pool) come from the
//     device's host buffer type (cudaMallocHost on CUDA) within a cap (vis_pin_budget), so host-to-device
//     copies are DMA at full bandwidth and truly asynchronous;
//   - a second backend instance of the slab device (vis_moe_uploader): its own stream, so copies do not queue
//     behind the compute stream's kernels;
//   - events: a background read's copy is issued by the fetch worker right after its read, and the compute
//     thread waits only for that copy's event when it collects the job (vis-moe-fetch.h).
// Everything goes through the ggml backend API (no CUDA in src/).  CPU and unified-memory slabs (Jetson with
// managed memory) never get an uploader: they are written with memcpy, exactly as before.
//
// Threads.  issue() is called by the compute thread (misses of a pass, vis-moe-transfer.cpp) and by the fetch
// worker (background reads); one mutex serialises every call on the backend instance (ggml backends are not
// thread-safe; CUDA creates the stream on first use).  wait() may run on any thread; the compute thread calls
// it.  An event covers every copy issued on the stream before it, so a copy is never waited for too early,
// whatever the interleaving.  The host bytes a copy reads (a staging block, a tier-2 block) must stay valid and
// unchanged until its event completed: the owner of the event waits before releasing or reusing them.
#pragma once

#include "vis-moe-host-cache.h"  // vis_alloc_pinned

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// ---- pinned host memory ------------------------------------------------------

// How much page-locked host memory one context may take.  Pinned memory (cudaMallocHost) is locked by the
// driver outside RLIMIT_MEMLOCK, cannot be swapped, migrated or compacted, and users report OOMs and slow
// systems from pinning too much; so tier 2 and the staging blocks are pinned only up to this cap, the rest is
// the usual (mlocked) anonymous memory.
struct vis_pin_budget {
    ggml_backend_buffer_type_t buft = nullptr;  // the device's pinned host memory type; null: nothing is pinned
    size_t      cap  = 0;  // bytes
    size_t      used = 0;  // bytes pinned so far (tier 2 + staging)
    std::string why;       // how the cap was set, for the log
    size_t left() const { return cap > used ? cap - used : 0; }
};

// the cap from --moe-pin-mib: -1 = auto (25 % of MemTotal), 0 = never pin, N = N MiB
vis_pin_budget vis_pin_budget_from(int64_t pin_mib);

// Fixed-size host blocks between a tier and a device slab (one packed expert each): pinned while the budget
// allows, else ordinary memory.  Blocks are reused, never freed before the pool.  Thread-safe.
class vis_staging_pool {
public:
    // buft: pinned host memory type, or null (ordinary memory only); pin: the context's budget (may be null)
    vis_staging_pool(size_t block_bytes, ggml_backend_buffer_type_t buft, vis_pin_budget * pin);
    ~vis_staging_pool();
    vis_staging_pool(const vis_staging_pool &) = delete;
    vis_staging_pool & operator=(const vis_staging_pool &) = delete;

    // one block, returned to the pool when destroyed
    class block {
    public:
        block() = default;
        block(block && o) noexcept { *this = std::move(o); }
        block & operator=(block && o) noexcept;
        ~block() { release(); }
        uint8_t * data() const { return ptr; }
        bool pinned() const { return is_pinned; }
        explicit operator bool() const { return ptr != nullptr; }
        void release();
    private:
        friend class vis_staging_pool;
        vis_staging_pool * pool = nullptr;
        uint8_t * ptr = nullptr;
        bool is_pinned = false;
    };

    block  acquire();
    void   reserve(size_t n_blocks);  // make sure n_blocks are free (allocated ahead, e.g. at attach)
    size_t block_bytes() const { return block_size; }
    size_t pinned_bytes();
    size_t plain_bytes();

private:
    void grow(size_t n_blocks);  // under mtx

    size_t block_size;
    ggml_backend_buffer_type_t buft;
    vis_pin_budget * pin;
    std::mutex mtx;
    std::vector<std::pair<uint8_t *, bool>> free_list;  // (block, pinned)
    std::vector<ggml_backend_buffer_t> pinned_bufs;
    std::vector<std::vector<uint8_t>>  plain_bufs;
    size_t n_pinned = 0, n_plain = 0;  // blocks
    bool   warned   = false;
};

// ---- the upload stream ---------------------------------------------------------

// one host-to-device copy: n bytes from host src to dst at byte offset off
struct vis_upload_copy {
    ggml_tensor * dst;
    const void *  src;
    size_t        off;
    size_t        n;
};

class vis_moe_uploader {
public:
    // the upload stream of `dev`: a second backend instance and its events.  Without async copies or events
    // on the device (caps, or ggml_backend_event_new returning null), async() is false and copies are
    // synchronous ggml_backend_tensor_set calls, as before.  Logs one line saying which.
    explicit vis_moe_uploader(ggml_backend_dev_t dev);
    ~vis_moe_uploader();  // waits for every copy in flight
    vis_moe_uploader(const vis_moe_uploader &) = delete;
    vis_moe_uploader & operator=(const vis_moe_uploader &) = delete;

    bool async() const { return backend != nullptr; }
    ggml_backend_dev_t device() const { return dev; }
    // issue the copies and return an event that completes after them; nullptr when they are done already
    // (synchronous fallback, or nothing to copy)
    ggml_backend_event_t issue(const std::vector<vis_upload_copy> & copies);
    // block until `ev` (from issue) completed, then recycle it; nullptr: nothing to wait for
    void wait(ggml_backend_event_t ev);

    struct counters {
        int64_t n_issued   = 0;  // issue() calls with copies
        int64_t n_copies   = 0;
        int64_t bytes      = 0;
        int64_t wait_us    = 0;  // compute thread blocked in wait()
    };
    counters get_counters();
    void reset_counters();

private:
    ggml_backend_dev_t dev;
    ggml_backend_t     backend = nullptr;  // the second instance (its own stream); null: synchronous
    std::mutex mtx;
    std::vector<ggml_backend_event_t> all_events, free_events;
    counters cnt;
};

// ---- how the slabs are written (the rest of attach: vis-moe-attach-upload.h) ----------------

// Jetson: an integrated GPU whose buffers are CUDA managed memory (GGML_CUDA_ENABLE_UNIFIED_MEMORY=1)
bool vis_igpu_unified(ggml_backend_dev_t dev);
// is the memory behind buffer `buf` (on device `dev`) writable by the CPU?
bool vis_cpu_writable(ggml_backend_buffer_t buf, ggml_backend_dev_t dev);
