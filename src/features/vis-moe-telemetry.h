// vis-moe-telemetry.h - what a run of the expert cache looks like while it runs (docs/telemetry.md): the
// per-ubatch rows of --moe-csv (vis-moe-csv.h), the live status line of --moe-stats on a terminal
// (vis-moe-status.h) and this context's share of the counters llama-server shows in /metrics and /props
// (vis-moe-metrics.h).  It counts nothing the cache already counts: a step is the difference of two snapshots of
// the cache's own counters (vis_moe_counters_now, vis-moe-telemetry-probe.cpp), one at each end of the ubatch.
#pragma once

#include "vis-moe-feature.h"
#include "vis-moe-telemetry-types.h"

#include <memory>
#include <string>
#include <vector>

class vis_moe_csv;
class vis_moe_status_line;

// "exact", or "lossy:" and the mechanisms joined by '+' ("lossy:topk=6+substitute=router"): no comma, no space
std::string vis_moe_mode_label(const std::string & lossy_what);

class vis_moe_telemetry : public vis_moe_feature {
public:
    // csv_path: --moe-csv ("" = none), refused (std::runtime_error naming the flag and the file) when it is one of
    // `inputs`, a model or any file but an earlier --moe-csv; status: draw the live line (vis_moe_status_wanted);
    // lossy_what: vis_moe_lossy_what ("" = exact); props_json: vis_moe_props_json; now: the counters at attach
    vis_moe_telemetry(const std::string & csv_path, const std::vector<vis_input_file> & inputs, bool status,
                      const std::string & lossy_what, const std::string & props_json, const vis_moe_counters & now);
    ~vis_moe_telemetry();  // the status line cleared, the context's counters kept in the process totals

    void begin_ubatch(const vis_moe_counters & now, int64_t n_tokens, bool decode);
    // "" or the message of a CSV write error (the decode fails with it, as a trace write error does)
    std::string end_ubatch(const vis_moe_counters & now);
    // the status line is cleared (before the exit summary)
    void clear_status();

    // the feature (vis-moe-feature.h), attached last: the counters of the whole ubatch at both ends, the status
    // line cleared at detach
    const char * feature_name() const override { return "telemetry"; }
    void ubatch_begin(vis_moe_context & vm, const llama_ubatch & ub) override;
    void ubatch_end(vis_moe_context & vm) override;
    void detach(vis_moe_context &) override { clear_status(); }

private:
    int64_t          t0_us    = 0;
    int64_t          ub_t0_us = 0;
    int64_t          n_tokens = 0;
    bool             decode   = false;
    vis_moe_counters last;      // the counters at the start of the running ubatch
    std::string      lossy;     // vis_moe_lossy_what
    std::string      mode;      // vis_moe_mode_label
    vis_moe_published total;    // every ubatch so far: what /metrics shows (vis-moe-metrics.h)
    struct {                    // the decode steps since the last prompt: what the status line averages
        int64_t t0_us = 0, tokens = 0;
        double  busy_ms = 0;
        vis_moe_counters c;
    } gen;
    std::unique_ptr<vis_moe_csv>         csv;
    std::unique_ptr<vis_moe_status_line> status;
};
