// vis-moe-fetch.h - reading experts into slots in the background.
//
// Substitution (vis-moe-substitute.h) lets a token run a resident stand-in instead of a missing expert; the
// missing expert is still read, here, off the critical path, so the next tokens hit.  The planner picks the
// slot (a victim no pair of the running ubatch uses), holds it in the policy, and submits a job; the layer's
// next ubatch collects the layer's jobs (waiting for any still in flight) before it plans.
//
// Memory safety: a job writes only its own slot (CPU-writable slabs) or its own staging block (device slabs, and
// managed memory the CPU may not write while kernels run); a held slot is never a victim and no id points at it
// until it is collected, so no kernel reads it while it is written.  The staged bytes reach the slot either
// from the worker, right after the read, as an asynchronous copy on the upload stream (discrete GPU with events,
// vis-moe-upload.h: the compute thread waits for that copy's event when it collects the job), or from the
// compute thread when it collects the job (no events, and unified memory, where the pass op writes between
// kernels).  A job owns its staging block until its copy completed: its destructor waits for the event.
#pragma once

#include "vis-moe-store.h"
#include "vis-moe-upload.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct vis_fetch_job {
    int il     = -1;
    int expert = -1;
    int slot   = -1;
    std::vector<vis_read_req> reqs;         // into the slot, or into `staging`
    vis_staging_pool::block   staging;      // staged jobs: the packed expert, copied to the slot after the read
    bool        staged = false;
    bool        speculative = false;        // a prefetch (vis-moe-prefetch.h): dropped if not started when its layer runs
    bool        started     = false;        // the worker took it
    std::string error;                      // "" = read
    // asynchronous upload (discrete GPU with events): the worker issues `copies` after the read; `event`
    // completes when they did
    vis_moe_uploader *           upload = nullptr;
    // a read-ahead hint instead of a read (il = -1): file ranges the kernel reads into the page cache
    struct range {
        int   fd;
        off_t off;
        off_t len;
    };
    std::vector<range> advise;
    std::vector<vis_upload_copy> copies;
    ggml_backend_event_t         event  = nullptr;

    vis_fetch_job() = default;
    vis_fetch_job(const vis_fetch_job &) = delete;
    vis_fetch_job & operator=(const vis_fetch_job &) = delete;
    ~vis_fetch_job() { wait_upload(); }  // before the staging block goes back to its pool
    void wait_upload() {
        if (upload && event) {
            upload->wait(event);
        }
        event = nullptr;
    }
};

// the reader of background reads (its workers, the queue); into which slot, and what collecting does: vis-moe-fetch-slots.h

class vis_moe_fetcher {
public:
    // n_workers jobs read at a time (each its own positioned reads: a queue depth of n_workers)
    vis_moe_fetcher(int n_workers, int direct_io);
    ~vis_moe_fetcher();  // finishes the jobs in flight (they write memory the context owns)
    vis_moe_fetcher(const vis_moe_fetcher &) = delete;
    vis_moe_fetcher & operator=(const vis_moe_fetcher &) = delete;

    void submit(std::unique_ptr<vis_fetch_job> job);
    // ask the kernel to read these ranges into the page cache (posix_fadvise WILLNEED), from a worker: the
    // caller does not wait for the submission of the reads; nothing to collect
    void read_ahead(std::vector<vis_fetch_job::range> ranges);
    // the jobs of layer il, all finished (waits for those in flight); waited_us: how long it waited
    std::vector<std::unique_ptr<vis_fetch_job>> collect(int il, int64_t & waited_us);
    // jobs of layer il submitted and not collected
    int pending(int il);
    // the speculative jobs of layer il the worker has not started: taken out of the queue, for the caller to
    // release their slots
    std::vector<std::unique_ptr<vis_fetch_job>> cancel_queued(int il);
    // demand reads run (vis_moe_fill_slots): the worker starts no job meanwhile, so they get the disk
    void demand_begin();
    void demand_end();

private:
    void worker_main(vis_io_pool & io);

    std::vector<std::unique_ptr<vis_io_pool>> ios;  // one per worker, one thread each: its own reads
    std::mutex mtx;
    std::condition_variable cv_work, cv_done;
    std::deque<std::unique_ptr<vis_fetch_job>>  queue;
    std::vector<std::unique_ptr<vis_fetch_job>> finished;
    std::vector<int> in_flight;  // per layer: submitted, not finished
    int  demand = 0;             // demand reads running
    bool stop = false;
    std::vector<std::thread> workers;
};

// RAII: demand reads of a pass are running (the background worker starts no new job)
struct vis_fetch_demand {
    vis_moe_fetcher * f;
    explicit vis_fetch_demand(vis_moe_fetcher * f_) : f(f_) { if (f) f->demand_begin(); }
    ~vis_fetch_demand() { if (f) f->demand_end(); }
    vis_fetch_demand(const vis_fetch_demand &) = delete;
    vis_fetch_demand & operator=(const vis_fetch_demand &) = delete;
};
