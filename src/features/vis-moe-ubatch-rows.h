// vis-moe-ubatch-rows.h - the tokens of the ubatch being computed, and which of them a row of a layer's routing
// belongs to: a layer routes every token of the ubatch, or (the last layer) only the output tokens, since upstream
// computes the last layer for the output rows only.  Used by the routing trace (vis-moe-trace.h) and replay
// (vis-moe-replay.h).
#pragma once

#include "llama-batch.h"

#include <cstdint>
#include <vector>

struct vis_ubatch_rows {
    std::vector<int32_t> pos, seq;  // per token of the ubatch (-1 when the ubatch has none)
    std::vector<int32_t> out;       // the tokens with an output row, in order
    uint8_t image = 0;              // the ubatch is embeddings (an image)

    void begin(const llama_ubatch & ub) {
        pos.assign(ub.n_tokens, -1);
        seq.assign(ub.n_tokens, -1);
        out.clear();
        for (uint32_t t = 0; t < ub.n_tokens; ++t) {
            if (ub.output && ub.output[t]) {
                out.push_back((int32_t) t);
            }
            pos[t] = ub.pos ? ub.pos[t] : -1;
            seq[t] = (ub.seq_id && ub.n_seq_id && ub.n_seq_id[t] > 0) ? ub.seq_id[t][0] : -1;
        }
        image = ub.embd != nullptr ? 1 : 0;
    }

    // the ubatch token of row r of a layer that routed n_rows rows, or -1
    int token(int r, int n_rows) const {
        const int t = n_rows == (int) pos.size() ? r : (r < (int) out.size() ? out[r] : -1);
        return t >= 0 && t < (int) pos.size() ? t : -1;
    }
};
