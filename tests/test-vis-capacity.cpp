// test-vis-capacity: entropy-weighted capacity (src/features/vis-moe-capacity.h) on small cases computed by hand.
//   - R_v and the capacity C = round(N (1 + rho (R_v - 0.5)));
//   - the missing image-only experts ranked by entropy-weighted load, scaled by the modality bias;
//   - overflow pairs rerouted to the best-scored expert in memory the token does not run (never a duplicate);
//   - text tokens never rerouted, text-routed experts always in memory;
//   - no target: dropped (weight 0 on an expert the token runs) or, with drop off, the expert forced in;
//   - MACS weights: sigmoid(-delta z) of the z-scored softmax entropy.
#include "vis-check.h"
#include "llama-vis.h"
#include "vis-moe-capacity.h"
#include "vis-moe-modality.h"

#include <cmath>
#include <set>
#include <vector>

struct outcome {
    std::vector<int32_t> exec;
    std::vector<uint8_t> dropped;
    llama_vis_moe_cap_stats st = {};
    bool changed = false;
};

static outcome run(const vis_cap_rule & rule, int n_expert, const std::vector<int> & res, const std::vector<int32_t> & ids,
                   int k, const std::vector<float> & tok_w, const std::vector<uint8_t> & image,
                   const std::vector<float> & scores) {
    outcome o;
    std::vector<uint8_t> resident(n_expert, 0);
    for (int e : res) {
        resident[e] = 1;
    }
    vis_cap_input in;
    in.ids = ids.data();
    in.k = k;
    in.n_tokens = (int64_t) ids.size() / k;
    in.tok_w = tok_w.data();
    in.image = image.empty() ? nullptr : image.data();
    in.scores = scores.empty() ? nullptr : scores.data();
    in.s_tok = n_expert;
    o.exec = ids;
    o.dropped.assign(ids.size(), 9);
    o.changed = vis_cap_decide(rule, n_expert, resident, in, o.exec.data(), o.dropped.data(), o.st);
    return o;
}

static bool no_duplicates(const outcome & o, int k, bool count_dropped) {
    for (size_t t = 0; t < o.exec.size() / k; ++t) {
        std::set<int> seen;
        for (int r = 0; r < k; ++r) {
            if (o.dropped[t * k + r] && !count_dropped) {
                continue;
            }
            if (!seen.insert(o.exec[t * k + r]).second) {
                return false;
            }
        }
    }
    return true;
}

static void test_capacity_and_reroute() {
    // 8 experts, k = 2; tokens 0..3 image (weights .9 .1 .5 .5), token 4 text; expert 7 resident
    const int E = 8, k = 2;
    const std::vector<int32_t> ids = { 0, 1,   0, 2,   3, 1,   4, 0,   5, 6 };
    const std::vector<float>   tw  = { .9f, .1f, .5f, .5f, 1.0f };
    const std::vector<uint8_t> img = { 1, 1, 1, 1, 0 };
    std::vector<float> sc(5 * E, 0.0f);
    for (int t = 0; t < 5; ++t) {
        for (int e = 0; e < E; ++e) {
            sc[t * E + e] = (float) ((e * 7 + t * 3) % 11);  // a fixed, distinct-enough score per (token, expert)
        }
    }
    vis_cap_rule r;
    r.base = 2;
    r.rho = 1;
    // R_v = 2.0 / 3.0; C = round(2 * (1 + 1/6)) = round(2.33) = 2
    outcome o = run(r, E, { 7 }, ids, k, tw, img, sc);
    CHECK(o.st.n_ubatches == 1 && o.st.capacity == 2 && std::fabs(o.st.rv_sum - 2.0 / 3.0) < 1e-6);
    // missing image-only: 0 (.9 + .1 + .5 = 1.5), 1 (.9 + .5 = 1.4), 2 (.1), 3 (.5), 4 (.5); 5, 6 are text-routed
    CHECK(o.st.n_missing == 5 && o.st.n_loaded == 2 && o.st.n_overflow == 3);
    // in memory: 7 (resident), 5 and 6 (text), 0 and 1 (top-2 loads); 2, 3, 4 overflow
    const std::set<int> mem = { 0, 1, 5, 6, 7 };
    for (size_t j = 0; j < ids.size(); ++j) {
        CHECK(mem.count(o.exec[j]) == 1);
        CHECK(o.dropped[j] == 0);
    }
    CHECK(o.exec[8] == 5 && o.exec[9] == 6);  // the text token is untouched
    CHECK(o.exec[0] == 0 && o.exec[1] == 1);  // pairs of loaded experts stay
    // token 1's expert 2 goes to the best-scored expert in memory that token 1 does not run (not 0)
    int best = -1;
    for (int c : mem) {
        if (c != 0 && (best < 0 || sc[1 * E + c] > sc[1 * E + best])) {
            best = c;
        }
    }
    CHECK(o.exec[3] == best);
    CHECK(o.st.n_rerouted == 3 && o.st.n_dropped == 0 && o.changed);
    CHECK(no_duplicates(o, k, true));
    // rho 0: C = N exactly; a larger N loads everything and changes nothing
    r.rho = 0;
    r.base = 5;
    o = run(r, E, { 7 }, ids, k, tw, img, sc);
    CHECK(o.st.capacity == 5 && o.st.n_overflow == 0 && !o.changed && o.exec == ids);
    // text only: nothing at all
    o = run(r, E, {}, ids, k, tw, {}, sc);
    CHECK(o.st.n_ubatches == 0 && !o.changed && o.exec == ids);
}

