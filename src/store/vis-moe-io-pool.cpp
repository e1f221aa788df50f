// vis-moe-io-pool.cpp - tier 3 reads: expert slices from the GGUF file, O_DIRECT through an aligned bounce
// buffer per I/O thread (buffered with the pages dropped where refused), the I/O thread pool, and the read
// fault injection the tests use.
#include "vis-moe-io-pool.h"
#include "vis-moe-settings.h"
#include "llama-vis.h"

#include "llama-impl.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

// ---------------------------------------------------------------------------
// fault injection (tests)
// ---------------------------------------------------------------------------
namespace {
struct fault_spec {
    bool any = false;      // "*"
    int  il  = -1, e = -1; // "IL:E"; -1: off
};

fault_spec parse_fault_spec(const char * spec) {
    fault_spec f;
    if (spec == nullptr || *spec == '\0') {
        return f;
    }
    const std::string v = spec;
    if (v == "*") {
        f.any = true;
        return f;
    }
    const size_t colon = v.find(':');
    const char * what = "VIS_MOE_FAULT_READ";
    if (colon == std::string::npos) {
        throw std::invalid_argument(std::string(what) + ": expected '*' or LAYER:EXPERT (integers >= 0), got '" + v + "'");
    }
    f.il = (int) vis_parse_int(std::string(what) + " layer", v.substr(0, colon), 0, 1 << 16);
    f.e  = (int) vis_parse_int(std::string(what) + " expert", v.substr(colon + 1), 0, 1 << 16);
    return f;
}
} // namespace

void vis_fault_check_env() {
    parse_fault_spec(std::getenv("VIS_MOE_FAULT_READ"));
}

bool vis_fault_injected(int il, int e) {
    static const fault_spec f = [] {
        try {
            return parse_fault_spec(std::getenv("VIS_MOE_FAULT_READ"));
        } catch (const std::exception &) {
            return fault_spec();  // reported at context creation (vis_fault_check_env), before any read
        }
    }();
    return f.any || (f.il == il && f.e == e);
}

// ---------------------------------------------------------------------------
// I/O pool
// ---------------------------------------------------------------------------
vis_io_pool::vis_io_pool(int n_threads, int direct_io_) : direct_io(direct_io_) {
    n_threads = std::max(1, n_threads);
    bounces.resize(n_threads);
    for (int i = 1; i < n_threads; ++i) {
        workers.emplace_back([this, i] { worker_main(i); });
    }
}

vis_io_pool::~vis_io_pool() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stop = true;
    }
    cv_work.notify_all();
    for (auto & w : workers) {
        w.join();
    }
}

vis_bounce::~vis_bounce() {
    if (p) {
        munmap(p, n);
    }
}

uint8_t * vis_bounce::get(size_t len) {
    if (len > n) {
        if (p) {
            munmap(p, n);
            p = nullptr;
            n = 0;
        }
        const size_t want = (len + VIS_DIO_ALIGN - 1) & ~(size_t) (VIS_DIO_ALIGN - 1);
        void * m = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            throw std::bad_alloc();
        }
        p = (uint8_t *) m;
        n = want;
    }
    return p;
}

int64_t vis_bounce::bytes(int64_t slice_bytes) {
    // the aligned superset of slice_bytes at an unaligned offset spans one page more than the slice rounded up
    const int64_t a = (int64_t) VIS_DIO_ALIGN;
    return slice_bytes <= 0 ? 0 : (slice_bytes + a - 1) / a * a + a;
}

int64_t llama_vis_moe_io_buffer_bytes(int32_t io_threads, int64_t slice_bytes, int32_t n_slab_tensors) {
    // the demand reads' pool (io_threads regions) and the fetch workers of background reads and staged streaming
    // (at most io_threads, one region each: vis_moe_fetcher); each slab tensor placed in its page
    return 2 * (int64_t) std::max(1, io_threads) * vis_bounce::bytes(slice_bytes) +
           (int64_t) std::max(0, n_slab_tensors) * (int64_t) VIS_DIO_ALIGN;
}

char * vis_dio_place(char * p, int64_t page_pos, size_t align) {
    const size_t A = VIS_DIO_ALIGN;
    if (page_pos >= 0 && page_pos % (int64_t) align == 0) {
        return p + ((size_t) page_pos + A - ((uintptr_t) p % A)) % A;  // the next address at that offset in its page
    }
    return (char *) GGML_PAD((uintptr_t) p, align);
}

