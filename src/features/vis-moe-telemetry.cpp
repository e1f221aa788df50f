// vis-moe-telemetry.cpp - per-ubatch telemetry of the expert cache (vis-moe-telemetry.h).
#include "vis-moe-telemetry.h"
#include "vis-moe-context.h"

#include "vis-moe-csv.h"
#include "vis-moe-metrics.h"
#include "vis-moe-status.h"

#include "ggml.h"
#include "llama-batch.h"

#include <stdexcept>

#include <unistd.h>

std::string vis_moe_mode_label(const std::string & lossy_what) {
    if (lossy_what.empty()) {
        return "exact";
    }
    std::string r = "lossy:" + lossy_what;
    for (char & ch : r) {
        ch = ch == ' ' ? '+' : ch;
    }
    return r;
}

vis_moe_telemetry::vis_moe_telemetry(const std::string & csv_path, const std::vector<vis_input_file> & inputs,
                                     bool draw_status, const std::string & lossy_what, const std::string & props_json,
                                     const vis_moe_counters & now)
    : t0_us(ggml_time_us()), last(now), lossy(lossy_what), mode(vis_moe_mode_label(lossy_what)) {
    if (!csv_path.empty()) {
        csv = std::make_unique<vis_moe_csv>(csv_path, inputs);
    }
    if (draw_status) {
        status = std::make_unique<vis_moe_status_line>(STDERR_FILENO);
    }
    vis_moe_metrics_attach(this, mode, props_json);
}

vis_moe_telemetry::~vis_moe_telemetry() {
    vis_moe_metrics_detach(this);
}

void vis_moe_telemetry::begin_ubatch(const vis_moe_counters & now, int64_t n, bool dec) {
    ub_t0_us = ggml_time_us();
    n_tokens = n;
    decode   = dec;
    last     = now;  // what moved between ubatches (llama_vis_moe_reset_stats) is no step's
    if (!dec) {
        gen = {};    // a new prompt: the status line's averages start again after it
    }
}

std::string vis_moe_telemetry::end_ubatch(const vis_moe_counters & now) {
    const int64_t t = ggml_time_us();
    vis_moe_step st;
    st.t_ms     = (t - t0_us) / 1000.0;
    st.wall_ms  = (t - ub_t0_us) / 1000.0;
    st.n_tokens = n_tokens;
    st.decode   = decode;
    st.d        = now - last;
    last        = now;
    (decode ? total.decode_tokens : total.prompt_tokens) += n_tokens;
    total.ubatches++;
    total.busy_s += st.wall_ms / 1000.0;
    total.c += st.d;
    vis_moe_metrics_publish(this, total);
    if (decode) {
        if (gen.tokens == 0) {
            gen.t0_us = ub_t0_us;
        }
        gen.tokens += n_tokens;
        gen.busy_ms += st.wall_ms;
        gen.c += st.d;
        if (status) {
            status->draw(vis_moe_status_text(gen.tokens, (t - gen.t0_us) / 1e6, gen.busy_ms, gen.c, lossy));
        }
    }
    return csv ? csv->write(st, mode) : "";
}

void vis_moe_telemetry::clear_status() {
    if (status) {
        status->clear();
    }
}

void vis_moe_telemetry::ubatch_begin(vis_moe_context & vm, const llama_ubatch & ub) {
    begin_ubatch(vis_moe_counters_now(vm), ub.n_tokens, vm.ub_decode);
}

void vis_moe_telemetry::ubatch_end(vis_moe_context & vm) {
    const std::string err = end_ubatch(vis_moe_counters_now(vm));
    if (!err.empty()) {
        vm.fail(err);
    }
}
