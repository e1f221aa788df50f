// vis-moe-upload.cpp - the upload stream of a discrete-GPU cache: pinned host memory within a cap, staging
// blocks, a second backend instance and its events (vis-moe-upload.h).
#include "vis-moe-upload.h"

#include "llama-vis.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

// ---- pinned host memory ------------------------------------------------------

vis_pin_budget vis_pin_budget_from(int64_t pin_mib) {
    vis_pin_budget b;
    if (pin_mib == 0) {
        b.why = "--moe-pin-mib off";
    } else if (pin_mib > 0) {
        b.cap = (size_t) pin_mib << 20;
        b.why = "--moe-pin-mib " + std::to_string(pin_mib);
    } else {
        llama_vis_mem_info mi = {};
        llama_vis_mem_probe(&mi);
        b.cap = mi.mem_total > 0 ? (size_t) (mi.mem_total / 4) : 0;
        b.why = "25 % of MemTotal, --moe-pin-mib to change";
    }
    return b;
}

// ---- staging blocks ----------------------------------------------------------------

vis_staging_pool::vis_staging_pool(size_t block_bytes, ggml_backend_buffer_type_t buft_, vis_pin_budget * pin_)
    : block_size(std::max<size_t>(block_bytes, 1)), buft(buft_), pin(pin_) {}

vis_staging_pool::~vis_staging_pool() {
    for (auto * b : pinned_bufs) {
        ggml_backend_buffer_free(b);
    }
}

vis_staging_pool::block & vis_staging_pool::block::operator=(block && o) noexcept {
    if (this != &o) {
        release();
        pool      = o.pool;
        ptr       = o.ptr;
        is_pinned = o.is_pinned;
        o.pool = nullptr;
        o.ptr  = nullptr;
    }
    return *this;
}

void vis_staging_pool::block::release() {
    if (pool && ptr) {
        std::lock_guard<std::mutex> lock(pool->mtx);
        pool->free_list.emplace_back(ptr, is_pinned);
    }
    pool = nullptr;
    ptr  = nullptr;
}

void vis_staging_pool::grow(size_t n) {
    const bool want_pinned = buft != nullptr;
    size_t k = want_pinned && pin ? std::min(n, pin->left() / block_size) : (want_pinned ? n : 0);
    const char * why_plain = want_pinned && k < n ? "the pinned-memory cap is reached" : nullptr;
    if (k > 0) {
        if (ggml_backend_buffer_t buf = vis_alloc_pinned(buft, k * block_size)) {
            uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(buf);
            for (size_t i = 0; i < k; ++i) {
                free_list.emplace_back(base + i * block_size, true);
            }
            pinned_bufs.push_back(buf);
            n_pinned += k;
            n -= k;
            if (pin) {
                pin->used += k * block_size;
            }
        } else {
            why_plain = "the device refused to pin more host memory";
            buft = nullptr;  // do not ask again for every block
        }
    }
    if (n == 0) {
        return;
    }
    plain_bufs.emplace_back(n * block_size);
    uint8_t * base = plain_bufs.back().data();
    for (size_t i = 0; i < n; ++i) {
        free_list.emplace_back(base + i * block_size, false);
    }
    n_plain += n;
    if (why_plain && !warned) {
        warned = true;
        LLAMA_LOG_WARN("vis-moe: staging: %.2f MiB of staging blocks in ordinary memory (%s; %.2f MiB pinned): uploads "
                       "from them are staged by the driver, at lower bandwidth and not overlapped with compute\n",
                       n * block_size / 1048576.0, why_plain, n_pinned * block_size / 1048576.0);
    }
}

vis_staging_pool::block vis_staging_pool::acquire() {
    std::lock_guard<std::mutex> lock(mtx);
    if (free_list.empty()) {
        grow(std::max<size_t>(4, n_pinned + n_plain) / 2);  // grows by half what it holds, at least 2 blocks
    }
    block b;
    b.pool      = this;
    b.ptr       = free_list.back().first;
    b.is_pinned = free_list.back().second;
    free_list.pop_back();
    return b;
}