ggml_backend_buffer_t vis_dio_alloc_tensors(ggml_context * c, ggml_backend_buffer_type_t buft,
                                            const std::function<int64_t(const ggml_tensor *)> & page_pos) {
    if (!ggml_backend_buft_is_host(buft)) {
        return ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
    }
    const size_t align = ggml_backend_buft_get_alignment(buft);
    const size_t A     = VIS_DIO_ALIGN;
    size_t size = 0;
    for (ggml_tensor * t = ggml_get_first_tensor(c); t; t = ggml_get_next_tensor(c, t)) {
        size += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), align) + (page_pos(t) >= 0 ? A : 0);
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, std::max<size_t>(size, 1));
    if (!buf) {
        return nullptr;
    }
    char * p = (char *) ggml_backend_buffer_get_base(buf);
    for (ggml_tensor * t = ggml_get_first_tensor(c); t; t = ggml_get_next_tensor(c, t)) {
        p = vis_dio_place(p, page_pos(t), align);
        if (ggml_backend_tensor_alloc(buf, t, p) != GGML_STATUS_SUCCESS) {
            ggml_backend_buffer_free(buf);
            return nullptr;
        }
        p += ggml_backend_buft_get_alloc_size(buft, t);
    }
    return buf;
}

static std::string read_error(const vis_read_req & r, const std::string & what) {
    return "vis-moe: failed to read expert " + std::to_string(r.expert) + " of tensor " + r.src->name + " from " +
           r.src->file->path + " (offset " + std::to_string(r.src->offs + (uint64_t) r.expert * r.src->nb2) + ", " +
           std::to_string(r.src->nb2) + " bytes): " + what;
}

// read the file from off into the buffers of iov, in order, until they are full; returns bytes read (fewer only at
// end of file or on an error, then err is set)
static size_t preadv_full(int fd, struct iovec * iov, int cnt, uint64_t off, int & err) {
    size_t done = 0;
    err = 0;
    while (cnt > 0) {
        const ssize_t r = preadv(fd, iov, cnt, (off_t) (off + done));
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            err = errno;
            return done;
        }
        if (r == 0) {
            break;
        }
        done += (size_t) r;
        size_t k = (size_t) r;
        while (cnt > 0 && k >= iov->iov_len) {
            k -= iov->iov_len;
            ++iov;
            --cnt;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *) iov->iov_base + k;
            iov->iov_len -= k;
        }
    }
    return done;
}

// read exactly n bytes at off; returns bytes read (< n only at end of file)
static size_t pread_full(int fd, void * dst, size_t n, uint64_t off, int & err) {
    struct iovec v = { dst, n };
    return preadv_full(fd, &v, 1, off, err);
}

void vis_io_pool::read_one(const vis_read_req & r, vis_bounce & bounce, read_result & res) {
    const vis_gguf_file & f = *r.src->file;
    const uint64_t off = r.src->offs + (uint64_t) r.expert * r.src->nb2;
    const size_t   n   = r.src->nb2;
    if (vis_fault_injected(r.il, r.expert)) {
        throw vis_io_error(read_error(r, std::string(std::strerror(EIO)) + " (injected by VIS_MOE_FAULT_READ)"));
    }
    if (off + n > f.size) {
        throw vis_io_error(read_error(r, "past the end of the file (truncated GGUF?)"));
    }
    int err = 0;
    if (direct_io != 0 && f.fd_direct >= 0) {
        const uint64_t A  = VIS_DIO_ALIGN;
        const uint64_t a0 = off & ~(A - 1);                // the slice's 4 KiB-aligned superset [a0, a1) ...
        const uint64_t a1 = (off + n + A - 1) & ~(A - 1);
        const uint64_t b0 = (off + A - 1) & ~(A - 1);      // ... and its whole pages [b0, b1)
        const uint64_t b1 = (off + n) & ~(A - 1);
        uint8_t * dst = (uint8_t *) r.dst;
        // In place: where the whole pages are 4 KiB-aligned at the destination too (the slabs are placed so:
        // vis_dio_alloc_tensors), one read puts them there and only the partial pages at both ends pass through
        // the bounce region; else the whole superset is read into the bounce region and copied out.
        const bool in_place = b1 > b0 && ((uintptr_t) (dst + (b0 - off)) & (uintptr_t) (A - 1)) == 0;
        struct iovec iov[3];
        int niov = 0;
        uint8_t * head = nullptr;
        uint8_t * tail = nullptr;
        uint8_t * whole = nullptr;
        if (in_place) {
            uint8_t * buf = bounce.get(2 * A);
            if (b0 > a0) {
                head = buf;
                iov[niov++] = { head, (size_t) A };
            }
            iov[niov++] = { dst + (b0 - off), (size_t) (b1 - b0) };
            if (a1 > b1) {
                tail = buf + A;
                iov[niov++] = { tail, (size_t) A };
            }
        } else {
            whole = bounce.get(a1 - a0);
            iov[niov++] = { whole, (size_t) (a1 - a0) };
        }
        const size_t got = preadv_full(f.fd_direct, iov, niov, a0, err);
        if (err == 0 || err != EINVAL) {
            if (err != 0) {
                throw vis_io_error(read_error(r, std::strerror(err)));
            }
            if (got < (off - a0) + n) {
                throw vis_io_error(read_error(r, "short read (" + std::to_string(got) + " of " +
                                                 std::to_string(a1 - a0) + " bytes): the file is shorter than when it was loaded"));
            }
            if (in_place) {
                if (head) {
                    std::memcpy(dst, head + (off - a0), b0 - off);
                }
                if (tail) {
                    std::memcpy(dst + (b1 - off), tail, off + n - b1);
                }
                res.copied += (int64_t) ((b0 - off) + (off + n - b1));
            } else {
                std::memcpy(dst, whole + (off - a0), n);
                res.copied += (int64_t) n;
            }
            res.dev_bytes += (int64_t) (a1 - a0);
            res.direct = true;
            return;
        }
        // EINVAL: this filesystem refuses O_DIRECT after all; buffered from now on
        direct_io = 0;
        LLAMA_LOG_WARN("vis-moe: O_DIRECT reads refused on %s; using buffered reads and dropping their pages\n", f.path.c_str());
    }
    const size_t got = pread_full(f.fd, r.dst, n, off, err);
    if (err != 0) {
        throw vis_io_error(read_error(r, std::strerror(err)));
    }
    if (got < n) {
        throw vis_io_error(read_error(r, "short read (" + std::to_string(got) + " of " + std::to_string(n) +
                                         " bytes): the file is shorter than when it was loaded"));
    }
    // do not let the page cache keep a second copy of what the cache now holds
    posix_fadvise(f.fd, (off_t) off, (off_t) n, POSIX_FADV_DONTNEED);
    res.dev_bytes += (int64_t) n;
}

