// test-vis-predict-profile: coact and freq seeded from a predictor profile (--moe-predict-profile,
// src/features/vis-moe-predict.h, src/features/vis-moe-profile.h) against hand-computed values:
//   - counts C_d[l][i, j] = P_d[l][i, j] * k * freq[l][i] * n_tokens, uses[l][e] = freq[l][e] * n_tokens, so the
//     first conditional scores are the profile's rows summed (times k);
//   - online learning goes on counting on top;
//   - "count" weighting sums raw counts; distances beyond the profile's W predict nothing until counted;
//   - freq starts from the profile's frequencies; next-router and random ignore a profile.
#include "vis-check.h"
#include "vis-moe-predict.h"
#include "vis-predict-input.h"
#include "vis-moe-profile.h"

#include <cmath>
#include <vector>

static bool near(float a, float b) { return std::fabs(a - b) < 1e-4f; }

// 3 layers of 4 experts, top-2, fitted on 10 tokens, W = 1; only layer 0 -> 1 has rows
static vis_predict_profile profile(const char * weighting = "conditional") {
    vis_predict_profile p;
    p.n_layer = 3;
    p.n_expert = 4;
    p.k = 2;
    p.n_tokens = 10;
    p.lookahead = 1;
    p.weighting = weighting;
    p.freq = { 0.5f, 0.5f, 1.0f, 0.0f,    0.2f, 0.3f, 0.5f, 1.0f,    0.0f, 0.0f, 0.0f, 0.0f };
    p.coact.assign(1 * 3 * 4 * 4, 0.0f);
    const float rows[4][4] = { { 0, 0.5f, 0.5f, 0 }, { 0.25f, 0.25f, 0.25f, 0.25f }, { 0, 0, 0, 1 }, { 0, 0, 0, 0 } };
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 4; ++j) {
            p.coact[i * 4 + j] = rows[i][j];
        }
    }
    return p;
}

static void test_coact_seeded() {
    const vis_predict_profile pf = profile();
    CHECK(near(pf.row(1, 0, 2)[3], 1.0f) && near(pf.freq_at(1, 3), 1.0f));
    auto p = vis_moe_predictor_make(VIS_PRED_COACT, { 4, 4, 4 }, 2, 1234, &pf);
    std::vector<float> score;
    // C[0] = row0 * 2 * 0.5 * 10 = (0, 5, 5, 0), uses(0) = 5; C[2] = (0, 0, 0, 20), uses(2) = 10
    std::vector<int32_t> q = { 0, 2 };
    CHECK(p->predict(input(0, 1, q, 2), 1, 4, score));
    // conditional: (row0 + row2) * k
    CHECK(near(score[0], 0.0f) && near(score[1], 1.0f) && near(score[2], 1.0f) && near(score[3], 2.0f));
    // expert 3 never selected at layer 0 in the profile: no evidence
    std::vector<int32_t> q3 = { 3, 3 };
    CHECK(!p->predict(input(0, 1, q3, 2), 1, 4, score));
    // d = 2 is beyond the profile's W = 1: nothing until counted online
    CHECK(!p->predict(input(0, 1, q, 2), 2, 4, score));
    // online: a step routing {0, 1} at layer 0, {3, 1} at layer 1 -> C[0] = (0, 6, 5, 1), uses(0) = 6
    std::vector<int32_t> l0 = { 0, 1 }, l1 = { 3, 1 }, l2 = { 2, 0 };
    p->observe(input(0, 5, l0, 2));
    p->observe(input(1, 5, l1, 2));
    p->observe(input(2, 5, l2, 2));
    std::vector<int32_t> one = { 0 };
    CHECK(p->predict(input(0, 6, one, 1), 1, 4, score));
    CHECK(near(score[0], 0.0f) && near(score[1], 1.0f) && near(score[2], 5.0f / 6) && near(score[3], 1.0f / 6));
    // d = 2 now counted once: 0 -> {2, 0} at layer 2
    CHECK(p->predict(input(0, 6, one, 1), 2, 4, score));
    CHECK(near(score[0], 1.0f / 6) && near(score[2], 1.0f / 6) && near(score[1], 0.0f));
}

static void test_coact_count_weighting() {
    const vis_predict_profile pf = profile("count");
    auto p = vis_moe_predictor_make(VIS_PRED_COACT, { 4, 4, 4 }, 1, 1234, &pf);
    std::vector<float> score;
    std::vector<int32_t> q = { 0, 2 };
    CHECK(p->predict(input(0, 1, q, 2), 1, 4, score));
    // raw counts: C[0] + C[2] = (0, 5, 5, 0) + (0, 0, 0, 20)
    CHECK(near(score[0], 0.0f) && near(score[1], 5.0f) && near(score[2], 5.0f) && near(score[3], 20.0f));
}

static void test_freq_seeded() {
    const vis_predict_profile pf = profile();
    auto p = vis_moe_predictor_make(VIS_PRED_FREQ, { 4, 4, 4 }, 1, 1234, &pf);
    std::vector<float> score;
    std::vector<int32_t> q = { 0, 1 };
    CHECK(p->predict(input(0, 1, q, 2), 1, 4, score));   // layer 1: freq * 10
    CHECK(near(score[0], 2.0f) && near(score[1], 3.0f) && near(score[2], 5.0f) && near(score[3], 10.0f));
    std::vector<int32_t> l1 = { 0, 0 };
    p->observe(input(1, 2, l1, 2));                      // online on top
    CHECK(p->predict(input(0, 3, q, 2), 1, 4, score) && near(score[0], 4.0f));
    // a layer of another expert count than the profile's is not seeded
    auto r = vis_moe_predictor_make(VIS_PRED_FREQ, { 4, 8, 4 }, 1, 1234, &pf);
    CHECK(r->predict(input(0, 1, q, 2), 1, 8, score) && near(score[0], 0.0f) && near(score[7], 0.0f));
}

static void test_others_ignore_it() {
    const vis_predict_profile pf = profile();
    auto a = vis_moe_predictor_make(VIS_PRED_RANDOM, { 4, 4, 4 }, 1, 7, &pf);
    auto b = vis_moe_predictor_make(VIS_PRED_RANDOM, { 4, 4, 4 }, 1, 7);
    std::vector<int32_t> ids = { 1, 2 };
    std::vector<float> sa, sb;
    CHECK(a->predict(input(0, 1, ids, 2), 1, 4, sa) && b->predict(input(0, 1, ids, 2), 1, 4, sb) && sa == sb);
    auto n = vis_moe_predictor_make(VIS_PRED_NEXT_ROUTER, { 4, 4, 4 }, 1, 1234, &pf);
    CHECK(n && !n->predict(input(0, 1, ids, 2), 1, 4, sa));   // no logits: no prediction, profile or not
}

int main() {
    test_coact_seeded();
    test_coact_count_weighting();
    test_freq_seeded();
    test_others_ignore_it();
    return vis_check_done("test-vis-predict-profile");
}
