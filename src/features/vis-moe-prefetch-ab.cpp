// vis-moe-prefetch-ab.cpp - measured on/off choice for reads ahead (vis-moe-prefetch-ab.h).
#include "vis-moe-prefetch-ab.h"

#include <algorithm>

namespace {
int64_t median(std::vector<int64_t> v) {
    if (v.empty()) {
        return 0;
    }
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
}
} // namespace

void vis_prefetch_ab::begin(bool decode_) {
    decode = decode_;
    if (!decode) {
        skip = true;  // a prompt: the step after it is not typical
        return;
    }
    if (ph == PROBE) {
        cur_on = (step_in / EPOCH) % 2 == 0;  // on, off, on, off
    }
}

void vis_prefetch_ab::end(int64_t us) {
    if (!decode) {
        return;
    }
    if (skip) {
        skip = false;
        return;
    }
    if (ph == RUN_PHASE) {
        if (++step_in >= RUN) {
            ph = PROBE;
            step_in = 0;
            t_on.clear();
            t_off.clear();
            res.running_on = 1;
        }
        return;
    }
    (cur_on ? t_on : t_off).push_back(us);
    if (++step_in >= 4 * EPOCH) {
        decide();
    }
}

void vis_prefetch_ab::decide() {
    res.median_on_us  = median(t_on);
    res.median_off_us = median(t_off);
    res.probes++;
    cur_on = res.median_on_us > 0 && (double) res.median_on_us < MARGIN * (double) res.median_off_us;
    res.chose_on += cur_on ? 1 : 0;
    res.running_on = cur_on ? 1 : 0;
    ph = RUN_PHASE;
    step_in = 0;
}
