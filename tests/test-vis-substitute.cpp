// test-vis-substitute: the substitution step (src/features/vis-moe-substitute.h) on small cases computed by hand,
// and the --moe-sub* settings.
//   - TAE and margin of a token's gate weights;
//   - router: the resident expert with the highest score the token does not already run;
//   - buddy: the first resident buddy, never the token's own experts;
//   - gates: tau, margin, beta, budget (lowest share first), weight share, prefill;
//   - a missing expert some pair still needs is loaded for every pair ("needed anyway");
//   - drop: only missing pairs below drop_share / k, onto an expert the token runs, weights zeroed (renorm);
//   - no token ever runs the same expert twice; stats add up.
#include "vis-check.h"
#include "llama-vis.h"
#include "vis-moe-policy.h"
#include "vis-moe-substitute.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>


// one decision on n_tokens tokens of k experts, n_expert experts of which `res` are resident
struct decision {
    std::vector<int32_t> exec;
    std::vector<uint8_t> outcome;
    std::vector<int32_t> background;
    llama_vis_moe_sub_stats st = {};
    bool any = false;
};

static decision run(const vis_sub_rule & rule, int n_expert, const std::vector<int> & res, const std::vector<int32_t> & ids,
                    const std::vector<float> & w, int k, const std::vector<float> & scores = {}, bool decode = true,
                    bool prefill = false) {
    decision d;
    std::vector<uint8_t> resident(n_expert, 0);
    for (int e : res) {
        resident[e] = 1;
    }
    vis_sub_input in;
    in.ids = ids.data();
    in.weights = w.data();
    in.w_tok = k;
    in.w_rank = 1;
    in.scores = scores.empty() ? nullptr : scores.data();
    in.s_tok = n_expert;
    in.n_tokens = (int64_t) ids.size() / k;
    in.k = k;
    in.decode = decode;
    in.prefill_allowed = prefill;
    d.exec.resize(ids.size());
    d.outcome.resize(ids.size());
    d.any = vis_sub_decide(rule, n_expert, resident, in, d.exec.data(), d.outcome.data(), d.background, d.st);
    // invariant: a token never runs an expert twice with a weight (a dropped pair runs one with weight 0)
    for (size_t t = 0; t < ids.size() / k; ++t) {
        std::set<int> seen;
        int kept = 0;
        for (size_t j = t * k; j < (t + 1) * k; ++j) {
            if (d.outcome[j] != LLAMA_VIS_SUB_DROPPED) {
                seen.insert(d.exec[j]);
                kept++;
            }
        }
        CHECK((int) seen.size() == kept && kept > 0);
    }
    int64_t sum = 0;
    for (int i = 0; i < LLAMA_VIS_SUB_N_OUTCOMES; ++i) {
        sum += d.st.outcomes[i];
    }
    CHECK(sum == d.st.n_missing);
    return d;
}

static void test_tae() {
    const float uni[4] = { 0.25f, 0.25f, 0.25f, 0.25f };
    double m = -1;
    CHECK(std::fabs(vis_sub_tae(uni, 1, 4, &m) - 1.0) < 1e-12 && std::fabs(m) < 1e-12);
    // p = (0.5, 0.5, 0, 0): H = ln 2, TAE = ln 2 / ln 4 = 0.5, margin 0
    const float half[4] = { 1.0f, 1.0f, 0.0f, 0.0f };
    CHECK(std::fabs(vis_sub_tae(half, 1, 4, &m) - 0.5) < 1e-12 && std::fabs(m) < 1e-12);
    // p = (0.7, 0.3): H = -(0.7 ln 0.7 + 0.3 ln 0.3) = 0.6108643, TAE = H / ln 2 = 0.8812909, margin 0.4
    const float two[2] = { 0.7f, 0.3f };
    CHECK(std::fabs(vis_sub_tae(two, 1, 2, &m) - 0.8812908992306927) < 1e-6 && std::fabs(m - 0.4) < 1e-6);
    // strided (rank stride 2) and scaled weights give the same
    const float strided[4] = { 7.0f, -1.0f, 3.0f, -1.0f };
    CHECK(std::fabs(vis_sub_tae(strided, 2, 2, &m) - 0.8812908992306927) < 1e-6);
    // k = 1: TAE 0, margin 1; weights that do not sum to a positive value: -1
    const float zero[2] = { 0.0f, 0.0f };
    CHECK(vis_sub_tae(two, 1, 1, &m) == 0.0 && m == 1.0);
    CHECK(vis_sub_tae(zero, 1, 2, &m) == -1.0);
}