// a shadow expert's bytes against the checksum its sidecar stores (vis_deferred_tensor::sums)
static void check_sum(const vis_read_req & r) {
    if (r.src->sums.empty()) {
        return;
    }
    const uint64_t want = r.src->sums[(size_t) r.expert];
    const uint64_t got  = vis_bytes_sum(r.dst, r.src->nb2);
    if (got != want) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "checksum %016llx, the file stores %016llx", (unsigned long long) got,
                      (unsigned long long) want);
        throw vis_io_error(read_error(r, std::string("its bytes do not match their checksum (") + buf +
                                         "): the file is damaged or was changed after it was written; write it again"));
    }
}

void vis_io_pool::run_slice(std::unique_lock<std::mutex> & lock, int idx) {
    const slice sl = queue.front();
    queue.pop_front();
    lock.unlock();
    read_result res;
    std::string err;
    try {
        read_one(sl.req, bounces[idx], res);
        check_sum(sl.req);
    } catch (const std::exception & e) {
        err = e.what();
    }
    lock.lock();
    ticket_state & t = tickets[sl.ticket];
    t.dev_bytes += res.dev_bytes;
    t.copied    += res.copied;
    t.n_direct  += res.direct ? 1 : 0;
    if (!err.empty() && t.error.empty()) {
        t.error = err;
    }
    if (--t.left == 0) {
        t.done = clock::now();
        if (--outstanding == 0) {
            busy_us += std::chrono::duration_cast<std::chrono::microseconds>(t.done - busy_since).count();
        }
        cv_done.notify_all();
    }
}

void vis_io_pool::worker_main(int idx) {
    std::unique_lock<std::mutex> lock(mtx);
    for (;;) {
        cv_work.wait(lock, [&] { return stop || !queue.empty(); });
        if (stop) {
            return;
        }
        run_slice(lock, idx);
    }
}

uint64_t vis_io_pool::submit(const std::vector<vis_read_req> & reqs) {
    std::lock_guard<std::mutex> lock(mtx);
    const uint64_t id = next_ticket++;
    if (reqs.empty()) {
        return id;  // waited for at once
    }
    ticket_state & t = tickets[id];
    t.reqs = reqs;
    t.left = reqs.size();
    if (outstanding++ == 0) {
        busy_since = clock::now();
    }
    for (const auto & r : reqs) {
        queue.push_back({ id, r });
    }
    cv_work.notify_all();
    return id;
}

vis_io_pool::clock::time_point vis_io_pool::wait(uint64_t id) {
    ticket_state t;
    {
        std::unique_lock<std::mutex> lock(mtx);
        auto it = tickets.find(id);
        if (it == tickets.end()) {
            return clock::now();  // nothing to read
        }
        while (it->second.left > 0) {
            if (!queue.empty() && queue.front().ticket <= id) {
                run_slice(lock, 0);  // a slice this ticket waits behind, or its own: read it here
            } else {
                cv_done.wait(lock);
            }
        }
        t = std::move(it->second);
        tickets.erase(it);
        cnt.wait_us += busy_us;
        busy_us = 0;
    }
    cnt.bytes_device += t.dev_bytes;
    cnt.bytes_copied += t.copied;
    cnt.n_direct     += t.n_direct;
    cnt.n_reads      += (int64_t) t.reqs.size();
    for (const auto & r : t.reqs) {
        cnt.bytes_read += (int64_t) r.src->nb2;
    }
    if (!t.error.empty()) {
        // a read error is often the file changing under us: say so when it did
        for (const auto & r : t.reqs) {
            r.src->file->check_unchanged();
        }
        throw vis_io_error(t.error);
    }
    return t.done;
}

void vis_io_pool::read(const std::vector<vis_read_req> & reqs) {
    if (!reqs.empty()) {
        wait(submit(reqs));
    }
}
