// vis-moe-split.cpp - per-layer slot counts from one expert budget: the rule and the split file (vis-moe-split.h).
#include "vis-moe-split.h"
#include "llama-vis.h"
#include "vis-error.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace {

constexpr double HYSTERESIS = 0.1;  // a slot moves only where it saves 10 % more than it costs (docs/policies-limits.md)
constexpr double TOL = 1e-5;        // relative to the largest curve value: closer is a tie
constexpr const char * MAGIC = "vis-moe slot-split 1";
constexpr const char * MAKE  = "pyvis plan MODEL --profile TRACE --write-split FILE";

} // namespace

int32_t llama_vis_moe_split_slots(const double * miss_curve, int32_t n_layers, int32_t n_expert, int32_t n_expert_used,
                                  int32_t slots, const int64_t * row_bytes, int32_t * out) {
    vis_clear_last_error();
    if (!miss_curve || !out || n_layers < 1 || n_expert < 1 || n_expert_used < 1 || n_expert_used > n_expert ||
        slots < 1 || slots > n_expert) {
        vis_set_last_error("llama_vis_moe_split_slots: need curves, out, n_layers >= 1, 1 <= n_expert_used <= n_expert "
                           "and 1 <= slots <= n_expert (got " + std::to_string(n_layers) + " layers, " +
                           std::to_string(n_expert) + " experts, top-" + std::to_string(n_expert_used) + ", " +
                           std::to_string(slots) + " slots)");
        return -1;
    }
    const size_t w = (size_t) n_expert + 1;
    for (size_t i = 0; i < (size_t) n_layers * w; ++i) {
        if (!std::isfinite(miss_curve[i])) {
            vis_set_last_error("llama_vis_moe_split_slots: miss curve of layer " + std::to_string(i / w) +
                               " is not finite at " + std::to_string(i % w) + " slots");
            return -1;
        }
    }
    // a layer stays within min(top-k, slots) .. min(n_expert, 2 slots): the range the rule was measured on
    const int lo = std::min(n_expert_used, slots);
    const int hi = std::min(n_expert, 2 * slots);
    auto c = [&](int l, int s) { return miss_curve[(size_t) l * w + s]; };
    // comparisons within TOL of the largest curve value in the range are ties: the rule gives the same split on curves rounded
    // to float (the configurator's) or scaled, as long as real differences are larger (curves of counts are)
    double top = 0;
    for (int l = 0; l < n_layers; ++l) {
        for (int x = lo; x <= hi; ++x) {
            top = std::max(top, std::fabs(c(l, x)));
        }
    }
    const double tol = TOL * top + 1e-12;
    std::vector<int> caps(n_layers, slots);
    const double inf = std::numeric_limits<double>::infinity();
    for (;;) {
        // the layer that gains most by one more slot (the first on ties) ...
        int a = -1;
        double gain = 0;
        for (int l = 0; l < n_layers; ++l) {
            const double g = caps[l] < hi ? c(l, caps[l]) - c(l, caps[l] + 1) : -1.0;
            if (a < 0 || g > gain + tol) {
                a = l;
                gain = g;
            }
        }
        // ... and the one, not larger per slot, that loses least by one fewer
        int b = -1;
        double loss = inf;
        for (int l = 0; l < n_layers; ++l) {
            const bool may = caps[l] > lo && l != a && (!row_bytes || row_bytes[l] >= row_bytes[a]);
            const double x = may ? c(l, caps[l] - 1) - c(l, caps[l]) : inf;
            if (b < 0 || x < loss - tol) {
                b = l;
                loss = x;
            }
        }
        if (!(gain > std::max(loss, loss * (1 + HYSTERESIS)) + tol)) {  // the total falls each move: no cycles
            break;
        }
        caps[a]++;
        caps[b]--;
    }
    std::copy(caps.begin(), caps.end(), out);
    return 0;
}

int32_t llama_vis_moe_extra_slots(const double * miss_curve, int32_t n_layers, int32_t n_expert, const int32_t * slots,
                                  int32_t extra, int32_t * out) {
    vis_clear_last_error();
    if (!slots || !out || n_layers < 1 || n_expert < 1 || extra < 0) {
        vis_set_last_error("llama_vis_moe_extra_slots: need slots, out, n_layers >= 1, n_expert >= 1 and extra >= 0 "
                           "(got " + std::to_string(n_layers) + " layers, " + std::to_string(n_expert) + " experts, " +
                           std::to_string(extra) + " extra)");
        return -1;
    }
    std::vector<int> open;  // the layers that can take one more slot, in order
    for (int l = 0; l < n_layers; ++l) {
        if (slots[l] < 0 || slots[l] > n_expert) {
            vis_set_last_error("llama_vis_moe_extra_slots: layer " + std::to_string(l) + " has " +
                               std::to_string(slots[l]) + " slots, outside 0.." + std::to_string(n_expert));
            return -1;
        }
        out[l] = slots[l];
        if (slots[l] < n_expert) {
            open.push_back(l);
        }
    }
    const int E = (int) open.size();
    const int x = std::min(extra, E);
    if (x == 0) {
        return 0;
    }
    if (!miss_curve) {
        for (int i = 0; i < x; ++i) {
            out[open[(size_t) ((2ll * i + 1) * E / (2ll * x))]]++;
        }
        return 0;
    }
    const size_t w = (size_t) n_expert + 1;
    std::vector<double> gain(n_layers);
    for (int l : open) {
        gain[l] = miss_curve[(size_t) l * w + slots[l]] - miss_curve[(size_t) l * w + slots[l] + 1];
        if (!std::isfinite(gain[l])) {
            vis_set_last_error("llama_vis_moe_extra_slots: miss curve of layer " + std::to_string(l) +
                               " is not finite at " + std::to_string(slots[l]) + ".." + std::to_string(slots[l] + 1) +
                               " slots");
            return -1;
        }
    }
    std::stable_sort(open.begin(), open.end(), [&](int a, int b) { return gain[a] > gain[b]; });
    for (int i = 0; i < x; ++i) {
        out[open[i]]++;
    }
    return 0;
}