static void test_router() {
    vis_sub_rule r;  // router, no gates, budget 1
    // 6 experts, resident {0, 1, 2}; one token routes (3, 0) with weights (0.6, 0.4)
    // scores: 5 > 2 > 1 among the residents not routed: expert 2 scores 0.9, expert 1 scores 0.8
    const std::vector<float> sc = { 0.1f, 0.8f, 0.9f, 0.95f, 0.0f, 0.0f };
    decision d = run(r, 6, { 0, 1, 2 }, { 3, 0 }, { 0.6f, 0.4f }, 2, sc);
    CHECK(d.any);
    CHECK(d.exec[0] == 2 && d.exec[1] == 0);       // 3 -> 2 (highest resident score not routed), 0 stays
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_SUBSTITUTED && d.outcome[1] == LLAMA_VIS_SUB_RESIDENT);
    CHECK(d.background.size() == 1 && d.background[0] == 3);
    CHECK(d.st.n_missing == 1 && d.st.outcomes[LLAMA_VIS_SUB_SUBSTITUTED] == 1 && d.st.n_tokens_substituted == 1);

    // the stand-in is never one of the token's experts: the token routes (3, 2); 2 is resident and scores
    // highest, so 3 gets 1
    d = run(r, 6, { 0, 1, 2 }, { 3, 2 }, { 0.5f, 0.5f }, 2, sc);
    CHECK(d.exec[0] == 1 && d.exec[1] == 2);

    // budget 1, two missing experts: the one with the lower share goes first; the other is loaded
    // token routes (4, 3, 0) weights (0.5, 0.2, 0.3): 3 (0.2) gets a stand-in, 4 is blocked by the budget
    d = run(r, 6, { 0, 1, 2 }, { 4, 3, 0 }, { 0.5f, 0.2f, 0.3f }, 3, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED && d.exec[1] == 2);
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_BLOCKED_BUDGET && d.exec[0] == 4);
    CHECK(d.background.size() == 1 && d.background[0] == 3);
    // budget 2: both, the second stand-in is the next best resident (1), never 2 twice
    r.budget = 2;
    d = run(r, 6, { 0, 1, 2 }, { 4, 3, 0 }, { 0.5f, 0.2f, 0.3f }, 3, sc);
    CHECK(d.exec[1] == 2 && d.exec[0] == 1 && d.exec[2] == 0);
    CHECK(d.st.outcomes[LLAMA_VIS_SUB_SUBSTITUTED] == 2 && d.st.n_tokens_substituted == 1);
    // no resident candidate left: residents {0} only, the token routes (0, 3)
    d = run(r, 6, { 0 }, { 0, 3 }, { 0.5f, 0.5f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_NO_CANDIDATE && !d.any && d.background.empty());
}

static void test_gates() {
    const std::vector<float> sc = { 0.1f, 0.8f, 0.9f, 0.95f, 0.0f, 0.0f };
    vis_sub_rule r;
    // TAE gate: weights (0.7, 0.3) have TAE 0.881; tau 0.9 blocks, tau 0.88 lets through
    r.tau = 0.9;
    decision d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.7f, 0.3f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_BLOCKED_TAE && d.exec[1] == 3 && !d.any);
    r.tau = 0.88;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.7f, 0.3f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED);
    // margin gate: weights (0.75, 0.25) (exact in binary) have margin 0.5: 0.5 blocks, 0.51 lets through
    r.tau = -1;
    r.margin = 0.5;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.75f, 0.25f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_BLOCKED_MARGIN);
    r.margin = 0.51;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.75f, 0.25f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED);
    // weight gate: share 0.25 is not below 0.25; it is below 0.26
    r.margin = -1;
    r.weight = 0.25;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.75f, 0.25f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_BLOCKED_WEIGHT);
    r.weight = 0.26;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.75f, 0.25f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED);
    // rank: only the token's lowest-ranked expert may be substituted; (3, 0) routes 3 first (rank 0)
    r.weight = 1;
    r.rank = 1;
    d = run(r, 6, { 0, 1, 2 }, { 3, 0 }, { 0.6f, 0.4f }, 2, sc);
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_BLOCKED_RANK && d.exec[0] == 3);
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.6f, 0.4f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED && d.exec[1] == 2);
    r.rank = 2;
    d = run(r, 6, { 0, 1, 2 }, { 3, 0 }, { 0.6f, 0.4f }, 2, sc);
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_SUBSTITUTED);
    r.rank = 0;
    // beta: two tokens route {0, 3, 4, 1}: 2 of 4 distinct experts missing (0.5); beta 0.49 blocks all, 0.5 not
    r.weight = 1;
    r.beta = 0.49;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.5f, 0.5f, 0.5f, 0.5f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_BLOCKED_BETA && d.outcome[2] == LLAMA_VIS_SUB_BLOCKED_BETA);
    CHECK(d.st.outcomes[LLAMA_VIS_SUB_BLOCKED_BETA] == 2);
    r.beta = 0.5;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.5f, 0.5f, 0.5f, 0.5f }, 2, sc);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED && d.outcome[2] == LLAMA_VIS_SUB_SUBSTITUTED);
    // prefill: not eligible unless allowed
    r.beta = 1;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.5f, 0.5f }, 2, sc, /*decode*/ false);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_NOT_ELIGIBLE && !d.any);
    d = run(r, 6, { 0, 1, 2 }, { 0, 3 }, { 0.5f, 0.5f }, 2, sc, false, /*prefill*/ true);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_SUBSTITUTED);
}

