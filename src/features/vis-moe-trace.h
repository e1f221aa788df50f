// vis-moe-trace.h - the routing trace writer (--moe-trace FILE; format in
// docs/residency.md#routing-trace, reader pyvis.runtime.trace).
#pragma once

#include "vis-moe-feature.h"
#include "vis-moe-ubatch-rows.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

struct ggml_tensor;

class vis_moe_trace : public vis_moe_feature {
public:
    // Opens `path` and writes the header.  Refuses (std::runtime_error naming the flag) a path that
    // holds anything but an earlier trace - a model, any other file - so an input is never overwritten.
    vis_moe_trace(const std::string & path, uint32_t n_layer, uint32_t n_expert, uint32_t n_expert_used);
    ~vis_moe_trace();
    vis_moe_trace(const vis_moe_trace &) = delete;
    vis_moe_trace & operator=(const vis_moe_trace &) = delete;

    // the ubatch about to be computed: positions, sequences, output rows, modality
    void begin_ubatch(const llama_ubatch & ub);
    // one MoE layer's routing: ids [k, n_tokens] (contiguous i32), weights [1?, k, n_tokens] f32 or null
    void record(int il, const ggml_tensor * ids, const ggml_tensor * weights);
    // substitution (vis-moe-substitute.h) and capacity (vis-moe-capacity.h): the expert each pair of the layer's
    // last record ran, and why (llama_vis_sub_outcome); a SUB1 record right after that REC1
    void record_sub(int il, int64_t n_tokens, int k, const int32_t * exec, const uint8_t * outcome);
    // after the ubatch: flush; "" or the message of the first write error (disk full, I/O error)
    std::string end_ubatch();

    const std::string & path() const { return file_path; }

    // the feature (vis-moe-feature.h): begin_ubatch, end_ubatch (a write error fails the ubatch)
    const char * feature_name() const override { return "trace"; }
    void ubatch_begin(vis_moe_context &, const llama_ubatch & ub) override { begin_ubatch(ub); }
    void ubatch_end(vis_moe_context & vm) override;
    void observe_routing(const vis_moe_context &, int il, const ggml_tensor * ids, const ggml_tensor * weights) override {
        record(il, ids, weights);
    }
    void plan_routed(const vis_moe_context & vm, const vis_moe_layer & L, int il, const vis_ubatch_plan & plan,
                     const ggml_tensor * ids) override;

private:
    void write(const void * p, size_t size, size_t n);

    std::string file_path;
    FILE *      f = nullptr;
    std::string error;  // first write error
    int32_t     ubatch_index = -1;
    vis_ubatch_rows rows;
};
