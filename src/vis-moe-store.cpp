// vis-moe-store.cpp - tiers 2 and 3 of the expert cache: the host-RAM expert
// cache and expert-granular reads from the GGUF file (docs/paging.md).
#include "vis-moe-store.h"
#include "vis-moe-settings.h"

#include "llama-model-loader.h"

#include "llama-impl.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static constexpr size_t VIS_DIO_ALIGN = 4096;

// ---------------------------------------------------------------------------
// deferral at model load
// ---------------------------------------------------------------------------
namespace {
struct load_state {
    const void *     loader  = nullptr;
    bool             fits    = false;  // --moe-mem: the whole model fits the budget, nothing is deferred
    int              last_bid = -1;
    std::vector<int> moe_bids;  // layers with routed-expert tensors seen so far, in order
};
std::mutex                                                             g_store_mutex;
load_state                                                             g_load;
std::map<const ggml_tensor *, std::unique_ptr<vis_deferred_tensor>>    g_deferred;
std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<vis_gguf_file>>  g_files;  // (dev, ino) -> open file
}

static const char * const VIS_EXPS_SUFFIX[] = {
    ".ffn_gate_exps.weight", ".ffn_up_exps.weight", ".ffn_down_exps.weight", ".ffn_gate_up_exps.weight",
};

static bool is_routed_expert_weight(const char * name) {
    if (std::strncmp(name, "blk.", 4) != 0) {
        return false;
    }
    for (const char * suf : VIS_EXPS_SUFFIX) {
        const size_t n = std::strlen(name), m = std::strlen(suf);
        if (n > m && std::strcmp(name + n - m, suf) == 0) {
            return true;
        }
    }
    return false;
}

bool vis_moe_defer_tensor(const void * loader, const char * name, int bid, int64_t n_expert) {
    if (bid < 0 || !is_routed_expert_weight(name)) {
        return false;
    }
    int n_pinned = 0;
    if (!vis_moe_settings_deferral(n_pinned, n_expert)) {
        return false;
    }
    std::lock_guard<std::mutex> lock(g_store_mutex);
    if (g_load.loader != loader || bid < g_load.last_bid) {
        g_load = {};  // a new model load starts
        g_load.loader = loader;
        g_load.fits   = vis_moe_settings_model_fits((int64_t) static_cast<const llama_model_loader *>(loader)->n_bytes);
    }
    if (g_load.fits) {
        return false;  // upstream's load, unchanged (repacking included)
    }
    g_load.last_bid = bid;
    if (g_load.moe_bids.empty() || g_load.moe_bids.back() != bid) {
        g_load.moe_bids.push_back(bid);
    }
    const int moe_index = (int) g_load.moe_bids.size() - 1;
    return n_pinned >= 0 && moe_index >= n_pinned;
}

vis_gguf_file::~vis_gguf_file() {
    if (fd >= 0) {
        close(fd);
    }
    if (fd_direct >= 0) {
        close(fd_direct);
    }
}

static int64_t stat_mtime_ns(const struct stat & st) {
    return (int64_t) st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
}

static int64_t stat_ctime_ns(const struct stat & st) {
    return (int64_t) st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
}

void vis_gguf_file::check_unchanged() const {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        throw vis_io_error("vis-moe: cannot stat " + path + ": " + std::strerror(errno));
    }
    // an in-place rewrite may keep the size and restore the mtime, but it always moves the ctime
    const char * what = (uint64_t) st.st_size != size ? "size"
                      : stat_mtime_ns(st) != mtime_ns  ? "modification time"
                      : stat_ctime_ns(st) != ctime_ns  ? "change time (rewritten in place)"
                      : (uint64_t) st.st_ino != ino    ? "inode" : nullptr;
    if (what) {
        throw vis_io_error("vis-moe: " + path + " changed since the model was loaded (" + what + ": size " +
                           std::to_string(size) + " -> " + std::to_string((uint64_t) st.st_size) +
                           " bytes); experts read now would not match the loaded model - restart with the intended file");
    }
}

