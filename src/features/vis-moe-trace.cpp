// vis-moe-trace.cpp - routing trace writer (vis-moe-trace.h).
#include "vis-moe-trace.h"
#include "vis-moe-context.h"
#include "vis-output-file.h"

#include "ggml.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>


static const char     TRACE_MAGIC[8]  = { 'V', 'I', 'S', 'T', 'R', 'A', 'C', 'E' };
static const uint32_t TRACE_VERSION   = 1;
static const uint32_t TRACE_REC_TAG   = 0x31434552; // "REC1"
static const uint32_t TRACE_SUB_TAG   = 0x31425553; // "SUB1": substitution, after the REC1 of its layer

vis_moe_trace::vis_moe_trace(const std::string & path, uint32_t n_layer, uint32_t n_expert, uint32_t n_expert_used)
    : file_path(path) {
    const std::string why = vis_output_refusal(path, std::string(TRACE_MAGIC, sizeof(TRACE_MAGIC)), "a routing trace");
    if (!why.empty()) {
        throw std::runtime_error("--moe-trace: refusing to overwrite '" + path + "': " + why + "; give a new file name");
    }
    f = std::fopen(path.c_str(), "wb");
    if (!f) {
        throw std::runtime_error("--moe-trace: cannot open '" + path + "' for writing: " + std::strerror(errno));
    }
    const uint32_t hdr[4] = { TRACE_VERSION, n_layer, n_expert, n_expert_used };
    write(TRACE_MAGIC, 1, sizeof(TRACE_MAGIC));
    write(hdr, sizeof(uint32_t), 4);
    if (std::fflush(f) != 0 && error.empty()) {
        error = std::strerror(errno);
    }
    if (!error.empty()) {
        std::fclose(f);
        f = nullptr;
        throw std::runtime_error("--moe-trace: cannot write '" + path + "': " + error);
    }
}

vis_moe_trace::~vis_moe_trace() {
    if (f) {
        std::fclose(f);
    }
}

void vis_moe_trace::write(const void * p, size_t size, size_t n) {
    if (n > 0 && std::fwrite(p, size, n, f) != n && error.empty()) {
        error = std::strerror(errno ? errno : EIO);
    }
}

void vis_moe_trace::begin_ubatch(const llama_ubatch & ub) {
    ubatch_index++;
    rows.begin(ub);
}

void vis_moe_trace::record(int il, const ggml_tensor * ids, const ggml_tensor * weights) {
    const int32_t k        = (int32_t) ids->ne[0];
    const int32_t n_tokens = (int32_t) ids->ne[1];
    const int32_t rec[5]   = { (int32_t) TRACE_REC_TAG, ubatch_index, il, n_tokens, k };
    write(rec, sizeof(int32_t), 5);
    std::vector<int32_t> seq(n_tokens, -1), pos(n_tokens, -1);
    std::vector<uint8_t> mod(n_tokens, rows.image);
    for (int t = 0; t < n_tokens; ++t) {
        const int tok = rows.token(t, n_tokens);
        if (tok >= 0) {
            pos[t] = rows.pos[tok];
            seq[t] = rows.seq[tok];
        }
    }
    write(seq.data(), sizeof(int32_t), n_tokens);
    write(pos.data(), sizeof(int32_t), n_tokens);
    write(mod.data(), 1, n_tokens);
    write(ids->data, sizeof(int32_t), (size_t) k * n_tokens);  // contiguous
    std::vector<float> w((size_t) k * n_tokens, 0.0f);
    if (weights && weights->type == GGML_TYPE_F32 && ggml_nelements(weights) == (int64_t) w.size()) {
        if (ggml_is_contiguous(weights)) {
            std::memcpy(w.data(), weights->data, w.size() * sizeof(float));
        } else {  // [1, k, n_tokens] with strides
            for (int t = 0; t < n_tokens; ++t) {
                for (int i = 0; i < k; ++i) {
                    w[(size_t) t * k + i] = *(const float *) ((const char *) weights->data + i * weights->nb[1] + t * weights->nb[2]);
                }
            }
        }
    }
    write(w.data(), sizeof(float), w.size());
}

void vis_moe_trace::record_sub(int il, int64_t n_tokens, int k, const int32_t * exec, const uint8_t * outcome) {
    const int32_t rec[5] = { (int32_t) TRACE_SUB_TAG, ubatch_index, il, (int32_t) n_tokens, k };
    write(rec, sizeof(int32_t), 5);
    write(exec, sizeof(int32_t), (size_t) n_tokens * k);
    write(outcome, 1, (size_t) n_tokens * k);
}

std::string vis_moe_trace::end_ubatch() {
    if (std::fflush(f) != 0 && error.empty()) {
        error = std::strerror(errno ? errno : EIO);
    }
    return error.empty() ? "" : "--moe-trace: writing '" + file_path + "' failed: " + error +
                                " (the trace is incomplete; free space or choose another file)";
}

void vis_moe_trace::ubatch_end(vis_moe_context & vm) {
    const std::string err = end_ubatch();
    if (!err.empty()) {
        vm.fail(err);
    }
}

void vis_moe_trace::plan_routed(const vis_moe_context & vm, const vis_moe_layer & L, int il, const vis_ubatch_plan & plan,
                                const ggml_tensor * ids) {
    (void) L;
    if (vm.sub || plan.sub_active) {  // the experts the passes run (SUB1, after the REC1)
        record_sub(il, ids->ne[1], (int) ids->ne[0], plan.exec.data(), plan.outcome.data());
    }
}
