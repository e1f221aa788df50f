// vis-moe-fetch.cpp - background expert reads (vis-moe-fetch.h).
#include "vis-moe-fetch.h"

#include <algorithm>
#include <chrono>
#include <exception>

vis_moe_fetcher::vis_moe_fetcher(int direct_io) : io(1, direct_io) {
    worker = std::thread([this] { worker_main(); });
}

vis_moe_fetcher::~vis_moe_fetcher() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stop = true;
    }
    cv_work.notify_all();
    worker.join();
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

int vis_moe_fetcher::pending(int il) {
    std::lock_guard<std::mutex> lock(mtx);
    int n = il < (int) in_flight.size() ? in_flight[il] : 0;
    for (const auto & j : finished) {
        n += j->il == il ? 1 : 0;
    }
    return n;
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

void vis_moe_fetcher::worker_main() {
    for (;;) {
        std::unique_ptr<vis_fetch_job> job;
        {
            std::unique_lock<std::mutex> lock(mtx);
            // on stop, the queue is still drained: a job owns a held slot that the context frees after us
            cv_work.wait(lock, [&] { return stop || !queue.empty(); });
            if (queue.empty()) {
                return;
            }
            job = std::move(queue.front());
            queue.pop_front();
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
