// vis-moe-metrics.h - the process's expert-cache counters for llama-server (patch 0014): /metrics in
// Prometheus text (llama_vis_moe_metrics_text) and the mode and memory plan in /props
// (llama_vis_moe_props_json), docs/telemetry.md#llama-server.
//
// The server's HTTP threads never touch a context: each context publishes a snapshot of its counters here at
// the end of every ubatch (under one mutex), and a context's last snapshot stays in the totals after it is
// freed, so the counters only grow over the life of the process.
#pragma once

#include "vis-moe-telemetry-types.h"

#include <string>

// a new context (key: its telemetry): its mode label (vis_moe_mode_label) and plan (vis_moe_props_json,
// vis-moe-telemetry-probe.cpp)
void vis_moe_metrics_attach(const void * key, const std::string & mode, const std::string & props_json);
void vis_moe_metrics_publish(const void * key, const vis_moe_published & p);
// the context is freed: its last snapshot joins the retired totals
void vis_moe_metrics_detach(const void * key);
