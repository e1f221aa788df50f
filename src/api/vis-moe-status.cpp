// vis-moe-status.cpp - the live status line (vis-moe-status.h).
#include "vis-moe-status.h"

#include "ggml.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <sys/ioctl.h>
#include <unistd.h>

std::string vis_moe_status_text(int64_t tokens, double secs, double busy_ms, const vis_moe_counters & c,
                                const std::string & lossy_what) {
    const double tps    = secs > 0 ? tokens / secs : 0.0;
    const double hit    = c.routed > 0 ? 100.0 * c.hits / c.routed : 100.0;
    const double mib    = tokens > 0 ? (c.read_bytes + c.ahead_bytes) / 1048576.0 / tokens : 0.0;
    const double stall  = busy_ms > 0 ? 100.0 * c.stall_us / 1000.0 / busy_ms : 0.0;
    char buf[160];
    std::snprintf(buf, sizeof(buf), "vis-moe: %.1f tok/s | hit %.1f %% | %.2f MiB/token read | stall %.0f %% | ",
                  tps, hit, mib, stall > 100 ? 100.0 : stall);
    return std::string(buf) + (lossy_what.empty() ? "exact" : "lossy (" + lossy_what + ")");
}

static int term_rows(int fd, int * cols = nullptr) {
    winsize ws = {};
    if (ioctl(fd, TIOCGWINSZ, &ws) != 0) {
        return 0;
    }
    if (cols) {
        *cols = ws.ws_col;
    }
    return ws.ws_row;
}

bool vis_moe_status_wanted(bool print_stats, int fd) {
    if (!print_stats || !isatty(fd)) {
        return false;
    }
    const char * term = std::getenv("TERM");
    if (term && std::strcmp(term, "dumb") == 0) {
        return false;
    }
    return term_rows(fd) >= 3;
}

static void write_all(int fd, const std::string & s) {
    size_t off = 0;
    while (off < s.size()) {
        const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
        if (n <= 0) {
            return;  // a terminal gone away: nothing to draw on
        }
        off += (size_t) n;
    }
}

// the line drawn now, cleared at exit when the process ends without freeing its context
static std::atomic<vis_moe_status_line *> g_active{nullptr};

static void clear_at_exit() {
    if (vis_moe_status_line * s = g_active.exchange(nullptr)) {
        s->clear();
    }
}

vis_moe_status_line::vis_moe_status_line(int fd) : fd(fd) {
    static const bool registered = std::atexit(clear_at_exit) == 0;
    (void) registered;
}

vis_moe_status_line::~vis_moe_status_line() {
    clear();
}

void vis_moe_status_line::setup(int n_rows) {
    // a new line below the cursor (scrolling when it is on the last row), back up, then the region: rows 1..n-1
    char buf[64];
    std::snprintf(buf, sizeof(buf), "\033D\033[1A\0337\033[1;%dr\0338", n_rows - 1);
    write_all(fd, buf);
    rows = n_rows;
    g_active.store(this);
}

void vis_moe_status_line::draw(const std::string & text, bool force) {
    const int64_t now = ggml_time_us();
    if (!force && last_us >= 0 && now - last_us < 250000) {
        return;
    }
    last_us = now;
    int cols = 0;
    const int n_rows = term_rows(fd, &cols);
    if (n_rows < 3) {
        return;
    }
    if (n_rows != rows) {  // first draw, or the terminal was resized
        clear();
        setup(n_rows);
    }
    char pos[32];
    std::snprintf(pos, sizeof(pos), "\0337\033[%d;1H\033[2K", rows);
    const size_t width = cols > 1 ? (size_t) cols - 1 : text.size();
    write_all(fd, pos + text.substr(0, width) + "\0338");
}

void vis_moe_status_line::clear() {
    if (rows == 0) {
        return;
    }
    char buf[48];
    std::snprintf(buf, sizeof(buf), "\0337\033[r\033[%d;1H\033[2K\0338", rows);
    write_all(fd, buf);
    rows = 0;
    vis_moe_status_line * self = this;
    g_active.compare_exchange_strong(self, nullptr);
}