static void test_needed_anyway() {
    // two tokens miss expert 3; the first is blocked by tau (peaky), the second could substitute: 3 is loaded
    // for the first anyway, so the second runs it too and nothing is read in the background
    const std::vector<float> sc = { 0.1f, 0.8f, 0.9f, 0.95f, 0.0f, 0.0f,
                                    0.1f, 0.8f, 0.9f, 0.95f, 0.0f, 0.0f };
    vis_sub_rule r;
    r.tau = 0.5;
    decision d = run(r, 6, { 0, 1, 2 }, { 3, 0, 0, 3 }, { 0.99f, 0.01f, 0.5f, 0.5f }, 2, sc);
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_BLOCKED_TAE);
    CHECK(d.outcome[3] == LLAMA_VIS_SUB_NEEDED_ANYWAY && d.exec[3] == 3);
    CHECK(!d.any && d.background.empty());
}

static void test_buddy() {
    // buddies (k_max 3): expert 3 -> (4, 1, 2), expert 4 -> (3, -1, -1), expert 5 -> (5, 0, -1) (itself listed)
    std::vector<int32_t> buddies(6 * 3, -1);
    buddies[3 * 3 + 0] = 4; buddies[3 * 3 + 1] = 1; buddies[3 * 3 + 2] = 2;
    buddies[4 * 3 + 0] = 3;
    buddies[5 * 3 + 0] = 5; buddies[5 * 3 + 1] = 0;
    vis_sub_rule r;
    r.mode = VIS_SUB_BUDDY;
    r.buddies = buddies.data();
    r.k_max = 3;
    // resident {0, 1, 2}: 3's first buddy 4 is not resident, the next (1) is -- unless the token runs 1
    decision d = run(r, 6, { 0, 1, 2 }, { 3, 0 }, { 0.5f, 0.5f }, 2);
    CHECK(d.exec[0] == 1 && d.outcome[0] == LLAMA_VIS_SUB_SUBSTITUTED);
    d = run(r, 6, { 0, 1, 2 }, { 3, 1 }, { 0.5f, 0.5f }, 2);
    CHECK(d.exec[0] == 2);
    // 4's only buddy (3) is not resident: no candidate
    d = run(r, 6, { 0, 1, 2 }, { 4, 0 }, { 0.5f, 0.5f }, 2);
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_NO_CANDIDATE);
    // 5 lists itself first: skipped; 0 is the token's own expert: no candidate
    d = run(r, 6, { 0, 1, 2 }, { 5, 0 }, { 0.5f, 0.5f }, 2);
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_NO_CANDIDATE);
    d = run(r, 6, { 0, 1, 2 }, { 5, 1 }, { 0.5f, 0.5f }, 2);
    CHECK(d.exec[0] == 0);
}

