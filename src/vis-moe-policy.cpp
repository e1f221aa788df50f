// vis-moe-policy.cpp - LRU and LFU-with-decay eviction with Required / Speculative / Expired slot classes
// (vis-moe-policy.h).
#include "vis-moe-policy.h"

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

class lfu_policy final : public ranked_policy {
public:
    static constexpr double DECAY      = 0.95;    // pyvis.runtime.policies.LFU_DECAY
    static constexpr int    RESCALE_EXP = 200;    // scale by 2^-200 once the increment passes 2^200

    lfu_policy(int n_slots, int n_expert) : ranked_policy(n_slots), score(n_expert, 0.0), expert_in(n_slots, -1) {}

    const char * name() const override { return "lfu"; }

    void begin_step() override {
        if (!touched) {
            return;  // a ubatch without a touch (streamed, or the first) does not advance the clock
        }
        touched = false;
        inc = inc / DECAY;
        if (inc > std::ldexp(1.0, RESCALE_EXP)) {
            inc = std::ldexp(inc, -RESCALE_EXP);
            for (double & x : score) {
                x = std::ldexp(x, -RESCALE_EXP);
            }
        }
    }

    void touch(int s, int e) override {
        ranked_policy::touch(s, e);
        if (e < 0 || e >= (int) score.size()) {
            throw std::out_of_range("vis-moe: lfu policy touched with expert " + std::to_string(e) + " (planner bug)");
        }
        expert_in[s] = e;
        score[e] += inc;
        touched = true;
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
    double key(int s) const { return expert_in[s] >= 0 ? score[expert_in[s]] : 0.0; }

    std::vector<double> score;      // per expert: sum of inc at its touches (persistent)
    std::vector<int>    expert_in;  // per slot: the expert its last touch named, -1 if none
    double inc     = 1.0;           // DECAY^-steps (rescaled)
    bool   touched = false;         // some slot was touched since the last step began
};

} // namespace

std::unique_ptr<vis_moe_policy> vis_moe_policy_lru(int n_slots) {
    return std::make_unique<lru_policy>(n_slots);
}

std::unique_ptr<vis_moe_policy> vis_moe_policy_lfu(int n_slots, int n_expert) {
    return std::make_unique<lfu_policy>(n_slots, n_expert);
}

std::unique_ptr<vis_moe_policy> vis_moe_policy_make(int32_t kind, int n_slots, int n_expert) {
    switch (kind) {
        case VIS_POLICY_LRU: return vis_moe_policy_lru(n_slots);
        case VIS_POLICY_LFU: return vis_moe_policy_lfu(n_slots, n_expert);
        default: throw std::invalid_argument("vis-moe: unknown eviction policy " + std::to_string(kind));
    }
}
