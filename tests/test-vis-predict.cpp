// test-vis-predict: the expert predictors (src/features/vis-moe-predict.h) against hand-computed values, and what the
// eviction policy does with reads ahead (src/core/vis-moe-policy.h).
//   - top-B ranking (ties: lower id first) and recall@k over distinct experts;
//   - co-activation: P(j at l+d | i at l) counted online, summed over the token's experts at l;
//   - frequency: the target layer's counts; next-router: softmax of the logits per token, summed;
//   - a step only pairs layers of the same ubatch (step serial);
//   - policy: a read ahead not used within its horizon becomes the first victim; after a step nothing is
//     Required.
#include "vis-check.h"
#include "vis-moe-policy.h"
#include "vis-moe-predict.h"
#include "vis-predict-input.h"
#include "vis-moe-prefetch-ab.h"

#include <cmath>
#include <vector>

static bool near(float a, float b) { return std::fabs(a - b) < 1e-5f; }

static void test_top_and_recall() {
    const std::vector<float> s = { 0.5f, 2.0f, 2.0f, -1.0f, 3.0f };
    const std::vector<int32_t> top = vis_predict_top(s, 3);
    CHECK(top.size() == 3 && top[0] == 4 && top[1] == 1 && top[2] == 2);  // tie 1/2: the lower id first
    CHECK(vis_predict_top(s, 9).size() == 5);
    CHECK(vis_predict_top(s, 0).empty());
    const int32_t actual[] = { 4, 0, 4, 3 };                 // distinct {0, 3, 4}
    CHECK(near((float) vis_predict_recall(top, actual, 4), 1.0f / 3.0f));
    CHECK(vis_predict_recall(top, actual, 0) == 0.0);
}

static void test_coact() {
    // 2 layers of 4 experts, top-2; lookahead 1
    auto p = vis_moe_predictor_make(VIS_PRED_COACT, { 4, 4 }, 1);
    CHECK(p && !p->wants_logits());
    std::vector<int32_t> s1l0 = { 0, 1 }, s1l1 = { 2, 3 }, s2l0 = { 0, 2 }, s2l1 = { 2, 1 };
    p->observe(input(0, 1, s1l0, 2));
    p->observe(input(1, 1, s1l1, 2));
    p->observe(input(0, 2, s2l0, 2));
    p->observe(input(1, 2, s2l1, 2));
    // counts from expert 0 at layer 0: 0->2 (twice), 0->3, 0->1; uses(0) = 2.  From 1: 1->2, 1->3; uses(1) = 1.
    // from 2: 2->2, 2->1; uses(2) = 1
    std::vector<float> score;
    std::vector<int32_t> q = { 0, 1 };
    CHECK(p->predict(input(0, 3, q, 2), 1, 4, score));
    CHECK(near(score[0], 0.0f) && near(score[1], 0.5f) && near(score[2], 2.0f) && near(score[3], 1.5f));
    const std::vector<int32_t> top = vis_predict_top(score, 2);
    CHECK(top[0] == 2 && top[1] == 3);
    // a layer-1 routing of another step is not paired with this step's layer 0
    p->observe(input(0, 7, q, 2));
    std::vector<int32_t> other = { 0, 0 };
    p->observe(input(1, 8, other, 2));
    CHECK(p->predict(input(0, 9, q, 2), 1, 4, score));
    CHECK(near(score[0], 0.0f));  // expert 0 at layer 1 was never counted with layer 0
    // no counts beyond the last layer, nor beyond the lookahead
    CHECK(!p->predict(input(1, 9, q, 2), 1, 4, score));
    CHECK(!p->predict(input(0, 9, q, 2), 2, 4, score));
}

static void test_freq() {
    auto p = vis_moe_predictor_make(VIS_PRED_FREQ, { 3, 3, 0 }, 1);
    std::vector<int32_t> a = { 2, 1, 2, 0 }, b = { 0, 0 };
    p->observe(input(1, 1, a, 2));  // layer 1: expert 0 once, 1 once, 2 twice
    std::vector<float> score;
    CHECK(p->predict(input(0, 2, b, 2), 1, 3, score));
    CHECK(near(score[0], 1.0f) && near(score[1], 1.0f) && near(score[2], 2.0f));
    CHECK(!p->predict(input(1, 2, b, 2), 1, 3, score));  // layer 2 has no experts
}

