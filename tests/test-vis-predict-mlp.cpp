// test-vis-predict-mlp: the VisMMOE lookahead MLP predictor (--moe-predict mlp, src/features/vis-moe-predict-mlp.h) on a
// tiny hand-made profile, against hand-computed values:
//   - the forward pass relu(W1 [hist; h] + b1) -> W2 a + b2, one head per distance;
//   - the routing-history histogram: layer l's experts, plus decay * layer l-1's when it routed the same ubatch;
//   - pooling: the tokens' sigmoids summed;
//   - no prediction without the hidden state, for a wrong width, an untrained layer or a distance beyond the MLP's;
//   - no profile, or a profile without an MLP: an error naming the fix.
// tests/test_prediction_calibration.py checks pyvis' NumPy forward against the same numbers.
#include "vis-check.h"
#include "vis-moe-predict-mlp.h"
#include "vis-predict-input.h"
#include "vis-moe-profile.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

static bool near(float a, float b) { return std::fabs(a - b) < 1e-5f; }
static float sig(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// 3 layers of 4 experts, n_embd 3, H = 2, lookahead 2, history 2 (decay 0.5); layers 0 and 1 trained
static vis_predict_profile profile() {
    vis_predict_profile p;
    p.path = "tiny.gguf";
    p.n_layer = 3;
    p.n_expert = 4;
    p.k = 2;
    p.lookahead = 1;
    p.mlp_lookahead = 2;
    p.mlp_hidden = 2;
    p.mlp_n_embd = 3;
    p.mlp_history = 2;
    p.mlp_history_decay = 0.5f;
    p.mlp_layer = { 1, 1, 0 };
    const int D = 7, H = 2, O = 8;
    p.mlp_w1.assign(3 * H * D, 0.0f);
    p.mlp_b1.assign(3 * H, 0.0f);
    p.mlp_w2.assign(3 * O * H, 0.0f);
    p.mlp_b2.assign(3 * O, 0.0f);
    // layer 0: a0 = hist[0] + h[0], a1 = relu(h[1] - h[2] + 0.5); y[o] = w2[o][0] a0 with w2[o][0] = 1 (o = 3, 7)
    // or 0.1 o
    const float w1_0[2][7] = { { 1, 0, 0, 0, 1, 0, 0 }, { 0, 0, 0, 0, 0, 1, -1 } };
    for (int h = 0; h < H; ++h) {
        for (int i = 0; i < D; ++i) {
            p.mlp_w1[h * D + i] = w1_0[h][i];
        }
    }
    p.mlp_b1[1] = 0.5f;
    for (int o = 0; o < O; ++o) {
        p.mlp_w2[o * H + 0] = o % 4 == 3 ? 1.0f : 0.1f * o;
    }
    // layer 1: a0 = hist . (1, 2, 3, 4), a1 = relu(-hist[0]); y[o] = 0.1 (o + 1) a0 - 1
    const float w1_1[2][7] = { { 1, 2, 3, 4, 0, 0, 0 }, { -1, 0, 0, 0, 0, 0, 0 } };
    for (int h = 0; h < H; ++h) {
        for (int i = 0; i < D; ++i) {
            p.mlp_w1[(H + h) * D + i] = w1_1[h][i];
        }
    }
    for (int o = 0; o < O; ++o) {
        p.mlp_w2[(O + o) * H + 0] = 0.1f * (o + 1);
        p.mlp_b2[O + o] = -1.0f;
    }
    return p;
}

static vis_predict_input with_hidden(vis_predict_input in, const std::vector<float> & h, int n_embd = 3) {
    in.hidden = h.data();
    in.n_embd = n_embd;
    in.hidden_stride = n_embd;
    return in;
}

static void test_forward() {
    const vis_predict_profile p = profile();
    const float hist[4] = { 0, 1, 1, 0 }, h[3] = { 2, 1, 3 };
    float a[2], y[8];
    vis_mlp_forward(p, 0, hist, h, a, y);
    // a = (0 + 2, relu(1 - 3 + 0.5)) = (2, 0); y = w2[:, 0] * 2
    CHECK(near(a[0], 2.0f) && near(a[1], 0.0f));
    const float want[8] = { 0.0f, 0.2f, 0.4f, 2.0f, 0.8f, 1.0f, 1.2f, 2.0f };
    for (int o = 0; o < 8; ++o) {
        CHECK(near(y[o], want[o]));
    }
}

static void test_predictor() {
    const vis_predict_profile p = profile();
    auto m = vis_moe_predictor_make(VIS_PRED_MLP, { 4, 4, 4 }, 2, 1234, &p);
    CHECK(m && std::string(m->name()) == "mlp" && m->wants_hidden() && !m->wants_logits());
    std::vector<float> score;
    const std::vector<int32_t> l0 = { 1, 2 };
    const std::vector<float> h = { 2, 1, 3 };
    // layer 0 (layer -1 does not exist: no history term): the forward above, sigmoids of each head
    m->observe(with_hidden(input(0, 5, l0, 2), h));
    CHECK(m->predict(with_hidden(input(0, 5, l0, 2), h), 1, 4, score));
    CHECK(score.size() == 4 && near(score[0], 0.5f) && near(score[1], sig(0.2f)) && near(score[3], sig(2.0f)));
    CHECK(vis_predict_top(score, 2) == std::vector<int32_t>({ 3, 2 }));
    CHECK(m->predict(with_hidden(input(0, 5, l0, 2), h), 2, 4, score));
    CHECK(near(score[0], sig(0.8f)) && near(score[3], sig(2.0f)));
    // layer 1 in the same step: hist = {0, 1} + 0.5 {1, 2} = (1, 1.5, 0.5, 0), a0 = 1 + 3 + 1.5 = 5.5
    const std::vector<int32_t> l1 = { 0, 1 };
    m->observe(with_hidden(input(1, 5, l1, 2), h));
    CHECK(m->predict(with_hidden(input(1, 5, l1, 2), h), 1, 4, score));
    for (int e = 0; e < 4; ++e) {
        CHECK(near(score[e], sig(0.55f * (e + 1) - 1.0f)));
    }
    CHECK(!m->predict(with_hidden(input(1, 5, l1, 2), h), 2, 4, score));  // layer 3 does not exist
    // layer 1 in a step where layer 0 did not route: hist = (1, 1, 0, 0), a0 = 3
    m->observe(with_hidden(input(1, 6, l1, 2), h));
    CHECK(m->predict(with_hidden(input(1, 6, l1, 2), h), 1, 4, score));
    CHECK(near(score[2], sig(0.3f * 3 - 1.0f)));
    // two tokens: the sigmoids summed (token 2: hist (1, 0, 0, 1) with history (0, 0.5, 0.5, 0) of its layer-0 ids)
    const std::vector<int32_t> two0 = { 1, 2, 1, 2 }, two1 = { 0, 1, 0, 3 };
    const std::vector<float> hh = { 2, 1, 3, 2, 1, 3 };
    m->observe(with_hidden(input(0, 7, two0, 2), hh));
    m->observe(with_hidden(input(1, 7, two1, 2), hh));
    CHECK(m->predict(with_hidden(input(1, 7, two1, 2), hh), 1, 4, score));
    // token 1: a0 = 5.5; token 2: hist (1, 0.5, 0.5, 1): a0 = 1 + 1 + 1.5 + 4 = 7.5
    CHECK(near(score[1], sig(0.2f * 5.5f - 1.0f) + sig(0.2f * 7.5f - 1.0f)));
    // no hidden state, another width, an untrained layer, a distance beyond the MLP's: no prediction
    CHECK(!m->predict(input(0, 8, l0, 2), 1, 4, score));
    CHECK(!m->predict(with_hidden(input(0, 8, l0, 2), h, 2), 1, 4, score));
    CHECK(!m->predict(with_hidden(input(2, 8, l0, 2), h), 1, 4, score));
}

static void test_errors() {
    bool threw = false;
    try {
        vis_moe_predictor_make(VIS_PRED_MLP, { 4, 4, 4 }, 1, 1234, nullptr);
    } catch (const std::runtime_error & e) {
        threw = std::string(e.what()).find("--mlp") != std::string::npos;
    }
    CHECK(threw);
    vis_predict_profile none = profile();
    none.mlp_lookahead = 0;
    threw = false;
    try {
        vis_moe_predictor_make(VIS_PRED_MLP, { 4, 4, 4 }, 1, 1234, &none);
    } catch (const std::runtime_error & e) {
        const std::string w = e.what();
        threw = w.find("holds no MLP") != std::string::npos && w.find("tiny.gguf") != std::string::npos &&
                w.find("pyvis calibrate predictor") != std::string::npos;
    }
    CHECK(threw);
}

int main() {
    test_forward();
    test_predictor();
    test_errors();
    return vis_check_done("test-vis-predict-mlp");
}
