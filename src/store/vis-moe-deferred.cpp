// vis-moe-deferred.cpp - deferral at model load and the registry of deferred expert tensors: which tensors are
// deferred, the GGUF file each one is read from (opened once per file, checked for changes), its offsets.
#include "vis-moe-deferred.h"
#include "vis-moe-settings.h"

#include "llama-impl.h"
#include "llama-model-loader.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

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

// the layer's routed experts carry per-expert scales (`blk.N.ffn_*_exps.scale`): a layout the cache does not page
// (vis_moe_layer_has_expert_scales), so they load as upstream loads them
static bool has_expert_scales(const llama_model_loader & ml, int bid) {
    for (const char * kind : { "gate", "up", "down" }) {
        const std::string s = "blk." + std::to_string(bid) + ".ffn_" + kind + "_exps.scale";
        if (ml.get_weight(s.c_str())) {
            return true;
        }
    }
    return false;
}

bool vis_moe_defer_tensor(const void * loader, const char * name, int bid, int64_t n_expert) {
    if (bid < 0 || !is_routed_expert_weight(name)) {
        return false;
    }
    const int64_t model_bytes = (int64_t) static_cast<const llama_model_loader *>(loader)->n_bytes;
    int n_pinned = 0;
    const bool deferral = vis_moe_settings_deferral(n_pinned, n_expert);
    std::lock_guard<std::mutex> lock(g_store_mutex);
    if (g_load.loader != loader || bid < g_load.last_bid) {
        g_load = {};  // a new model load starts
        g_load.loader = loader;
        g_load.fits   = deferral && vis_moe_settings_model_fits(model_bytes);
        if (!deferral) {
            vis_moe_settings_check_resident(model_bytes, n_expert);  // --moe-mem with every expert resident
        }
    }
    if (!deferral) {
        g_load.last_bid = bid;
        return false;
    }
    if (g_load.fits) {
        return false;  // upstream's load, unchanged (repacking included)
    }
    g_load.last_bid = bid;
    if (g_load.moe_bids.empty() || g_load.moe_bids.back() != bid) {
        g_load.moe_bids.push_back(bid);
    }
    const int moe_index = (int) g_load.moe_bids.size() - 1;
    return n_pinned >= 0 && moe_index >= n_pinned && !has_expert_scales(*static_cast<const llama_model_loader *>(loader), bid);
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

// Replace every mapping of the file (dev, ino; or its path, where a stacked filesystem shows another device) from
// file offset new_size on, rounded up to a page, by anonymous zero pages.  Upstream maps the resident weights from
// the file; a page past the end of a truncated file raises SIGBUS when touched, and a resident tensor may lie after
// the experts (the gpt-oss fixture stores layer 1's attention after layer 0's experts).  The ubatch has failed
// already (check_unchanged throws); what its remaining nodes compute from zeros is discarded.
static void unmap_past_end(const vis_gguf_file & f, uint64_t new_size) {
    FILE * maps = std::fopen("/proc/self/maps", "r");
    if (!maps) {
        return;
    }
    const uint64_t page = (uint64_t) sysconf(_SC_PAGESIZE);
    const uint64_t keep = (new_size + page - 1) / page * page;  // file offsets below it stay mapped
    struct range { uintptr_t addr; size_t len; int prot; };
    std::vector<range> todo;
    char line[4352];
    while (std::fgets(line, sizeof(line), maps)) {
        unsigned long start = 0, end = 0, off = 0, inode = 0;
        unsigned int maj = 0, min = 0;
        char perms[8] = {}, name[4096] = {};
        const int n = std::sscanf(line, "%lx-%lx %7s %lx %x:%x %lu %4095s", &start, &end, perms, &off, &maj, &min,
                                  &inode, name);
        if (n < 7 || inode != f.ino || (makedev(maj, min) != f.dev && f.path != name)) {
            continue;
        }
        const uint64_t from = std::max<uint64_t>(off, keep);
        if (from >= off + (end - start)) {
            continue;
        }
        const int prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0);
        todo.push_back({ (uintptr_t) (start + (from - off)), (size_t) (end - start - (from - off)), prot });
    }
    std::fclose(maps);
    for (const range & r : todo) {
        if (mmap((void *) r.addr, r.len, r.prot, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED) {
            LLAMA_LOG_ERROR("vis-moe: cannot replace the mapping of %s past its new end: %s\n", f.path.c_str(),
                            std::strerror(errno));
        }
    }
}

void vis_gguf_file::check_unchanged() const {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        throw vis_io_error("vis-moe: cannot stat " + path + ": " + std::strerror(errno));
    }
    const uint64_t now = (uint64_t) st.st_size;
    if (now < size && now < unmapped_from.load()) {
        unmapped_from.store(now);
        unmap_past_end(*this, now);
    }
    // an in-place rewrite may keep the size and restore the mtime, but it always moves the ctime.  So does a change
    // of the link count: the documented replacement (a new file renamed over the path) or an rm leaves the open
    // inode's bytes as they were, with one link less - a moved ctime with another link count is that, not a rewrite
    const bool relinked = (uint64_t) st.st_nlink != nlink;
    const char * what = (uint64_t) st.st_size != size ? "size"
                      : stat_mtime_ns(st) != mtime_ns  ? "modification time"
                      : stat_ctime_ns(st) != ctime_ns && !relinked ? "change time (rewritten in place)"
                      : (uint64_t) st.st_ino != ino    ? "inode" : nullptr;
    if (what) {
        throw vis_io_error("vis-moe: " + path + " changed since the model was loaded (" + what + ": size " +
                           std::to_string(size) + " -> " + std::to_string((uint64_t) st.st_size) +
                           " bytes); experts read now would not match the loaded model - restart with the intended file");
    }
}