vis_moe_split_file vis_moe_split_file_load(const std::string & path, int n_moe_layers, int n_expert) {
    auto fail = [&](const std::string & what) {
        return std::runtime_error("VIS_MOE_SLOT_SPLIT " + path + ": " + what + "; make one for this model with: " + MAKE);
    };
    std::ifstream in(path);
    if (!in) {
        throw fail("cannot open it");
    }
    std::string line;
    if (!std::getline(in, line) || line != MAGIC) {
        const bool trace = line.rfind("# route_trace", 0) == 0 || line.rfind("VISTRACE", 0) == 0 ||
                           line.rfind("turn,", 0) == 0;
        throw fail(trace ? "this is a routing trace, not a split file (its per-layer miss curves): turn the trace "
                           "into one first"
                         : "not a split file (the first line is not '" + std::string(MAGIC) + "')");
    }
    vis_moe_split_file f;
    f.path = path;
    int n_lines = 1;
    while (std::getline(in, line)) {
        ++n_lines;
        if (line.empty() || line[0] == '#') {
            continue;
        }
        std::istringstream ls(line);
        std::string word;
        ls >> word;
        const std::string at = "line " + std::to_string(n_lines);
        if (word == "experts") {
            std::string kw;
            if (!(ls >> f.n_expert >> kw >> f.top_k) || kw != "top_k" || f.n_expert < 1 || f.top_k < 1 ||
                f.top_k > f.n_expert) {
                throw fail(at + ": expected 'experts N top_k K' with 1 <= K <= N");
            }
        } else if (word == "layer") {
            if (f.n_expert < 1) {
                throw fail(at + ": a layer line before the 'experts N top_k K' line");
            }
            int il = -1;
            if (!(ls >> il) || il < 0) {
                throw fail(at + ": expected 'layer ID' and " + std::to_string(f.n_expert + 1) + " misses");
            }
            std::vector<double> v;
            std::string tok;
            while (ls >> tok) {
                char * end = nullptr;
                const double x = std::strtod(tok.c_str(), &end);
                if (end == tok.c_str() || *end != '\0' || !std::isfinite(x) || x < 0) {
                    throw fail(at + ": '" + tok + "' is not a finite number >= 0");
                }
                v.push_back(x);
            }
            if ((int) v.size() != f.n_expert + 1) {
                throw fail(at + ": layer " + std::to_string(il) + " has " + std::to_string(v.size()) +
                           " misses, expected " + std::to_string(f.n_expert + 1) + " (0.." + std::to_string(f.n_expert) +
                           " slots)");
            }
            f.layers.push_back(il);
            f.curves.insert(f.curves.end(), v.begin(), v.end());
        } else {
            throw fail(at + ": unknown line '" + word + "'");
        }
    }
    if (f.layers.empty()) {
        throw fail("no layer lines");
    }
    if ((int) f.layers.size() != n_moe_layers || f.n_expert != n_expert) {
        throw fail("it was made for a model with " + std::to_string(f.layers.size()) + " MoE layers x " +
                   std::to_string(f.n_expert) + " experts, this model has " + std::to_string(n_moe_layers) + " x " +
                   std::to_string(n_expert));
    }
    return f;
}

std::vector<double> vis_moe_split_curves(const vis_moe_split_file & f, const std::vector<int> & managed_pos) {
    std::vector<double> cv;
    for (int p : managed_pos) {
        cv.insert(cv.end(), f.curve((size_t) p), f.curve((size_t) p) + f.n_expert + 1);
    }
    return cv;
}

std::vector<int> vis_moe_split_apply(const vis_moe_split_file & f, const std::vector<int> & managed_pos, int slots,
                                     const std::vector<int64_t> & row_bytes) {
    const int n = (int) managed_pos.size();
    if (n == 0 || slots >= f.n_expert) {
        return std::vector<int>(n, std::min(slots, f.n_expert));
    }
    const std::vector<double> cv = vis_moe_split_curves(f, managed_pos);
    std::vector<int32_t> out(n);
    if (llama_vis_moe_split_slots(cv.data(), n, f.n_expert, f.top_k, slots, row_bytes.data(), out.data()) != 0) {
        throw std::runtime_error("VIS_MOE_SLOT_SPLIT " + f.path + ": " + llama_vis_last_error());
    }
    return std::vector<int>(out.begin(), out.end());
}
