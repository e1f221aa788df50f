// vis-moe-policy.cpp - LRU eviction with Required / Speculative / Expired slot classes (vis-moe-policy.h).
#include "vis-moe-policy.h"

namespace {

class lru_policy final : public vis_moe_policy {
public:
    explicit lru_policy(int n_slots)
        : last_use(n_slots, 0), last_touch(n_slots, 0), spec_left(n_slots, 0), filled(n_slots, false), held(n_slots, false) {}

    const char * name() const override { return "lru"; }

    void begin_pass() override { pass_start = tick + 1; }

    void touch(int s) override {
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
                    if (best < 0 || last_use[s] < last_use[best]) {
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

private:
    std::vector<uint64_t> last_use;   // tick of the last touch or fill ahead (recency)
    std::vector<uint64_t> last_touch; // tick of the last touch (a pass used it)
    std::vector<int>      spec_left;  // steps of protection left (Speculative)
    std::vector<bool>     filled;
    std::vector<bool>     held;       // filled in the background: never a victim
    uint64_t tick       = 0;
    uint64_t pass_start = 1;          // touches from this tick on belong to the running pass
};

} // namespace

std::unique_ptr<vis_moe_policy> vis_moe_policy_lru(int n_slots) {
    return std::make_unique<lru_policy>(n_slots);
}