static void test_next_router() {
    auto p = vis_moe_predictor_make(VIS_PRED_NEXT_ROUTER, { 3, 3 }, 1);
    CHECK(p && p->wants_logits());
    // two tokens, logits of layer 1 with a stride of 4 floats (3 experts + padding)
    const float lg[] = { 0.0f, 0.0f, std::log(2.0f), 99.0f,   std::log(3.0f), 0.0f, 0.0f, 99.0f };
    std::vector<int32_t> ids = { 0, 1 };
    vis_predict_input in = input(0, 1, ids, 1);
    std::vector<float> score;
    CHECK(!p->predict(in, 1, 3, score));  // no logits computed
    in.logits[1] = lg;
    in.stride[1] = 4;
    CHECK(p->predict(in, 1, 3, score));
    // token 0: softmax(0, 0, ln 2) = (1/4, 1/4, 1/2); token 1: (3/5, 1/5, 1/5)
    CHECK(near(score[0], 0.25f + 0.6f) && near(score[1], 0.25f + 0.2f) && near(score[2], 0.5f + 0.2f));
}

static void test_random() {
    auto a = vis_moe_predictor_make(VIS_PRED_RANDOM, { 8, 8 }, 1, 7);
    auto b = vis_moe_predictor_make(VIS_PRED_RANDOM, { 8, 8 }, 1, 7);
    std::vector<int32_t> ids = { 1 };
    std::vector<float> sa, sb;
    CHECK(a->predict(input(0, 1, ids, 1), 1, 8, sa) && b->predict(input(0, 1, ids, 1), 1, 8, sb));
    CHECK(sa == sb && sa.size() == 8);  // seeded: a stress test repeats
    CHECK(vis_moe_predictor_make(VIS_PRED_OFF, { 8 }, 1) == nullptr);
}

static void test_policy_reads_ahead() {
    auto p = vis_moe_policy_lru(3);
    p->begin_pass();
    p->touch(0, 0);
    p->touch(1, 1);
    p->end_step();
    CHECK(p->slot_class(0) == vis_slot_class::EXPIRED);   // the step is over: nothing Required
    CHECK(p->victim() == 2);                               // empty first
    p->speculate(2, 1);                                    // read ahead for the next step
    CHECK(p->slot_class(2) == vis_slot_class::SPECULATIVE);
    CHECK(p->victim() == 0);                               // expired ones go before it
    p->end_step();                                         // not used within its horizon
    CHECK(p->slot_class(2) == vis_slot_class::EXPIRED);
    CHECK(p->victim() == 2);                               // ... and it goes first, before older expired ones
    // a read ahead that is used keeps the recency of its use
    p->speculate(2, 1);
    p->begin_pass();
    p->touch(2, 2);
    p->end_step();
    CHECK(p->victim() == 0);
}

// drive the measured choice through one probe: steps with reads ahead take on_us, without off_us
static void probe(vis_prefetch_ab & ab, int64_t on_us, int64_t off_us, int & n_on, int & n_off) {
    ab.begin(false);  // a prompt: the next decode step is not timed
    ab.end(999999);
    ab.begin(true);
    ab.end(999999);
    for (int i = 0; i < 4 * vis_prefetch_ab::EPOCH; ++i) {
        ab.begin(true);
        (ab.on() ? n_on : n_off)++;
        ab.end(ab.on() ? on_us : off_us);
    }
}

static void test_measured_choice() {
    vis_prefetch_ab ab;
    CHECK(ab.on() && ab.last().running_on == 1 && ab.last().probes == 0);
    int n_on = 0, n_off = 0;
    probe(ab, 900, 1000, n_on, n_off);
    CHECK(n_on == 2 * vis_prefetch_ab::EPOCH && n_off == 2 * vis_prefetch_ab::EPOCH);  // alternating epochs
    CHECK(ab.last().probes == 1 && ab.last().chose_on == 1 && ab.on());
    CHECK(ab.last().median_on_us == 900 && ab.last().median_off_us == 1000);
    // the run: RUN decode steps with the choice, prefill steps do not count, then a new probe
    for (int i = 0; i < vis_prefetch_ab::RUN; ++i) {
        ab.begin(true);
        CHECK(ab.on());
        ab.end(1);
    }
    n_on = n_off = 0;
    probe(ab, 990, 1000, n_on, n_off);  // 1 % faster: within the margin, off wins
    CHECK(ab.last().probes == 2 && ab.last().chose_on == 1 && !ab.on() && ab.last().running_on == 0);
    ab.begin(true);
    CHECK(!ab.on());
    ab.end(1);
}

int main() {
    test_measured_choice();
    test_top_and_recall();
    test_coact();
    test_freq();
    test_next_router();
    test_random();
    test_policy_reads_ahead();
    return vis_check_done("test-vis-predict");
}
