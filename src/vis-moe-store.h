// vis-moe-store.h - the backing tiers of the expert cache (docs/paging.md):
//
//   tier 1  device slabs              src/vis-moe-cache.cpp
//   tier 2  host-RAM expert cache     vis_host_cache      (its own byte budget and LRU)
//   tier 3  the GGUF file on NVMe     vis_expert_file     (one positioned read per expert slice)
//
// Routed-expert tensors of managed layers are "deferred" at model load (patch
// 0004): they get a mapped address like upstream's lazy tensors but are never
// read by the loader.  The cache reads single experts from the file on demand.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

// ---- model load (patch 0004, llama_model_loader::create_tensor) -------------

// Should tensor `name` of layer `bid` be deferred (not loaded; read per expert on demand)?
// Decided from the process-wide vis-moe parameters at load time.
bool vis_moe_defer_tensor(const void * loader, const char * name, int bid, int64_t n_expert);
// Every tensor created by the loader passes here: a deferred one records where its
// bytes live in the file (fd of the loader's file, data offset); any other clears a
// stale record for the same pointer.
void vis_moe_tensor_created(const ggml_tensor * t, bool deferred, int fd, uint64_t offs);

// ---- tier 3: the file ---------------------------------------------------------

struct vis_io_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// one opened GGUF file
struct vis_gguf_file {
    std::string path;
    int      fd        = -1;   // buffered reads
    int      fd_direct = -1;   // O_DIRECT, -1 where the filesystem refuses it
    uint64_t size      = 0;
    int64_t  mtime_ns  = 0;
    int64_t  ctime_ns  = 0;
    uint64_t ino       = 0;
    ~vis_gguf_file();
    // throws vis_io_error if the file's size, mtime, ctime or inode changed since it was opened (a truncation,
    // an append, an in-place rewrite even with the mtime restored)
    void check_unchanged() const;
};

// where the bytes of one deferred expert tensor live
struct vis_deferred_tensor {
    std::shared_ptr<vis_gguf_file> file;
    std::string name;
    uint64_t    offs     = 0;  // file offset of expert 0
    size_t      nb2      = 0;  // bytes per expert
    int64_t     n_expert = 0;
};

// record of a deferred tensor, or nullptr
const vis_deferred_tensor * vis_moe_deferred(const ggml_tensor * t);

// one read: expert `expert` of `src` into `dst` (nb2 bytes of host memory)
struct vis_read_req {
    const vis_deferred_tensor * src;
    int    il;
    int    expert;
    void * dst;
};

struct vis_io_counters {
    int64_t n_reads      = 0;  // expert slices read
    int64_t bytes_read   = 0;  // payload bytes
    int64_t bytes_device = 0;  // bytes requested from storage (with O_DIRECT alignment)
    int64_t wait_us      = 0;  // wall time the compute waited for reads
    int64_t n_direct     = 0;  // slices read with O_DIRECT
};

// A small pool of I/O threads: the misses of one layer are read in parallel.
class vis_io_pool {
public:
    vis_io_pool(int n_threads, int direct_io /* -1 auto, 0 off, 1 on */);
    ~vis_io_pool();
    // read all, in parallel; throws vis_io_error naming the file, tensor and expert of the first failure
    void read(const std::vector<vis_read_req> & reqs);
    const vis_io_counters & counters() const { return cnt; }
    void reset_counters() { cnt = {}; }
    int  n_threads() const { return (int) workers.size() + 1; }
    bool direct() const { return direct_io != 0; }

private:
    void worker_main(int idx);
    void read_one(const vis_read_req & r, std::vector<uint8_t> & bounce, int64_t & dev_bytes, bool & used_direct);
    void run_jobs(int idx);

    std::atomic<int> direct_io;
    std::vector<std::thread> workers;
    std::vector<std::vector<uint8_t>> bounces;  // one aligned bounce region per thread

    std::mutex mtx;
    std::condition_variable cv_work, cv_done;
    const std::vector<vis_read_req> * jobs = nullptr;
    size_t next = 0, n_done = 0;
    uint64_t generation = 0;
    bool stop = false;
    std::string first_error;
    int64_t dev_bytes_acc = 0, n_direct_acc = 0;

    vis_io_counters cnt;
};

// ---- tier 2: host-RAM expert cache ------------------------------------------

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

// ---- machine memory ---------------------------------------------------------

// lock [addr, addr+size) in memory; warns once per process if refused. true if locked.
bool vis_mlock_region(void * addr, size_t size, const char * what);

// `bytes` of pinned host memory from `buft` (a device's host buffer type).  nullptr when buft is null, the
// allocation fails, or the backend fell back to ordinary memory (CUDA does so silently when cudaMallocHost is
// refused): what comes back is pinned or nothing.
ggml_backend_buffer_t vis_alloc_pinned(ggml_backend_buffer_type_t buft, size_t bytes);

// test hook: VIS_MOE_FAULT_READ="IL:E" (or "*") makes reads of that expert fail with EIO
bool vis_fault_injected(int il, int e);
