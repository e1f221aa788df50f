// vis-moe-mode.cpp - --moe-mode exact|fast (vis-moe-mode.h, docs/mode.md).
#include "vis-moe-mode.h"

#include <string>

int vis_moe_mode_fast_topk(int k) {
    return (2 * k + 2) / 3;
}

std::string vis_moe_mode_resolve(vis_moe_settings & s, int k) {
    if (s.mode != VIS_MODE_FAST) {
        return "";
    }
    if (s.topk > 0) {
        return "vis-moe: --moe-mode fast: nothing turned on: --moe-topk " + std::to_string(s.topk) + " was given and "
               "replaces its own (the output is " + (s.topk < k ? "lossy" : "exact") + ")";
    }
    if (k <= 0) {
        return "vis-moe: --moe-mode fast: nothing turned on: the model has no routed experts, so the output is exact";
    }
    const int n = vis_moe_mode_fast_topk(k);
    if (n >= k) {
        return "vis-moe: --moe-mode fast: nothing turned on: the model runs " + std::to_string(k) + " expert" +
               (k == 1 ? "" : "s") + " per token, and fast's ceil(2k/3) keeps them all, so the output is exact";
    }
    s.topk = n;
    return "vis-moe: --moe-mode fast (LOSSY: outputs differ from the model's): turned on --moe-topk " +
           std::to_string(n) + " (each token runs its " + std::to_string(n) + " highest-weighted of the model's " +
           std::to_string(k) + " experts)";
}
