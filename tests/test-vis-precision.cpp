// test-vis-precision: the precision policy (src/features/vis-moe-precision.h) on small cases computed by hand, its stall
// controller, and the --moe-precision / --moe-prec-* / --moe-shadow-slots settings.
//   - vision: only experts no text token routes, only in a ubatch whose image share reaches the threshold;
//   - gate: only in decode steps, only experts whose largest gate weight is below the threshold;
//   - all: every miss; resident experts never; off: nothing;
//   - the share: the eligible misses with the lowest gate weight first;
//   - the controller: +STEP above the target, halved at or below it, 0 under 1/64, switches counted.
#include "vis-check.h"
#include "llama-vis.h"
#include "vis-moe-precision.h"

#include <cmath>
#include <cstring>
#include <vector>

struct decision {
    std::vector<uint8_t> serve;
    llama_vis_moe_prec_stats st = {};
    int n = 0;
};

// n_tokens tokens of k experts each, weights [n_tokens][k]; image: per token (empty: all text)
static decision run(const vis_prec_rule & rule, int n_expert, const std::vector<int> & res, const std::vector<int32_t> & ids,
                    const std::vector<float> & w, int k, const std::vector<uint8_t> & image = {}, bool decode = false) {
    decision d;
    std::vector<uint8_t> resident(n_expert, 0);
    for (int e : res) {
        resident[e] = 1;
    }
    vis_prec_input in;
    in.ids = ids.data();
    in.weights = w.data();
    in.w_rank = 1;
    in.w_tok = k;
    in.k = k;
    in.n_tokens = (int64_t) ids.size() / k;
    in.image = image.empty() ? nullptr : image.data();
    in.decode = decode;
    d.n = vis_prec_decide(rule, n_expert, resident, in, d.serve, d.st);
    return d;
}

static std::vector<int> served(const decision & d) {
    std::vector<int> out;
    for (size_t e = 0; e < d.serve.size(); ++e) {
        if (d.serve[e]) {
            out.push_back((int) e);
        }
    }
    return out;
}

static void test_vision() {
    vis_prec_rule r;
    r.mode = VIS_PREC_VISION;
    r.vision = 0.5;
    // 4 tokens x 2 experts; tokens 0..2 image, token 3 text; experts 0..5, 1 resident
    const std::vector<int32_t> ids = { 0, 1, 2, 3, 1, 4, 5, 2 };
    const std::vector<float>   w   = { .6f, .4f, .7f, .3f, .5f, .5f, .9f, .1f };
    const std::vector<uint8_t> img = { 1, 1, 1, 0 };
    decision d = run(r, 8, { 1 }, ids, w, 2, img);
    // 0, 3, 4: image only and missing; 1 resident; 2 and 5: routed by the text token
    CHECK((served(d) == std::vector<int>{ 0, 3, 4 }));
    CHECK(d.n == 3 && d.st.n_eligible == 3 && d.st.n_shadow == 3 && d.st.n_vision_ubatches == 1);
    // image share 3/4 below a threshold of 0.8: not vision-dominated, nothing
    r.vision = 0.8;
    d = run(r, 8, { 1 }, ids, w, 2, img);
    CHECK(d.n == 0 && d.st.n_eligible == 0 && d.st.n_vision_ubatches == 0);
    // a text-only ubatch, whatever the threshold (0 included)
    r.vision = 0;
    d = run(r, 8, {}, ids, w, 2);
    CHECK(d.n == 0 && d.st.n_vision_ubatches == 0);
    // an all-image ubatch: every missing expert
    r.vision = 1;
    d = run(r, 8, { 2 }, ids, w, 2, { 1, 1, 1, 1 });
    CHECK((served(d) == std::vector<int>{ 0, 1, 3, 4, 5 }));
    // vision mode ignores the gate rule in decode steps
    d = run(r, 8, {}, { 0, 1 }, { .05f, .95f }, 2, {}, true);
    CHECK(d.n == 0);
}

static void test_gate() {
    vis_prec_rule r;
    r.mode = VIS_PREC_GATE;
    r.gate = 0.2;
    // decode step of 2 sequences (2 tokens x 3 experts)
    const std::vector<int32_t> ids = { 0, 1, 2, 2, 3, 4 };
    const std::vector<float>   w   = { .7f, .15f, .15f, .5f, .3f, .19f };
    decision d = run(r, 6, {}, ids, w, 3, {}, true);
    // 1 (0.15) and 4 (0.19); 2 is 0.15 for token 0 but 0.5 for token 1: its largest weight decides
    CHECK((served(d) == std::vector<int>{ 1, 4 }));
    CHECK(d.st.n_eligible == 2 && d.st.n_shadow == 2);
    // resident: never
    d = run(r, 6, { 1 }, ids, w, 3, {}, true);
    CHECK((served(d) == std::vector<int>{ 4 }));
    // prefill: never
    d = run(r, 6, {}, ids, w, 3, {}, false);
    CHECK(d.n == 0 && d.st.n_eligible == 0);
    // the threshold is strict: 0.19 < 0.19 is false
    r.gate = 0.19f;
    d = run(r, 6, {}, ids, w, 3, {}, true);
    CHECK((served(d) == std::vector<int>{ 1 }));
    // a non-finite weight is never below the threshold (and does not count in the token's total)
    d = run(r, 6, {}, { 0, 1, 2 }, { NAN, .01f, .99f }, 3, {}, true);
    CHECK((served(d) == std::vector<int>{ 1 }));
    // the share, not the weight: scaling a token's weights (deepseek2's routed scale) changes nothing
    d = run(r, 6, {}, ids, { 2.8f, .6f, .6f, 2.0f, 1.2f, .76f }, 3, {}, true);
    CHECK((served(d) == std::vector<int>{ 1 }));  // 1: .15; 4: .76 / 3.96 = .192 is not below .19
}