std::shared_ptr<vis_gguf_file> vis_gguf_file_open(const std::string & path, std::string & err) {
    auto f = std::make_shared<vis_gguf_file>();
    f->path = path;
    f->fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (f->fd < 0 || fstat(f->fd, &st) != 0) {
        err = std::strerror(errno);
        return nullptr;
    }
    f->size     = (uint64_t) st.st_size;
    f->mtime_ns = stat_mtime_ns(st);
    f->ctime_ns = stat_ctime_ns(st);
    f->ino      = (uint64_t) st.st_ino;
    f->dev      = (uint64_t) st.st_dev;
    f->nlink    = (uint64_t) st.st_nlink;
#ifdef O_DIRECT
    f->fd_direct = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // -1 (EINVAL) on tmpfs and friends
#endif
    posix_fadvise(f->fd, 0, 0, POSIX_FADV_RANDOM);
    return f;
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
    std::string err;
    auto f = vis_gguf_file_open(path, err);  // our own descriptors: the loader closes its files after loading
    if (!f) {
        throw std::runtime_error("vis-moe: cannot open " + std::string(path) + " for expert reads: " + err);
    }
    struct stat st2;
    if (fstat(f->fd, &st2) != 0 || st2.st_ino != st.st_ino || st2.st_dev != st.st_dev) {
        throw std::runtime_error("vis-moe: " + f->path + " was replaced while the model was loading");
    }
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

uint64_t vis_bytes_sum(const void * data, size_t n) {
    const uint8_t * b = (const uint8_t *) data;
    const size_t nw = n / 4;
    uint64_t sum = (uint64_t) n;
    for (size_t i = 0; i < nw; ++i) {
        uint32_t w;
        std::memcpy(&w, b + 4 * i, 4);  // little endian hosts only (x86-64, aarch64)
        sum += ((uint64_t) w + 1) * (2 * (uint64_t) i + 1);
    }
    if (n % 4) {
        uint32_t w = 0;
        std::memcpy(&w, b + 4 * nw, n % 4);
        sum += ((uint64_t) w + 1) * (2 * (uint64_t) nw + 1);
    }
    return sum;
}
