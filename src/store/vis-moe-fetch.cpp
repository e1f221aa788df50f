// vis-moe-fetch.cpp - background expert reads (vis-moe-fetch.h).
#include "vis-moe-fetch.h"

#include <algorithm>
#include <chrono>
#include <exception>

#include <fcntl.h>

vis_moe_fetcher::vis_moe_fetcher(int n_workers, int direct_io) {
    for (int i = 0; i < std::max(1, n_workers); ++i) {
        ios.push_back(std::make_unique<vis_io_pool>(1, direct_io));
    }
    for (auto & io : ios) {
        vis_io_pool * p = io.get();
        workers.emplace_back([this, p] { worker_main(*p); });
    }
}

vis_moe_fetcher::~vis_moe_fetcher() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stop = true;
    }
    cv_work.notify_all();
    for (auto & w : workers) {
        w.join();
    }
}

void vis_moe_fetcher::submit(std::unique_ptr<vis_fetch_job> job) {
    {
        std::lock_guard<std::mutex> lock(mtx);
        if ((int) in_flight.size() <= job->il) {
            in_flight.resize(job->il + 1, 0);
        }
        in_flight[job->il]++;
        queue.push_back(std::move(job));
    }
    cv_work.notify_one();
}

void vis_moe_fetcher::read_ahead(std::vector<vis_fetch_job::range> ranges) {
    if (ranges.empty()) {
        return;
    }
    auto job = std::make_unique<vis_fetch_job>();
    job->advise = std::move(ranges);
    {
        std::lock_guard<std::mutex> lock(mtx);
        queue.push_back(std::move(job));
    }
    cv_work.notify_one();
}

int vis_moe_fetcher::pending(int il) {
    std::lock_guard<std::mutex> lock(mtx);
    int n = il < (int) in_flight.size() ? in_flight[il] : 0;
    for (const auto & j : finished) {
        n += j->il == il ? 1 : 0;
    }
    return n;
}

std::vector<std::unique_ptr<vis_fetch_job>> vis_moe_fetcher::cancel_queued(int il) {
    std::vector<std::unique_ptr<vis_fetch_job>> out;
    std::lock_guard<std::mutex> lock(mtx);
    for (auto & j : queue) {
        if (j->il == il && j->speculative) {
            out.push_back(std::move(j));
            in_flight[il]--;
        }
    }
    queue.erase(std::remove(queue.begin(), queue.end(), nullptr), queue.end());
    if (!out.empty()) {
        cv_done.notify_all();
    }
    return out;
}

void vis_moe_fetcher::demand_begin() {
    std::lock_guard<std::mutex> lock(mtx);
    demand++;
}

void vis_moe_fetcher::demand_end() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        demand--;
    }
    cv_work.notify_all();
}

std::vector<std::unique_ptr<vis_fetch_job>> vis_moe_fetcher::collect(int il, int64_t & waited_us) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mtx);
    cv_done.wait(lock, [&] { return il >= (int) in_flight.size() || in_flight[il] == 0; });
    waited_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    std::vector<std::unique_ptr<vis_fetch_job>> out;
    for (auto & j : finished) {
        if (j && j->il == il) {
            out.push_back(std::move(j));
        }
    }
    finished.erase(std::remove(finished.begin(), finished.end(), nullptr), finished.end());
    return out;
}

void vis_moe_fetcher::worker_main(vis_io_pool & io) {
    for (;;) {
        std::unique_ptr<vis_fetch_job> job;
        {
            std::unique_lock<std::mutex> lock(mtx);
            // on stop, the queue is still drained: a job owns a held slot that the context frees after us;
            // while demand reads run, no job starts (they need the disk now, a job only later)
            cv_work.wait(lock, [&] { return stop || (!queue.empty() && demand == 0); });
            if (queue.empty()) {
                return;
            }
            job = std::move(queue.front());
            queue.pop_front();
            job->started = true;
        }
        if (!job->advise.empty()) {
            for (const auto & r : job->advise) {
                posix_fadvise(r.fd, r.off, r.len, POSIX_FADV_WILLNEED);  // a hint: its failure changes nothing
            }
            continue;
        }
        try {
            job->reqs.front().src->file->check_unchanged();
            io.read(job->reqs);
            if (job->upload) {
                // discrete GPU: the copy into the held slot runs on the upload stream while the GPU computes;
                // the compute thread waits for its event when it collects the job
                job->event = job->upload->issue(job->copies);
            }
        } catch (const std::exception & e) {
            job->error = e.what();
        }
        {
            std::lock_guard<std::mutex> lock(mtx);
            in_flight[job->il]--;
            finished.push_back(std::move(job));
        }
        cv_done.notify_all();
    }
}