static void test_all_off_auto_and_share() {
    const std::vector<int32_t> ids = { 0, 1, 2, 3, 4, 5 };
    // shares: token 0 (sum 1): .5 .1 .4; token 1 (sum .5): .9 .04 .06
    const std::vector<float>   w   = { .5f, .1f, .4f, .45f, .02f, .03f };
    vis_prec_rule r;
    r.mode = VIS_PREC_ALL;
    decision d = run(r, 8, { 5 }, ids, w, 3);
    CHECK((served(d) == std::vector<int>{ 0, 1, 2, 3, 4 }));
    r.mode = VIS_PREC_OFF;
    d = run(r, 8, {}, ids, w, 3, {}, true);
    CHECK(d.n == 0 && d.st.n_eligible == 0);
    // the share: ceil(share * eligible), lowest gate-weight share first: 4 (.04), 5 (.06), 1 (.1), 2 (.4), 0, 3
    r.mode = VIS_PREC_ALL;
    r.share = 0.5;
    d = run(r, 8, {}, ids, w, 3);
    CHECK((served(d) == std::vector<int>{ 1, 4, 5 }) && d.st.n_eligible == 6 && d.st.n_shadow == 3);
    r.share = 0.2;  // ceil(1.2) = 2
    d = run(r, 8, {}, ids, w, 3);
    CHECK((served(d) == std::vector<int>{ 4, 5 }));
    r.share = 0;
    d = run(r, 8, {}, ids, w, 3);
    CHECK(d.n == 0 && d.st.n_eligible == 6);
    // auto: vision or gate
    r.mode = VIS_PREC_AUTO;
    r.share = 1;
    r.gate = 0.07;
    d = run(r, 8, {}, ids, w, 3, {}, true);  // decode, text: the gate rule alone
    CHECK((served(d) == std::vector<int>{ 4, 5 }));
    d = run(r, 8, {}, ids, w, 3, { 1, 0 }, false);  // prefill, image share 1/2 >= 0.5: token 0's experts
    CHECK((served(d) == std::vector<int>{ 0, 1, 2 }));
}

static void test_controller() {
    vis_prec_controller c(0.25);
    CHECK(c.share() == 1 && c.n_switches() == 0);
    c.update(10, 100);  // 0.1 <= 0.25: halve
    CHECK(c.share() == 0.5 && c.n_switches() == 1);
    c.update(50, 100);  // 0.5 > 0.25: + STEP
    CHECK(c.share() == 0.5 + vis_prec_controller::STEP && c.n_switches() == 2);
    c.update(25, 100);  // at the target: halve
    CHECK(c.share() == (0.5 + vis_prec_controller::STEP) / 2);
    for (int i = 0; i < 10; ++i) {
        c.update(0, 100);
    }
    CHECK(c.share() == 0);  // below 1/64: zero, and no more switches while it stays there
    const int64_t sw = c.n_switches();
    c.update(0, 100);
    CHECK(c.n_switches() == sw);
    for (int i = 0; i < 20; ++i) {
        c.update(90, 100);
    }
    CHECK(c.share() == 1);  // capped
    vis_prec_controller off(0);  // target 0: never moves
    off.update(100, 100);
    off.update(0, 100);
    CHECK(off.share() == 1 && off.n_switches() == 0);
    c.update(5, 0);  // no time measured: no change
    CHECK(c.share() == 1);
}

static void test_settings() {
    CHECK(llama_vis_moe_thread_apply("--moe-precision", "vision") == 0);
    CHECK(llama_vis_moe_thread_apply("--moe-precision", "sometimes") != 0);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-precision: expected off, vision, gate, all or auto") != nullptr);
    CHECK(llama_vis_moe_thread_apply("--moe-prec-gate", "1.5") != 0);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-prec-gate") != nullptr);
    CHECK(llama_vis_moe_thread_apply("--moe-prec-vision", "-0.1") != 0);
    CHECK(llama_vis_moe_thread_apply("--moe-prec-target", "nan") != 0);
    CHECK(llama_vis_moe_thread_apply("--moe-prec-refetch", "maybe") != 0);
    CHECK(llama_vis_moe_thread_apply("--moe-shadow-slots", "0") != 0);
    CHECK(llama_vis_moe_thread_apply("--moe-shadow-slots", "auto") == 0);
    CHECK(llama_vis_moe_thread_apply("--moe-shadow-slots", "12") == 0);
    CHECK(llama_vis_moe_thread_apply("--moe-precision", "off") == 0);
    llama_vis_moe_set_thread_params(nullptr, nullptr);
}

int main() {
    test_vision();
    test_gate();
    test_all_off_auto_and_share();
    test_controller();
    test_settings();
    return vis_check_done("test-vis-precision");
}
