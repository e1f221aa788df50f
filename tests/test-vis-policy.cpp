// test-vis-policy: the eviction-policy interface (src/core/vis-moe-policy.h), its LRU and LFU,
// and the settings table (src/api/vis-moe-settings.cpp) through the C API.
//   - LRU picks the first empty slot, then the least recently touched slot;
//   - LFU picks the expert with the lowest decayed use count, ties to the least recent; counts outlive eviction
//     and decay once per step in which the pool was touched;
//   - lfu-adapt follows the decay whose ghost cache missed less;
//   - a slot touched by the running pass (Required) is never a victim;
//   - Speculative slots go after every Expired one, and expire after their horizon;
//   - strict parsing: flag values and thread overrides out of range are errors naming the flag.
#include "vis-check.h"
#include "llama-vis.h"
#include "vis-moe-policy.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>


static void test_lru() {
    auto p = vis_moe_policy_lru(4);
    p->begin_pass();
    CHECK(p->victim() == 0);               // all empty: the first
    for (int s : { 0, 1, 2, 3 }) {
        p->touch(s, s);
    }
    CHECK(p->victim() == -1);              // every slot Required by this pass
    p->begin_pass();
    CHECK(p->slot_class(2) == vis_slot_class::EXPIRED);
    p->touch(0, 0);                        // 0 is Required now; 1 is the least recent
    CHECK(p->slot_class(0) == vis_slot_class::REQUIRED);
    CHECK(p->victim() == 1);
    p->touch(1, 1);
    CHECK(p->victim() == 2);
    p->forget(3);                          // an empty slot beats any expired one
    CHECK(p->victim() == 3);
}

static void test_speculative() {
    auto p = vis_moe_policy_lru(3);
    p->begin_pass();
    p->touch(0, 0);
    p->touch(1, 1);
    p->speculate(2, 2);                    // prefetched, protected for 2 steps
    p->begin_pass();
    CHECK(p->slot_class(2) == vis_slot_class::SPECULATIVE);
    CHECK(p->victim() == 0);               // an expired slot (the least recent) before the speculative one
    p->touch(0, 0);
    p->touch(1, 1);
    CHECK(p->victim() == 2);               // only the speculative one is left: it goes before a Required one
    p->begin_pass();
    p->end_step();
    CHECK(p->slot_class(2) == vis_slot_class::SPECULATIVE);
    p->end_step();
    CHECK(p->slot_class(2) == vis_slot_class::EXPIRED);
    // a speculative slot the pass uses becomes Required
    p->speculate(1, 5);
    p->begin_pass();
    p->touch(1, 1);
    CHECK(p->slot_class(1) == vis_slot_class::REQUIRED);
}

// one step: a pass over the experts `es`, each already in slot `slot_of(e)`
static void step(vis_moe_policy & p, std::initializer_list<std::pair<int, int>> slot_expert) {
    p.begin_step();
    p.begin_pass();
    for (auto [s, e] : slot_expert) {
        p.touch(s, e);
    }
    p.end_step();
}

static void test_lfu() {
    auto p = vis_moe_policy_make(VIS_POLICY_LFU, 3, 8);
    CHECK(std::strcmp(p->name(), "lfu") == 0);
    step(*p, { { 0, 5 } });
    step(*p, { { 0, 5 }, { 1, 6 } });
    step(*p, { { 0, 5 }, { 2, 7 } });
    p->begin_step();
    p->begin_pass();
    CHECK(p->victim() == 1);            // 5 used three times, 6 once (before 7's once): 6 goes
    p->end_step();
    step(*p, { { 1, 6 } });             // 6: twice, the last just now; 7: once
    p->begin_step();
    p->begin_pass();
    CHECK(p->victim() == 2);            // 7 scores lowest ...
    auto lru = vis_moe_policy_make(VIS_POLICY_LRU, 3, 8);
    step(*lru, { { 0, 5 } });
    step(*lru, { { 0, 5 }, { 1, 6 } });
    step(*lru, { { 0, 5 }, { 2, 7 } });
    step(*lru, { { 1, 6 } });
    lru->begin_pass();
    CHECK(lru->victim() == 0);          // ... where LRU evicts 5, the least recent
    // the score belongs to the expert, not the slot: new expert 3 in slot 2 starts from its own (zero) count
    p->forget(2);
    p->touch(2, 3);
    p->end_step();
    p->begin_step();
    p->begin_pass();
    CHECK(p->victim() == 2);            // 3: once (a slot score would have 7's use too and lose to 6)
    // ties go to the least recent: two experts used once in the same step
    auto q = vis_moe_policy_make(VIS_POLICY_LFU, 2, 4);
    step(*q, { { 0, 1 }, { 1, 2 } });
    q->begin_step();
    q->begin_pass();
    CHECK(q->victim() == 0);
    // decay: expert 1 used three times, then 30 steps of expert 3 only, then expert 2 once: 0.95^-33 > 3 uses
    auto d = vis_moe_policy_make(VIS_POLICY_LFU, 3, 4);
    for (int i = 0; i < 3; ++i) {
        step(*d, { { 0, 1 } });
    }
    for (int i = 0; i < 30; ++i) {
        step(*d, { { 2, 3 } });
    }
    step(*d, { { 1, 2 } });
    d->begin_step();
    d->begin_pass();
    CHECK(d->victim() == 0);            // without decay 2 (once) would go
    // steps without a touch (a streamed ubatch) do not advance the clock: 1 keeps its lead over 2
    auto c = vis_moe_policy_make(VIS_POLICY_LFU, 2, 4);
    step(*c, { { 0, 1 } });
    step(*c, { { 0, 1 } });
    for (int i = 0; i < 50; ++i) {
        c->begin_step();
        c->end_step();
    }
    step(*c, { { 1, 2 } });
    c->begin_step();
    c->begin_pass();
    CHECK(c->victim() == 1);
    // 20000 steps (0.95^-20000 overflows a double): the rescaled scores still order by count
    auto r = vis_moe_policy_make(VIS_POLICY_LFU, 2, 4);
    for (int i = 0; i < 20000; ++i) {
        step(*r, { { 0, 1 }, { 1, i % 7 == 0 ? 2 : 3 } });
    }
    r->begin_step();
    r->begin_pass();
    CHECK(r->victim() == 1);            // slot 1 holds 2, used every 7th step; 1 every step
}

