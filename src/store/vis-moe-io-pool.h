// vis-moe-io-pool.h - tier 3 reads (docs/paging.md): one positioned read per expert slice of a deferred
// tensor (vis-moe-deferred.h), O_DIRECT where the filesystem allows it, a layer's misses read in parallel by a
// small pool of I/O threads.
#pragma once

#include "vis-moe-deferred.h"

#include "ggml-backend.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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
    int64_t wait_us      = 0;  // wall time reads were under way (some submission not finished)
    int64_t n_direct     = 0;  // slices read with O_DIRECT
    int64_t bytes_copied = 0;  // payload bytes copied out of a bounce region (the rest of an O_DIRECT read landed in place)
};

// One thread's O_DIRECT bounce region: page-aligned anonymous memory of exactly bytes(slice) for the largest slice
// read so far (mmap, so no allocator slack: llama_vis_moe_io_buffer_bytes counts it exactly).
class vis_bounce {
public:
    vis_bounce() = default;
    ~vis_bounce();
    vis_bounce(const vis_bounce &) = delete;
    vis_bounce & operator=(const vis_bounce &) = delete;
    vis_bounce(vis_bounce && o) noexcept : p(o.p), n(o.n) { o.p = nullptr; o.n = 0; }
    // at least `len` bytes (an aligned span of len bytes), 4 KiB-aligned; throws std::bad_alloc
    uint8_t * get(size_t len);
    // the region a slice of slice_bytes needs at most: its 4 KiB-aligned superset at any offset
    static int64_t bytes(int64_t slice_bytes);
private:
    uint8_t * p = nullptr;
    size_t    n = 0;
};

// The placement that lets O_DIRECT reads land in place: the tensors of c in one buffer of buft; on a host buffer
// type each tensor t with page_pos(t) >= 0 starts at an address whose offset within its 4 KiB page is page_pos(t)
// (an expert slab at its file tensor's offset in the page: every slot's whole pages of an expert read are then
// 4 KiB-aligned in memory as in the file, vis_io_pool reads them straight into the slot), at most
// VIS_DIO_ALIGN bytes after the tensor before it; the others as ggml places them.  Other buffer types:
// ggml_backend_alloc_ctx_tensors_from_buft.  nullptr when the allocation fails.
constexpr size_t VIS_DIO_ALIGN = 4096;  // O_DIRECT's alignment: the page reads and the slabs' placement use
ggml_backend_buffer_t vis_dio_alloc_tensors(ggml_context * c, ggml_backend_buffer_type_t buft,
                                            const std::function<int64_t(const ggml_tensor *)> & page_pos);
// the placement rule of vis_dio_alloc_tensors for one tensor: the first address at or after p whose offset within
// its 4 KiB page is page_pos (at most VIS_DIO_ALIGN - 1 bytes on); p padded to `align` instead where page_pos < 0 or
// is not a multiple of align.  The staging buffers of staged streaming place their tensors by it too.
char * vis_dio_place(char * p, int64_t page_pos, size_t align);

// A small pool of I/O threads: the misses of one layer are read in parallel.  Reads go through one FIFO of expert
// slices, each slice tagged with the ticket of the submission it belongs to: read() submits and waits, reading too;
// submit() queues and returns at once (decode's misses read while the layer computes, docs/paging.md#reads-overlapped-
// with-compute-in-decode), and wait() later waits for that ticket, helping with the queued slices up to it.  One
// thread at a time calls read() and wait() (the compute thread): it reads with bounce region 0.
class vis_io_pool {
public:
    using clock = std::chrono::steady_clock;

    vis_io_pool(int n_threads, int direct_io /* -1 auto, 0 off, 1 on */);
    ~vis_io_pool();  // finishes the slices being read; queued ones are dropped (their memory may be freed next)
    // read all, in parallel; throws vis_io_error naming the file, tensor and expert of the first failure
    void read(const std::vector<vis_read_req> & reqs);
    // queue the reads behind those submitted before (the pool's threads read them) and return their ticket
    uint64_t submit(const std::vector<vis_read_req> & reqs);
    // wait until ticket t's reads are done, reading queued slices of tickets up to t meanwhile; throws as read();
    // returns when its last slice finished.  The counters count a ticket once it was waited for.
    clock::time_point wait(uint64_t t);
    const vis_io_counters & counters() const { return cnt; }
    void reset_counters() { cnt = {}; }
    int  n_threads() const { return (int) workers.size() + 1; }
    bool direct() const { return direct_io != 0; }

private:
    struct ticket_state {
        std::vector<vis_read_req> reqs;
        size_t            left = 0;      // slices not finished
        std::string       error;         // the first failure
        int64_t           dev_bytes = 0, n_direct = 0, copied = 0;
        clock::time_point done;
    };
    struct slice {
        uint64_t     ticket;
        vis_read_req req;
    };

    void worker_main(int idx);
    struct read_result {
        int64_t dev_bytes = 0;  // bytes requested from storage
        int64_t copied    = 0;  // payload bytes copied out of the bounce region
        bool    direct    = false;
    };
    void read_one(const vis_read_req & r, vis_bounce & bounce, read_result & res);
    // read one queued slice (taken under `lock`, read without it) with bounce region idx
    void run_slice(std::unique_lock<std::mutex> & lock, int idx);

    std::atomic<int> direct_io;
    std::vector<std::thread> workers;
    std::vector<vis_bounce> bounces;  // one aligned bounce region per thread

    std::mutex mtx;
    std::condition_variable cv_work, cv_done;
    std::deque<slice> queue;
    std::map<uint64_t, ticket_state> tickets;  // submitted, not waited for
    uint64_t next_ticket = 1;
    int      outstanding = 0;                  // tickets with slices not finished
    clock::time_point busy_since;              // since when some ticket is outstanding
    int64_t  busy_us = 0;                      // busy time not yet in the counters
    bool stop = false;

    vis_io_counters cnt;
};

// test hook: VIS_MOE_FAULT_READ="IL:E" (or "*") makes reads of that expert fail with EIO
bool vis_fault_injected(int il, int e);
// the hook's value parsed strictly (unset or "": off); throws std::invalid_argument naming the variable for
// anything but "*" or "IL:E" with IL and E integers >= 0
void vis_fault_check_env();