static void test_bias_ranks() {
    // 4 experts, k = 1, all image tokens (R_v = 1): loads 0: .6, 1: .5; bias: 1 visual, 0 text
    const std::vector<int32_t> ids = { 0, 1 };
    const std::vector<float>   tw  = { .6f, .5f };
    const std::vector<uint8_t> img = { 1, 1 };
    const std::vector<float>   sc  = { 1, 2, 3, 4,  1, 2, 3, 4 };
    const int8_t bias[4] = { VIS_BIAS_TEXT, VIS_BIAS_VISUAL, 0, 0 };
    vis_cap_rule r;
    r.base = 1;
    r.rho = 0;  // C = 1, and the bias scales nothing
    outcome o = run(r, 4, { 3 }, ids, 1, tw, img, sc);
    CHECK(o.exec[0] == 0 && o.exec[1] == 3);  // 0 (.6) kept, token 1 rerouted to 3 (the only other in memory)
    r.rho = 1;   // C = round(1.5) = 2: both fit
    r.bias = bias;
    o = run(r, 4, { 3 }, ids, 1, tw, img, sc);
    CHECK(o.st.capacity == 2 && o.st.n_overflow == 0);
    r.base = 1;  // rho 0.5: C = round(1.25) = 1, and the bias decides
    r.rho = 0.5;
    o = run(r, 4, { 3 }, ids, 1, tw, img, sc);
    // P0 = .6 * (1 - .25) = .45, P1 = .5 * (1 + .25) = .625: the visual expert 1 is kept
    CHECK(o.st.capacity == 1 && o.exec[1] == 1 && o.exec[0] == 3);
}

static void test_drop_and_force() {
    // k = 2; token 0 (image) runs 0 and 1, both missing and over capacity 0; nothing resident:
    // no expert in memory at all -> forced (there is nothing to drop onto)
    const std::vector<int32_t> ids = { 0, 1 };
    const std::vector<float>   tw  = { .5f };
    const std::vector<uint8_t> img = { 1 };
    vis_cap_rule r;
    r.base = 0;
    outcome o = run(r, 4, {}, ids, 2, tw, img, {});
    // the first pair's expert (0) is forced in; the second pair has no target (0 is the token's own) and is
    // dropped onto 0, weight 0
    CHECK(o.st.n_overflow == 2 && o.st.n_forced == 1 && o.st.n_dropped == 1);
    CHECK(o.exec[0] == 0 && o.exec[1] == 0 && o.dropped[0] == 0 && o.dropped[1] == 1);
    // resident 0: token runs 0 (resident) and 1 (over capacity); 0 is the only expert in memory and its own
    o = run(r, 4, { 0 }, ids, 2, tw, img, {});
    CHECK(o.st.n_overflow == 1 && o.st.n_dropped == 1 && o.dropped[1] == 1 && o.exec[1] == 0 && o.st.n_forced == 0);
    // drop off: forced instead
    r.drop = false;
    o = run(r, 4, { 0 }, ids, 2, tw, img, {});
    CHECK(o.st.n_dropped == 0 && o.st.n_forced == 1 && o.exec == ids && o.dropped[1] == 0);
    // with another expert in memory: rerouted, never dropped
    r.drop = true;
    o = run(r, 4, { 0, 3 }, ids, 2, tw, img, {});
    CHECK(o.exec[1] == 3 && o.st.n_rerouted == 1 && o.st.n_dropped == 0 && no_duplicates(o, 2, true));
}

