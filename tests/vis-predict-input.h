// vis-predict-input.h - what a predictor sees when layer il routes `ids` (k per token), for the C++ tests of the
// predictors (test-vis-predict*.cpp).
#pragma once

#include "vis-moe-predict.h"

#include <cstdint>
#include <vector>

static inline vis_predict_input input(int il, uint64_t step, const std::vector<int32_t> & ids, int k) {
    vis_predict_input in;
    in.il       = il;
    in.step     = step;
    in.k        = k;
    in.n_tokens = (int64_t) ids.size() / k;
    in.ids      = ids.data();
    return in;
}
