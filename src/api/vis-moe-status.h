// vis-moe-status.h - the live status line of --moe-stats on a terminal (docs/telemetry.md#the-status-line):
// tok/s, hit rate, MiB read per token, stall share and exact or lossy, over the decode steps since the last
// prompt, redrawn at most 4 times a second on the terminal's last row.  That row is kept out of the scrolling
// region (DECSTBM), so the generated text and the logs scroll above it and never overwrite it, nor it them;
// every redraw is one write(2).  Cleared (the scrolling region reset) before the exit summary, and at exit.
#pragma once

#include "vis-moe-telemetry-types.h"

#include <cstdint>
#include <string>

// the line's text for `tokens` decode tokens in `secs` seconds, whose ubatches took `busy_ms` and moved the
// counters by `c`; lossy_what: vis_moe_lossy_what ("" = exact)
std::string vis_moe_status_text(int64_t tokens, double secs, double busy_ms, const vis_moe_counters & c,
                                const std::string & lossy_what);

// is the line drawn: --moe-stats on, `fd` a terminal (isatty) that is not TERM=dumb and has at least 3 rows
// (TIOCGWINSZ)?  Never when stderr is a pipe or a file (tests, logs).
bool vis_moe_status_wanted(bool print_stats, int fd);

class vis_moe_status_line {
public:
    explicit vis_moe_status_line(int fd);
    ~vis_moe_status_line();  // clear()
    vis_moe_status_line(const vis_moe_status_line &) = delete;
    vis_moe_status_line & operator=(const vis_moe_status_line &) = delete;

    // draw `text` unless the last draw was less than 250 ms ago (force: draw now)
    void draw(const std::string & text, bool force = false);
    // the row and the scrolling region back as they were
    void clear();

private:
    void setup(int rows);

    int     fd;
    int     rows = 0;      // the terminal's rows when the region was set, 0 = not set
    int64_t last_us = -1;
};