static void test_load_bound() {
    // the graph's passes bound the loads: C = 6 but max_loads = 2; three image tokens on disjoint missing experts
    const std::vector<int32_t> ids = { 0, 1,   2, 3,   4, 5 };
    const std::vector<float>   tw  = { .9f, .5f, .1f };
    const std::vector<uint8_t> img = { 1, 1, 1 };
    const std::vector<float>   sc  = { 0, 0, 0, 0, 0, 0,   1, 2, 0, 0, 0, 0,   2, 1, 0, 0, 0, 0 };
    vis_cap_rule r;
    r.base = 6;
    r.rho = 0;
    r.max_loads = 2;
    outcome o = run(r, 6, {}, ids, 2, tw, img, sc);
    CHECK(o.st.capacity == 6 && o.st.n_loaded == 2 && o.st.n_overflow == 4 && o.st.n_forced == 0);
    CHECK(o.exec[0] == 0 && o.exec[1] == 1);
    CHECK(o.exec[2] == 1 && o.exec[3] == 0);  // token 1: best score first (1), then the other (0)
    CHECK(o.exec[4] == 0 && o.exec[5] == 1);
    CHECK(o.st.n_rerouted == 4 && no_duplicates(o, 2, true));
    std::set<int> loaded(o.exec.begin(), o.exec.end());
    CHECK(loaded.size() == 2);
    // no bound: all six load
    r.max_loads = -1;
    o = run(r, 6, {}, ids, 2, tw, img, sc);
    CHECK(o.st.n_loaded == 6 && !o.changed);
}

static void test_macs_weights() {
    // rows: flat (max entropy), peaked, in between; delta 1
    const float embd[3 * 4] = { 0, 0, 0, 0,   9, 0, 0, 0,   1, 0, 0, 0 };
    float w[3];
    vis_macs_weights(embd, 3, 4, 4, 1.0, w);
    double h[3], mean = 0, var = 0;
    for (int t = 0; t < 3; ++t) {
        double s = 0, e[4];
        for (int i = 0; i < 4; ++i) {
            e[i] = std::exp(embd[t * 4 + i]);
            s += e[i];
        }
        h[t] = 0;
        for (int i = 0; i < 4; ++i) {
            h[t] -= e[i] / s * std::log(e[i] / s);
        }
        mean += h[t] / 3;
    }
    for (double x : h) {
        var += (x - mean) * (x - mean) / 3;
    }
    for (int t = 0; t < 3; ++t) {
        const double want = 1.0 / (1.0 + std::exp((h[t] - mean) / (std::sqrt(var) + 1e-6)));
        CHECK(std::fabs(w[t] - want) < 1e-6);
    }
    CHECK(w[1] > w[2] && w[2] > w[0]);  // the peaked row weighs most, the flat one least
    float one;
    vis_macs_weights(embd, 1, 4, 4, 1.0, &one);
    CHECK(std::fabs(one - 0.5f) < 1e-6);
    CHECK(llama_vis_moe_macs_weights(embd, 3, 0, 1.0f, w) != 0);
}

int main() {
    test_capacity_and_reroute();
    test_bias_ranks();
    test_drop_and_force();
    test_load_bound();
    test_macs_weights();
    return vis_check_done("test-vis-capacity");
}
