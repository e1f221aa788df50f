// vis-moe-csv.cpp - the --moe-csv writer (vis-moe-csv.h).
#include "vis-moe-csv.h"

#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

#include <sys/stat.h>

const char * const VIS_MOE_CSV_HEADER =
    "t_ms,phase,tokens,wall_ms,compute_ms,stall_ms,routed,hits,misses,host_hits,file_reads,model_copies,"
    "loaded_bytes,read_bytes,ahead_used,ahead_wasted,ahead_bytes,substituted,shadow,rerouted,dropped,mode";

// the regular files the live writers of this process hold (device, inode): a second context never truncates one
static std::mutex                            g_open_mutex;
static std::set<std::pair<uint64_t, uint64_t>> g_open;

static bool file_key(const std::string & path, std::pair<uint64_t, uint64_t> & key) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return false;
    }
    key = { (uint64_t) st.st_dev, (uint64_t) st.st_ino };
    return true;
}

vis_moe_csv::vis_moe_csv(const std::string & path, const std::vector<vis_input_file> & inputs) : file_path(path) {
    std::lock_guard<std::mutex> lock(g_open_mutex);
    std::pair<uint64_t, uint64_t> key;
    std::string why = vis_output_refusal(path, std::string(VIS_MOE_CSV_HEADER) + "\n",
                                         "a --moe-csv file (its first line is not our header)", inputs);
    if (why.empty() && file_key(path, key) && g_open.count(key)) {
        why = "another context of this process is writing it";
    }
    if (!why.empty()) {
        throw std::runtime_error("--moe-csv: refusing to write '" + path + "': " + why + "; give a new file name");
    }
    f = std::fopen(path.c_str(), "w");
    if (!f) {
        throw std::runtime_error("--moe-csv: cannot open '" + path + "' for writing: " + std::strerror(errno));
    }
    if (file_key(path, key)) {
        g_open.insert(key);
        open_key = key;
        registered = true;
    }
    if (std::fprintf(f, "%s\n", VIS_MOE_CSV_HEADER) < 0 || std::fflush(f) != 0) {
        const std::string err = std::strerror(errno ? errno : EIO);
        std::fclose(f);
        f = nullptr;
        g_open.erase(open_key);
        throw std::runtime_error("--moe-csv: cannot write '" + path + "': " + err);
    }
}

vis_moe_csv::~vis_moe_csv() {
    if (f) {
        std::fclose(f);
    }
    if (registered) {
        std::lock_guard<std::mutex> lock(g_open_mutex);
        g_open.erase(open_key);
    }
}

std::string vis_moe_csv::write(const vis_moe_step & s, const std::string & mode) {
    const vis_moe_counters & d = s.d;
    const double stall_ms   = d.stall_us / 1000.0;
    const double compute_ms = s.wall_ms > stall_ms ? s.wall_ms - stall_ms : 0.0;
    const int n = std::fprintf(f, "%.3f,%s,%" PRId64 ",%.3f,%.3f,%.3f,%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64
                                  ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64
                                  ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%s\n",
                               s.t_ms, s.decode ? "decode" : "prompt", s.n_tokens, s.wall_ms, compute_ms, stall_ms,
                               d.routed, d.hits, d.misses, d.host_hits, d.file_reads, d.model_copies, d.loaded_bytes,
                               d.read_bytes, d.ahead_used, d.ahead_wasted, d.ahead_bytes, d.substituted, d.shadow,
                               d.rerouted, d.dropped, mode.c_str());
    if ((n < 0 || std::fflush(f) != 0) && error.empty()) {
        error = std::strerror(errno ? errno : EIO);
    }
    return error.empty() ? "" : "--moe-csv: writing '" + file_path + "' failed: " + error +
                                " (the rows so far are in the file; free space or choose another file)";
}