// one step of one expert through a pool, as the pass planner serves it: a hit is touched, a miss takes the victim
static int serve(vis_moe_policy & p, std::vector<int> & expert_of, int e) {
    p.begin_step();
    p.begin_pass();
    int miss = 1;
    for (int s = 0; s < (int) expert_of.size(); ++s) {
        if (expert_of[s] == e) {
            p.touch(s, e);
            miss = 0;
        }
    }
    if (miss) {
        const int s = p.victim();
        if (expert_of[s] >= 0) {
            p.forget(s);
        }
        expert_of[s] = e;
        p.touch(s, e);
    }
    p.end_step();
    return miss;
}

// lfu-adapt: expert 1 used 10 times, then 2 and 3 alternate in 2 slots.  lfu keeps the stale 1 and misses the
// next 12 steps; the ghost of decay 0.5 (nearly LRU) misses less, so lfu-adapt follows it after 4 misses (the
// counts pyvis.runtime.policies replays: lru 2, lfu 12, lfu-adapt 4)
static void test_lfu_adapt() {
    auto misses = [](int32_t kind) {
        auto p = vis_moe_policy_make(kind, 2, 4);
        std::vector<int> expert_of(2, -1);
        for (int i = 0; i < 10; ++i) {
            serve(*p, expert_of, 1);
        }
        int n = 0;
        for (int i = 0; i < 40; ++i) {
            n += serve(*p, expert_of, 2 + i % 2);
        }
        return n;
    };
    CHECK(std::strcmp(vis_moe_policy_make(VIS_POLICY_LFU_ADAPT, 2, 4)->name(), "lfu-adapt") == 0);
    CHECK(misses(VIS_POLICY_LRU) == 2);
    CHECK(misses(VIS_POLICY_LFU) == 12);
    CHECK(misses(VIS_POLICY_LFU_ADAPT) == 4);
}

static void test_settings() {
    CHECK(llama_vis_moe_cli_apply("--moe-policy", "lfu") == 0);
    CHECK(llama_vis_moe_cli_apply("--moe-policy", "LFU") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-policy: expected lru, lfu or lfu-adapt, got 'LFU'") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-policy", "lfu-adapt") == 0);
    CHECK(llama_vis_moe_cli_apply("--moe-policy", "lru") == 0);

    CHECK(llama_vis_moe_cli_apply("--moe-slots", "8abc") == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-slots: expected an integer in 0..65536") != nullptr);
    CHECK(llama_vis_moe_cli_apply("--moe-slots", "12") == 0);
    CHECK(llama_vis_last_error()[0] == '\0');  // cleared by the call that succeeded
    CHECK(llama_vis_moe_get_params().n_slots == 12);
    CHECK(llama_vis_moe_cli_apply("--moe-frobnicate", "1") == -1);

    // a thread override shadows the process-wide values until it is dropped
    llama_vis_moe_params p = llama_vis_moe_get_params();
    p.n_slots = 3;
    CHECK(llama_vis_moe_set_thread_params(&p, nullptr) == 0);
    CHECK(llama_vis_moe_thread_params_active() == 1);
    CHECK(llama_vis_moe_get_params().n_slots == 3);
    p.n_slots = -5;
    CHECK(llama_vis_moe_set_thread_params(&p, nullptr) == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-slots must be in 0..65536") != nullptr);
    CHECK(llama_vis_moe_get_params().n_slots == 3);  // a refused override changes nothing
    CHECK(llama_vis_moe_set_thread_params(nullptr, nullptr) == 0);
    CHECK(llama_vis_moe_thread_params_active() == 0);
    CHECK(llama_vis_moe_get_params().n_slots == 12);

    llama_vis_moe_tier_params t = llama_vis_moe_get_tier_params();
    t.io_threads = 65;
    CHECK(llama_vis_moe_set_tier_params(&t) == -1);
    CHECK(std::strstr(llama_vis_last_error(), "--moe-io-threads must be in 1..64") != nullptr);

    // every row of the table has a name, a variable and help
    const int n = llama_vis_moe_n_flags();
    CHECK(n >= 13);
    for (int i = 0; i < n; ++i) {
        llama_vis_moe_flag f;
        CHECK(llama_vis_moe_get_flag(i, &f) == 0);
        CHECK(std::strncmp(f.name, "--moe-", 6) == 0 && std::strncmp(f.env, "VIS_MOE_", 8) == 0 && f.help && *f.help);
    }
    llama_vis_moe_flag f;
    CHECK(llama_vis_moe_get_flag(n, &f) == -1);

    // the one reserve estimate grows with the ubatch and has a runtime floor
    CHECK(llama_vis_moe_estimate_reserve(0, 0, 0, 0, 0) == (96ll << 20));
    CHECK(llama_vis_moe_estimate_reserve(512, 1000, 64, 8, 32) > llama_vis_moe_estimate_reserve(64, 1000, 64, 8, 32));
}

int main() {
    test_lru();
    test_speculative();
    test_lfu();
    test_lfu_adapt();
    test_settings();
    return vis_check_done("test-vis-policy");
}