static std::shared_ptr<vis_gguf_file> open_gguf_file(int loader_fd) {
    struct stat st;
    if (fstat(loader_fd, &st) != 0) {
        throw std::runtime_error(std::string("vis-moe: cannot stat the model file: ") + std::strerror(errno));
    }
    const auto key = std::make_pair((uint64_t) st.st_dev, (uint64_t) st.st_ino);
    auto it = g_files.find(key);
    if (it != g_files.end()) {
        if (auto f = it->second.lock()) {
            return f;
        }
    }
    char link[64], path[4096];
    std::snprintf(link, sizeof(link), "/proc/self/fd/%d", loader_fd);
    const ssize_t n = readlink(link, path, sizeof(path) - 1);
    if (n <= 0) {
        throw std::runtime_error(std::string("vis-moe: cannot resolve the path of the model file: ") + std::strerror(errno));
    }
    path[n] = '\0';
    auto f = std::make_shared<vis_gguf_file>();
    f->path = path;
    // our own descriptors: the loader closes its files after loading
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        throw std::runtime_error("vis-moe: cannot open " + f->path + " for expert reads: " + std::strerror(errno));
    }
    struct stat st2;
    if (fstat(f->fd, &st2) != 0 || st2.st_ino != st.st_ino || st2.st_dev != st.st_dev) {
        throw std::runtime_error("vis-moe: " + f->path + " was replaced while the model was loading");
    }
    f->size     = (uint64_t) st2.st_size;
    f->mtime_ns = stat_mtime_ns(st2);
    f->ctime_ns = stat_ctime_ns(st2);
    f->ino      = (uint64_t) st2.st_ino;
#ifdef O_DIRECT
    f->fd_direct = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);  // -1 (EINVAL) on tmpfs and friends
#endif
    posix_fadvise(f->fd, 0, 0, POSIX_FADV_RANDOM);
    g_files[key] = f;
    return f;
}

void vis_moe_tensor_created(const ggml_tensor * t, bool deferred, int fd, uint64_t offs) {
    std::lock_guard<std::mutex> lock(g_store_mutex);
    g_deferred.erase(t);
    if (!deferred) {
        return;
    }
    auto d = std::make_unique<vis_deferred_tensor>();
    d->file     = open_gguf_file(fd);
    d->name     = ggml_get_name(t);
    d->offs     = offs;
    d->nb2      = t->nb[2];
    d->n_expert = t->ne[2];
    if (d->offs + d->nb2 * (uint64_t) d->n_expert > d->file->size) {
        throw std::runtime_error("vis-moe: tensor " + d->name + " extends past the end of " + d->file->path +
                                 " (truncated or corrupt GGUF)");
    }
    g_deferred[t] = std::move(d);
}