// cache-aware dropping: a missing pair whose share is < drop_share / k is skipped (weight 0, run on a resident expert
// the token runs); resident pairs never, the budget does not count, a pair another token loads anyway is not dropped
static void test_drop() {
    vis_sub_rule r;
    r.mode = VIS_SUB_DROP;  // drop_share 0.5: shares < 0.5 / 4 = 0.125 at k = 4
    // residents {0, 1, 2}; the token routes (0, 3, 4, 1) with shares (0.5, 0.05, 0.3, 0.15)
    decision d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.5f, 0.05f, 0.3f, 0.15f }, 4);
    CHECK(d.any);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_DROPPED && d.exec[1] == 0);       // 3: dropped onto the token's 0
    CHECK(d.outcome[2] == LLAMA_VIS_SUB_BLOCKED_WEIGHT && d.exec[2] == 4); // 4: 0.3 >= 0.125, loaded
    CHECK(d.outcome[0] == LLAMA_VIS_SUB_RESIDENT && d.outcome[3] == LLAMA_VIS_SUB_RESIDENT);
    CHECK(d.background.size() == 1 && d.background[0] == 3);
    CHECK(d.st.outcomes[LLAMA_VIS_SUB_DROPPED] == 1 && d.st.n_tokens_substituted == 1 && d.st.n_missing == 2);
    // weights as given (not renormalised over k): the same shares from scaled weights
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 5.0f, 0.5f, 3.0f, 1.5f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_DROPPED);
    // a resident expert is never dropped, however small its share; the budget (1) does not limit drops
    d = run(r, 6, { 0, 1, 2 }, { 0, 1, 3, 4 }, { 0.8f, 0.01f, 0.1f, 0.09f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_RESIDENT && d.exec[1] == 1);
    CHECK(d.outcome[2] == LLAMA_VIS_SUB_DROPPED && d.outcome[3] == LLAMA_VIS_SUB_DROPPED);
    CHECK(d.exec[2] == 0 && d.exec[3] == 0);
    // share threshold: 0.125 itself is not below it; drop_share 0 drops nothing
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.375f, 0.125f, 0.375f, 0.125f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_BLOCKED_WEIGHT && !d.any);
    r.drop_share = 0;
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.5f, 0.05f, 0.3f, 0.15f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_BLOCKED_WEIGHT && !d.any && d.background.empty());
    r.drop_share = 1;  // below an even split: 0.3 >= 0.25 still kept
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.5f, 0.05f, 0.3f, 0.15f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_DROPPED && d.outcome[2] == LLAMA_VIS_SUB_BLOCKED_WEIGHT);
    r.drop_share = 0.5;
    // two tokens: the first would drop 3, the second needs it (share 0.6): loaded, the first runs it after all
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 1, 2, 3, 0, 1, 2 }, { 0.6f, 0.05f, 0.2f, 0.15f, 0.6f, 0.2f, 0.1f, 0.1f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_NEEDED_ANYWAY && d.exec[1] == 3 && !d.any && d.background.empty());
    // a token whose experts are all missing drops onto the first resident expert (weight 0)
    d = run(r, 6, { 5 }, { 0, 3, 4, 1 }, { 0.5f, 0.05f, 0.3f, 0.15f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_DROPPED && d.exec[1] == 5);
    // nothing resident: no candidate; prefill: not eligible
    d = run(r, 6, {}, { 0, 3, 4, 1 }, { 0.5f, 0.05f, 0.3f, 0.15f }, 4);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_NO_CANDIDATE && !d.any);
    d = run(r, 6, { 0, 1, 2 }, { 0, 3, 4, 1 }, { 0.5f, 0.05f, 0.3f, 0.15f }, 4, {}, false, false);
    CHECK(d.outcome[1] == LLAMA_VIS_SUB_NOT_ELIGIBLE && !d.any);

    // the weights: the dropped pair's set to 0; renorm scales the others back to the sum before the drop
    const uint8_t oc[4] = { 0, LLAMA_VIS_SUB_DROPPED, 0, 0 };
    float w[4] = { 0.5f, 0.05f, 0.3f, 0.15f };
    vis_sub_apply_drops(w, 4, 1, 1, 4, oc, false);
    CHECK(w[0] == 0.5f && w[1] == 0.0f && w[2] == 0.3f && w[3] == 0.15f);
    float v[4] = { 0.5f, 0.05f, 0.3f, 0.15f };
    vis_sub_apply_drops(v, 4, 1, 1, 4, oc, true);
    CHECK(v[1] == 0.0f && std::fabs(v[0] - 0.5f / 0.95f) < 1e-6 && std::fabs(v[0] + v[2] + v[3] - 1.0f) < 1e-6);
}

static void test_hold() {
    auto p = vis_moe_policy_lru(2);
    p->begin_pass();
    p->touch(0, 0);
    p->touch(1, 1);
    p->begin_pass();
    p->hold(0, true);                      // being filled in the background: never a victim
    CHECK(p->slot_class(0) == vis_slot_class::REQUIRED);
    CHECK(p->victim() == 1);
    p->touch(1, 1);
    CHECK(p->victim() == -1);
    p->hold(0, false);
    CHECK(p->victim() == 0);
}

static void test_settings() {
    CHECK(llama_vis_moe_cli_apply("--moe-substitute", "sometimes") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-substitute: expected off, router, buddy, drop or auto") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-drop-share", "1.5") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-sub-drop-share: expected a number in 0..1") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-renorm", "sometimes") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-mode", "turbo") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-mode: expected exact or fast, got 'turbo'") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-tae", "1.5") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-sub-tae") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-tae", "p101") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-tae", "p") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-tae", "0.5x") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-tae", "nan") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-tae", "p15") == 0);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-beta", "-0.1") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-sub-beta: expected a number in 0..1") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-budget", "0") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-budget", "65") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-budget", "2") == 0);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-margin", "off") == 0);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-margin", "2") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-weight", "") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-prefill", "maybe") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-profile", "") == -1);
    CHECK(llama_vis_moe_cli_apply("--moe-sub-rank", "-1") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-sub-rank: expected an integer in 0..64 (0 = any)") != nullptr);
}

int main() {
    test_tae();
    test_router();
    test_gates();
    test_needed_anyway();
    test_buddy();
    test_drop();
    test_hold();
    test_settings();
    return vis_check_done("test-vis-substitute");
}
