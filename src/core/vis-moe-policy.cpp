// vis-moe-policy.cpp - LRU, LFU-with-decay and adaptive-decay eviction with Required / Speculative / Expired
// slot classes (vis-moe-policy.h).
#include "vis-moe-policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace {

// the slot classes and the recency of every slot; subclasses order the Expired slots (`before`)
class ranked_policy : public vis_moe_policy {
public:
    explicit ranked_policy(int n_slots)
        : last_use(n_slots, 0), last_touch(n_slots, 0), spec_left(n_slots, 0), filled(n_slots, false), held(n_slots, false) {}

    void begin_step() override {}

    void begin_pass() override { pass_start = tick + 1; }

    void touch(int s, int /*e*/) override {
        last_use[s]  = ++tick;
        last_touch[s] = tick;
        spec_left[s] = 0;
        filled[s]    = true;
    }

    void speculate(int s, int horizon) override {
        last_use[s]  = ++tick;
        spec_left[s] = horizon > 0 ? horizon : 0;
        filled[s]    = true;
    }

    void end_step() override {
        pass_start = tick + 1;  // the step's passes are over: nothing is Required until the next pass starts
        for (size_t s = 0; s < spec_left.size(); ++s) {
            if (spec_left[s] > 0 && --spec_left[s] == 0) {
                last_use[s] = 0;  // filled ahead and never used within its horizon: the first Expired victim
            }
        }
    }

    void forget(int s) override {
        filled[s]    = false;
        spec_left[s] = 0;
    }

    void hold(int s, bool on) override { held[s] = on; }

    vis_slot_class slot_class(int s) const override {
        if (held[s]) {
            return vis_slot_class::REQUIRED;
        }
        if (!filled[s]) {
            return vis_slot_class::EMPTY;
        }
        if (last_touch[s] >= pass_start) {
            return vis_slot_class::REQUIRED;
        }
        return spec_left[s] > 0 ? vis_slot_class::SPECULATIVE : vis_slot_class::EXPIRED;
    }

    int victim() const override {
        int best = -1, best_spec = -1;
        for (int s = 0; s < (int) last_use.size(); ++s) {
            switch (slot_class(s)) {
                case vis_slot_class::EMPTY:
                    return s;  // the first empty slot
                case vis_slot_class::EXPIRED:
                    if (best < 0 || before(s, best)) {
                        best = s;
                    }
                    break;
                case vis_slot_class::SPECULATIVE:
                    if (best_spec < 0 || last_use[s] < last_use[best_spec]) {
                        best_spec = s;
                    }
                    break;
                case vis_slot_class::REQUIRED:
                    break;
            }
        }
        return best >= 0 ? best : best_spec;
    }

protected:
    // does Expired slot a go before Expired slot b?
    virtual bool before(int a, int b) const = 0;

    std::vector<uint64_t> last_use;   // tick of the last touch or fill ahead (recency); 0 = an unused read ahead
private:
    std::vector<uint64_t> last_touch; // tick of the last touch (a pass used it)
    std::vector<int>      spec_left;  // steps of protection left (Speculative)
    std::vector<bool>     filled;
    std::vector<bool>     held;       // filled in the background: never a victim
    uint64_t tick       = 0;
    uint64_t pass_start = 1;          // touches from this tick on belong to the running pass
};

class lru_policy final : public ranked_policy {
public:
    using ranked_policy::ranked_policy;
    const char * name() const override { return "lru"; }

protected:
    bool before(int a, int b) const override { return last_use[a] < last_use[b]; }
};

// per expert: the sum over its uses of decay^(steps since), kept as a sum of decay^-step (rescaled by 2^-200,
// exactly, before it could overflow); pyvis.runtime.policies.LFU computes the same doubles
struct decayed_counts {
    static constexpr int RESCALE_EXP = 200;

    decayed_counts(double decay, int n_expert) : decay(decay), score(n_expert, 0.0) {}

    void add(int e) {
        score[e] += inc;
        touched = true;
    }

    // a step ends: the clock advances if some expert was used in it
    void step() {
        if (!touched) {
            return;
        }
        touched = false;
        inc = inc / decay;
        if (inc > std::ldexp(1.0, RESCALE_EXP)) {
            inc = std::ldexp(inc, -RESCALE_EXP);
            for (double & x : score) {
                x = std::ldexp(x, -RESCALE_EXP);
            }
        }
    }

    double decay;
    std::vector<double> score;
    double inc     = 1.0;
    bool   touched = false;
};

// a cache of the same capacity that only counts its misses: the simulator's LayerCache serving one step's
// experts under LFU with one decay (pyvis.runtime.cachesim.LayerCache.serve, exactly)
struct ghost_cache {
    ghost_cache(int capacity, double decay, int n_expert)
        : capacity(capacity), counts(decay, n_expert), resident(n_expert, 0), last(n_expert, 0) {}