const vis_deferred_tensor * vis_moe_deferred(const ggml_tensor * t) {
    std::lock_guard<std::mutex> lock(g_store_mutex);
    auto it = g_deferred.find(t);
    return it == g_deferred.end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------------------
// fault injection (tests)
// ---------------------------------------------------------------------------
bool vis_fault_injected(int il, int e) {
    static const char * spec = std::getenv("VIS_MOE_FAULT_READ");
    if (spec == nullptr || *spec == '\0') {
        return false;
    }
    if (std::strcmp(spec, "*") == 0) {
        return true;
    }
    int fil = -1, fe = -1;
    if (std::sscanf(spec, "%d:%d", &fil, &fe) == 2) {
        return fil == il && fe == e;
    }
    return false;
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

static uint8_t * aligned_region(std::vector<uint8_t> & v, size_t n) {
    if (v.size() < n + VIS_DIO_ALIGN) {
        v.resize(n + VIS_DIO_ALIGN);
    }
    const uintptr_t p = (uintptr_t) v.data();
    return (uint8_t *) ((p + VIS_DIO_ALIGN - 1) & ~(uintptr_t) (VIS_DIO_ALIGN - 1));
}

static std::string read_error(const vis_read_req & r, const std::string & what) {
    return "vis-moe: failed to read expert " + std::to_string(r.expert) + " of tensor " + r.src->name + " from " +
           r.src->file->path + " (offset " + std::to_string(r.src->offs + (uint64_t) r.expert * r.src->nb2) + ", " +
           std::to_string(r.src->nb2) + " bytes): " + what;
}

// read exactly n bytes at off; returns bytes read (< n only at end of file)
static size_t pread_full(int fd, void * dst, size_t n, uint64_t off, int & err) {
    size_t done = 0;
    err = 0;
    while (done < n) {
        const ssize_t r = pread(fd, (uint8_t *) dst + done, n - done, (off_t) (off + done));
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
    }
    return done;
}

void vis_io_pool::read_one(const vis_read_req & r, std::vector<uint8_t> & bounce, int64_t & dev_bytes, bool & used_direct) {
    const vis_gguf_file & f = *r.src->file;
    const uint64_t off = r.src->offs + (uint64_t) r.expert * r.src->nb2;
    const size_t   n   = r.src->nb2;
    used_direct = false;
    if (vis_fault_injected(r.il, r.expert)) {
        throw vis_io_error(read_error(r, std::string(std::strerror(EIO)) + " (injected by VIS_MOE_FAULT_READ)"));
    }
    if (off + n > f.size) {
        throw vis_io_error(read_error(r, "past the end of the file (truncated GGUF?)"));
    }
    int err = 0;
    if (direct_io != 0 && f.fd_direct >= 0) {
        const uint64_t a0 = off & ~(uint64_t) (VIS_DIO_ALIGN - 1);
        const uint64_t a1 = (off + n + VIS_DIO_ALIGN - 1) & ~(uint64_t) (VIS_DIO_ALIGN - 1);
        uint8_t * buf = aligned_region(bounce, a1 - a0);
        const size_t got = pread_full(f.fd_direct, buf, a1 - a0, a0, err);
        if (err == 0 || err != EINVAL) {
            if (err != 0) {
                throw vis_io_error(read_error(r, std::strerror(err)));
            }
            if (got < (off - a0) + n) {
                throw vis_io_error(read_error(r, "short read (" + std::to_string(got) + " of " +
                                                 std::to_string(a1 - a0) + " bytes): the file is shorter than when it was loaded"));
            }
            std::memcpy(r.dst, buf + (off - a0), n);
            dev_bytes += (int64_t) (a1 - a0);
            used_direct = true;
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
    dev_bytes += (int64_t) n;
}

void vis_io_pool::run_jobs(int idx) {
    for (;;) {
        size_t i;
        {
            std::lock_guard<std::mutex> lock(mtx);
            if (jobs == nullptr || next >= jobs->size()) {
                return;
            }
            i = next++;
        }
        const vis_read_req & r = (*jobs)[i];
        int64_t dev = 0;
        bool direct = false;
        std::string err;
        try {
            read_one(r, bounces[idx], dev, direct);
        } catch (const std::exception & e) {
            err = e.what();
        }
        std::lock_guard<std::mutex> lock(mtx);
        dev_bytes_acc += dev;
        n_direct_acc += direct ? 1 : 0;
        if (!err.empty() && first_error.empty()) {
            first_error = err;
        }
        if (++n_done == jobs->size()) {
            cv_done.notify_all();
        }
    }
}

void vis_io_pool::worker_main(int idx) {
    uint64_t seen = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mtx);
            cv_work.wait(lock, [&] { return stop || generation != seen; });
            if (stop) {
                return;
            }
            seen = generation;
        }
        run_jobs(idx);
    }
}

void vis_io_pool::read(const std::vector<vis_read_req> & reqs) {
    if (reqs.empty()) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    {
        std::lock_guard<std::mutex> lock(mtx);
        jobs   = &reqs;
        next   = 0;
        n_done = 0;
        first_error.clear();
        dev_bytes_acc = 0;
        n_direct_acc  = 0;
        generation++;
    }
    if (reqs.size() > 1) {
        cv_work.notify_all();
    }
    run_jobs(0);
    std::string err;
    {
        std::unique_lock<std::mutex> lock(mtx);
        cv_done.wait(lock, [&] { return n_done == reqs.size(); });
        jobs = nullptr;
        err  = first_error;
        cnt.bytes_device += dev_bytes_acc;
        cnt.n_direct     += n_direct_acc;
    }
    cnt.n_reads += (int64_t) reqs.size();
    for (const auto & r : reqs) {
        cnt.bytes_read += (int64_t) r.src->nb2;
    }
    cnt.wait_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    if (!err.empty()) {
        // a read error is often the file changing under us: say so when it did
        for (const auto & r : reqs) {
            r.src->file->check_unchanged();
        }
        throw vis_io_error(err);
    }
}

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