void vis_staging_pool::reserve(size_t n_blocks) {
    std::lock_guard<std::mutex> lock(mtx);
    if (free_list.size() < n_blocks) {
        grow(n_blocks - free_list.size());
    }
}

size_t vis_staging_pool::pinned_bytes() {
    std::lock_guard<std::mutex> lock(mtx);
    return n_pinned * block_size;
}

size_t vis_staging_pool::plain_bytes() {
    std::lock_guard<std::mutex> lock(mtx);
    return n_plain * block_size;
}

// ---- the upload stream ---------------------------------------------------------

vis_moe_uploader::vis_moe_uploader(ggml_backend_dev_t d) : dev(d) {
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    const char * why = nullptr;
    if (!props.caps.async) {
        why = "the device has no asynchronous copies";
    } else if (!props.caps.events) {
        why = "the device has no events";
    } else if (!(backend = ggml_backend_dev_init(dev, nullptr))) {
        why = "a second backend instance of the device could not be created";
    } else if (ggml_backend_event_t ev = ggml_backend_event_new(dev)) {
        all_events.push_back(ev);
        free_events.push_back(ev);
    } else {
        why = "ggml_backend_event_new returned no event";
        ggml_backend_free(backend);
        backend = nullptr;
    }
    if (backend) {
        LLAMA_LOG_INFO("vis-moe: uploads to %s: asynchronous, on a second stream of the device (its own backend "
                       "instance), ordered by events: background reads are copied while the GPU computes\n",
                       ggml_backend_dev_name(dev));
    } else {
        LLAMA_LOG_INFO("vis-moe: uploads to %s: synchronous (%s); background reads still overlap compute, their "
                       "copies into the slabs do not\n", ggml_backend_dev_name(dev), why);
    }
}

vis_moe_uploader::~vis_moe_uploader() {
    std::lock_guard<std::mutex> lock(mtx);
    if (backend) {
        ggml_backend_synchronize(backend);  // no copy may outlive the slabs and staging blocks freed after us
    }
    for (auto * ev : all_events) {
        ggml_backend_event_free(ev);
    }
    if (backend) {
        ggml_backend_free(backend);
    }
}

ggml_backend_event_t vis_moe_uploader::issue(const std::vector<vis_upload_copy> & copies) {
    if (copies.empty()) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(mtx);
    cnt.n_issued++;
    for (const auto & c : copies) {
        cnt.n_copies++;
        cnt.bytes += (int64_t) c.n;
        if (backend) {
            ggml_backend_tensor_set_async(backend, c.dst, c.src, c.off, c.n);
        } else {
            ggml_backend_tensor_set(c.dst, c.src, c.off, c.n);
        }
    }
    if (!backend) {
        return nullptr;
    }
    ggml_backend_event_t ev = nullptr;
    if (!free_events.empty()) {
        ev = free_events.back();
        free_events.pop_back();
    } else if ((ev = ggml_backend_event_new(dev)) != nullptr) {
        all_events.push_back(ev);
    } else {
        ggml_backend_synchronize(backend);  // no event to give: done when we return
        return nullptr;
    }
    ggml_backend_event_record(ev, backend);
    return ev;
}

void vis_moe_uploader::wait(ggml_backend_event_t ev) {
    if (!ev) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    ggml_backend_event_synchronize(ev);
    const int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(mtx);
    cnt.wait_us += us;
    free_events.push_back(ev);
}

vis_moe_uploader::counters vis_moe_uploader::get_counters() {
    std::lock_guard<std::mutex> lock(mtx);
    return cnt;
}

void vis_moe_uploader::reset_counters() {
    std::lock_guard<std::mutex> lock(mtx);
    cnt = {};
}

// ---- attach: how the slabs are written --------------------------------------------------

bool vis_igpu_unified(ggml_backend_dev_t dev) {
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    const char * um = std::getenv("GGML_CUDA_ENABLE_UNIFIED_MEMORY");
    return props.type == GGML_BACKEND_DEVICE_TYPE_IGPU && um && *um && std::strcmp(um, "0") != 0;
}

bool vis_cpu_writable(ggml_backend_buffer_t buf, ggml_backend_dev_t dev) {
    return ggml_backend_buffer_is_host(buf) || vis_igpu_unified(dev);
}
