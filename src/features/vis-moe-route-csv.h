// vis-moe-route-csv.h - reading a recorded routing trace in the shared CSV format
// (../shared/traces/README.md: "# route_trace v1", a model line, per-layer lines, then
// turn,phase,step,layer,slot,expert,weight,residency,expert_bytes rows).  Used by VIS_MOE_REPLAY
// (vis-moe-replay.h).  Python reads the same format in pyvis (trace import).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct vis_route_csv {
    std::string path;
    int n_layer  = 0;   // MoE layers of the recorded model
    int n_expert = 0;
    int k        = 0;   // experts per token of the recording (n_expert_used of the model line)
    int n_pos    = 0;   // token positions 0 .. n_pos-1 (the file's steps), each with at least one layer
    int n_prompt = 0;   // positions recorded as prompt (phase 0)

    // [pos][layer][k]: the expert of each rank; -1 where the file has no row, which only a prompt step before the
    // last may lack (a recording computes the last layer for the output rows only)
    std::vector<int32_t> ids;
    std::vector<float>   weights;  // same layout: the router's weight after normalisation

    bool has(int pos, int layer) const { return ids[((size_t) pos * n_layer + layer) * k] >= 0; }
    const int32_t * ids_at(int pos, int layer) const { return &ids[((size_t) pos * n_layer + layer) * k]; }
    const float * weights_at(int pos, int layer) const { return &weights[((size_t) pos * n_layer + layer) * k]; }
};

// The whole file, checked strictly: the model line, the column header, nine fields per row, integers and a finite
// weight, each (step, layer) with all k ranks once and k distinct experts, steps 0..N-1 without a gap, prompt steps
// first, every layer at every generated step and the last prompt step.  Throws
// std::runtime_error naming the file, the line and the problem.
vis_route_csv vis_route_csv_read(const std::string & path);