    int serve(const std::vector<int> & req) {
        std::vector<int> order;  // resident ones first, as the pass planner orders them
        for (int e : req) if (resident[e]) order.push_back(e);
        for (int e : req) if (!resident[e]) order.push_back(e);
        int loads = 0;
        std::vector<char> need(resident.size(), 0);
        for (size_t i = 0; i < order.size(); i += (size_t) capacity) {
            const size_t end = std::min(order.size(), i + (size_t) capacity);
            for (size_t j = i; j < end; ++j) need[order[j]] = 1;
            for (size_t j = i; j < end; ++j) if (resident[order[j]]) use(order[j]);
            for (size_t j = i; j < end; ++j) {
                const int e = order[j];
                if (resident[e]) {
                    continue;
                }
                loads++;
                if (n_resident >= capacity) {
                    int v = -1;
                    for (int r = 0; r < (int) resident.size(); ++r) {
                        if (resident[r] && !need[r] &&
                            (v < 0 || counts.score[r] < counts.score[v] ||
                             (counts.score[r] == counts.score[v] && last[r] < last[v]))) {
                            v = r;
                        }
                    }
                    resident[v] = 0;
                    n_resident--;
                }
                resident[e] = 1;
                n_resident++;
                use(e);
            }
            for (size_t j = i; j < end; ++j) need[order[j]] = 0;
        }
        counts.step();
        return loads;
    }

    void use(int e) {
        last[e] = ++tick;
        counts.add(e);
    }

    int capacity;
    decayed_counts counts;
    std::vector<char> resident;
    std::vector<uint64_t> last;
    int n_resident = 0;
    uint64_t tick  = 0;
};

// LFU with decay (one rule), or set dueling between decays (lfu-adapt: one rule per decay, each with a ghost
// cache; the real cache evicts by the rule whose ghost missed least lately)
class lfu_policy final : public ranked_policy {
public:
    static constexpr double DECAY       = 0.95;  // pyvis.runtime.policies.LFU_DECAY
    static constexpr double ADAPT_FAST  = 0.5;   // pyvis.runtime.policies.AdaptiveLFU: decays (0.5, 0.95)
    static constexpr double ADAPT_FADE  = 0.97;  // ... and the fading of the ghosts' misses per step

    lfu_policy(int n_slots, int n_expert, bool adaptive)
        : ranked_policy(n_slots), expert_in(n_slots, -1), in_step(n_expert, 0) {
        const std::vector<double> decays = adaptive ? std::vector<double>{ ADAPT_FAST, DECAY } : std::vector<double>{ DECAY };
        for (double d : decays) {
            rules.emplace_back(d, n_expert);
            if (adaptive) {
                ghosts.emplace_back(n_slots, d, n_expert);
            }
        }
        missed.assign(rules.size(), 0.0);
        best = (int) rules.size() - 1;  // no misses yet: ties go to the slowest decay
    }

    const char * name() const override { return ghosts.empty() ? "lfu" : "lfu-adapt"; }

    void begin_step() override {
        // the last step is over (a ubatch without a touch, streamed or the first, advances nothing)
        for (auto & r : rules) {
            r.step();
        }
        if (!step_experts.empty()) {
            for (size_t i = 0; i < ghosts.size(); ++i) {
                missed[i] = missed[i] * ADAPT_FADE + ghosts[i].serve(step_experts);
            }
            for (int e : step_experts) {
                in_step[e] = 0;
            }
            step_experts.clear();
        }
        best = 0;
        for (size_t i = 1; i < rules.size(); ++i) {
            if (missed[i] <= missed[best]) {
                best = (int) i;  // ties to the later (slower) decay
            }
        }
    }

    void touch(int s, int e) override {
        ranked_policy::touch(s, e);
        if (e < 0 || e >= (int) in_step.size()) {
            throw std::out_of_range("vis-moe: lfu policy touched with expert " + std::to_string(e) + " (planner bug)");
        }
        expert_in[s] = e;
        for (auto & r : rules) {
            r.add(e);
        }
        if (!ghosts.empty() && !in_step[e]) {
            in_step[e] = 1;
            step_experts.push_back(e);
        }
    }

    void forget(int s) override {
        ranked_policy::forget(s);
        expert_in[s] = -1;
    }

protected:
    bool before(int a, int b) const override {
        if ((last_use[a] == 0) != (last_use[b] == 0)) {
            return last_use[a] == 0;  // an unused read ahead goes first, as under LRU
        }
        const double sa = key(a), sb = key(b);
        return sa != sb ? sa < sb : last_use[a] < last_use[b];
    }

private:
    double key(int s) const { return expert_in[s] >= 0 ? rules[best].score[expert_in[s]] : 0.0; }

    std::vector<decayed_counts> rules;
    std::vector<ghost_cache>    ghosts;       // lfu-adapt: one per rule
    std::vector<double>         missed;       // per rule: its ghost's misses, fading
    int                         best = 0;     // the rule the victims follow
    std::vector<int>            expert_in;    // per slot: the expert its last touch named, -1 if none
    std::vector<int>            step_experts; // lfu-adapt: the experts used in this step, first use first
    std::vector<char>           in_step;
};

} // namespace

std::unique_ptr<vis_moe_policy> vis_moe_policy_lru(int n_slots) {
    return std::make_unique<lru_policy>(n_slots);
}

std::unique_ptr<vis_moe_policy> vis_moe_policy_lfu(int n_slots, int n_expert, bool adaptive) {
    return std::make_unique<lfu_policy>(n_slots, n_expert, adaptive);
}

std::unique_ptr<vis_moe_policy> vis_moe_policy_make(int32_t kind, int n_slots, int n_expert) {
    switch (kind) {
        case VIS_POLICY_LRU: return vis_moe_policy_lru(n_slots);
        case VIS_POLICY_LFU: return vis_moe_policy_lfu(n_slots, n_expert, false);
        case VIS_POLICY_LFU_ADAPT: return vis_moe_policy_lfu(n_slots, n_expert, true);
        default: throw std::invalid_argument("vis-moe: unknown eviction policy " + std::to_string(kind));
    }
}
