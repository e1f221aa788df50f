// vis-moe-bandwidth.cpp - the two bandwidths the configurator's cost model is priced in (llama-vis.h,
// docs/planning.md): expert-sized reads of the model file by --moe-io-threads threads at once (O_DIRECT, as tier 3
// reads; buffered with the pages dropped where the filesystem refuses it) and a memcpy.  Probed once per device and
// I/O thread count and cached in $XDG_CACHE_HOME/vis-moe/bandwidth (default ~/.cache); VIS_MOE_READ_MBPS overrides
// the read number.  The compute side is vis-moe-compute-probe.cpp.
#include "llama-vis.h"
#include "vis-error.h"
#include "vis-moe-settings.h"
#include "vis-moe-cost-cache.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

constexpr size_t CHUNK = 256 << 10;  // about one expert tensor of a small model; the reads are spread over the file
constexpr int    READS = 160;

// "dev read_bps mem_bps" lines
bool cached(const std::string & key, double & rd, double & mem) {
    std::ifstream f(vis_moe_cost_cache_file("bandwidth"));
    std::string line;
    while (std::getline(f, line)) {
        std::istringstream ss(line);
        std::string k;
        double a = 0, b = 0;
        if ((ss >> k >> a >> b) && k == key && a > 0 && b > 0) {
            rd = a;
            mem = b;
            return true;
        }
    }
    return false;
}

void store(const std::string & key, double rd, double mem) {
    std::ostringstream ss;
    ss << key << " " << rd << " " << mem;
    vis_moe_cost_cache_append("bandwidth", ss.str());
}

// expert-sized reads spread over the file, issued as the runtime issues a layer's misses: by n_threads I/O threads
// at once (--moe-io-threads), so the number is the file's bandwidth under the run's own access pattern
double probe_read(const char * path, int n_threads) {
    int fd = ::open(path, O_RDONLY | O_DIRECT);
    const bool direct = fd >= 0;
    if (!direct) {
        fd = ::open(path, O_RDONLY);
    }
    if (fd < 0) {
        return -1;
    }
    struct stat st = {};
    ::fstat(fd, &st);
    const off_t size = st.st_size;
    if (size < (off_t) CHUNK) {
        ::close(fd);
        return -1;
    }
    const off_t span = (size - (off_t) CHUNK) / 4096;
    n_threads = std::max(1, n_threads);
    std::atomic<int> next{0};
    std::atomic<size_t> bytes{0};
    std::atomic<bool> failed{false};
    auto worker = [&]() {
        void * buf = nullptr;
        if (posix_memalign(&buf, 4096, CHUNK) != 0) {
            failed = true;
            return;
        }
        for (int i = next++; i < READS && !failed; i = next++) {
            const off_t off = (off_t) ((span * (int64_t) ((i * 7919) % READS)) / READS) * 4096;
            if (!direct) {
                posix_fadvise(fd, off, CHUNK, POSIX_FADV_DONTNEED);
            }
            const ssize_t r = ::pread(fd, buf, CHUNK, off);
            if (r <= 0) {
                failed = true;
                break;
            }
            bytes += (size_t) r;
        }
        std::free(buf);
    };
    const double t0 = vis_moe_cost_now_s();
    std::vector<std::thread> ts;
    for (int i = 1; i < n_threads; ++i) {
        ts.emplace_back(worker);
    }
    worker();
    for (auto & t : ts) {
        t.join();
    }
    const double t = vis_moe_cost_now_s() - t0;
    ::close(fd);
    return !failed && bytes > 0 && t > 0 ? bytes / t : -1;
}

double probe_mem() {
    const size_t n = 64u << 20;
    std::vector<char> a(n, 1), b(n, 2);
    double best = 0;
    for (int i = 0; i < 4; ++i) {
        const double t0 = vis_moe_cost_now_s();
        std::memcpy(b.data(), a.data(), n);
        const double t = vis_moe_cost_now_s() - t0;
        a[i] = b[n - 1 - i];  // keep the copies
        best = std::max(best, t > 0 ? 2.0 * n / t : 0.0);  // read + write
    }
    return best;
}

} // namespace

int32_t llama_vis_moe_cost_default(const char * path, struct llama_vis_moe_cost * cost) {
    vis_clear_last_error();
    if (!path || !cost) {
        vis_set_last_error("llama_vis_moe_cost_default: NULL argument");
        return -1;
    }
    struct stat st = {};
    if (::stat(path, &st) != 0) {
        vis_set_last_error(std::string("llama_vis_moe_cost_default: ") + path + ": " + std::strerror(errno));
        return -1;
    }
    vis_moe_settings s;
    try {
        s = vis_moe_settings_current();
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());  // a VIS_MOE_* variable that does not parse: named, not a crash
        return -1;
    }
    const std::string key = "dev" + std::to_string((unsigned long long) st.st_dev) + "-io" +
                            std::to_string(s.tier.io_threads);
    double rd = 0, mem = 0;
    if (!cached(key, rd, mem)) {
        rd  = probe_read(path, s.tier.io_threads);
        mem = probe_mem();
        if (rd <= 0 || mem <= 0) {
            vis_set_last_error(std::string("llama_vis_moe_cost_default: could not time reads of ") + path +
                               " (a file of at least 1 MiB); set VIS_MOE_READ_MBPS");
            return -1;
        }
        store(key, rd, mem);
    }
    const vis_moe_plan_settings & ps = s.plan;
    cost->read_bps      = ps.read_mbps > 0 ? ps.read_mbps * 1048576.0 : rd;
    cost->mem_bps       = mem;
    // without the compute probe (llama_vis_moe_cost_probe): the pass costs first fitted on the loaded dev VM
    cost->pass_s        = (ps.pass_us >= 0 ? ps.pass_us : 10000) * 1e-6;
    cost->pass_token_s  = (ps.pass_token_us >= 0 ? ps.pass_token_us : 2000) * 1e-6;
    cost->token_s       = 0;
    cost->token_byte_s  = 0;
    cost->probed        = 0;
    cost->stream_passes = s.stream_passes;
    cost->prompt_tokens = ps.prompt;
    cost->gen_tokens    = ps.gen;
    return 0;
}
