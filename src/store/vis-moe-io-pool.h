// vis-moe-io-pool.h - tier 3 reads (docs/paging.md): one positioned read per expert slice of a deferred
// tensor (vis-moe-deferred.h), O_DIRECT where the filesystem allows it, a layer's misses read in parallel by a
// small pool of I/O threads.
#pragma once

#include "vis-moe-deferred.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
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

// test hook: VIS_MOE_FAULT_READ="IL:E" (or "*") makes reads of that expert fail with EIO
bool vis_fault_injected(int il, int e);
// the hook's value parsed strictly (unset or "": off); throws std::invalid_argument naming the variable for
// anything but "*" or "IL:E" with IL and E integers >= 0
void vis_fault_check_env();
