// vis-moe-policy.h - who gets evicted: the eviction-policy interface of the slot
// pools and its implementations, LRU, LFU with decay and LFU with an adaptive decay (src/core/vis-moe-policy.cpp).
//
// The pass planner (vis-moe-passes.cpp) asks the layer's policy for a victim on
// every miss and tells it of every touch.  Slots carry VisMMOE's classes (§3.4.2):
//   Required     used by the running pass: never evicted by it
//   Speculative  filled ahead of need (prefetch), protected for a horizon of steps
//   Expired      everything else: evicted first
// A slot being filled in the background is held: Required until released.
// Prefetch and substitution change *who is evicted* through this interface, not by
// editing the planner.  The policies differ only in the order of the Expired slots;
// pyvis.runtime.policies replays each of them identically (tests/test_policy.py).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

enum class vis_slot_class : uint8_t { EMPTY, EXPIRED, SPECULATIVE, REQUIRED };

// VIS_MOE_POLICY / --moe-policy (docs/policies.md): which order the Expired slots of the full slot pools go in
enum vis_policy_kind : int32_t { VIS_POLICY_LRU = 0, VIS_POLICY_LFU, VIS_POLICY_LFU_ADAPT };

class vis_moe_policy {
public:
    virtual ~vis_moe_policy() = default;
    virtual const char * name() const = 0;

    // a ubatch starts (every ubatch, whatever else is on): the step clock of a policy that decays with time
    virtual void begin_step() = 0;
    // a pass starts: slots touched from now on are Required until the next pass starts
    virtual void begin_pass() = 0;
    // slot s, holding expert e, serves the running pass (a hit, or a miss just placed there): Required, most recent
    virtual void touch(int s, int e) = 0;
    // slot s was filled ahead of need; protected for `horizon` steps unless the running pass needs its space first
    virtual void speculate(int s, int horizon) = 0;
    // a ubatch finished (called when prefetch is on): no slot is Required any more; speculative horizons count
    // down, and a slot whose horizon ends without a touch becomes the first Expired victim (a read ahead that was
    // not used goes first)
    virtual void end_step() = 0;
    // slot s no longer holds an expert
    virtual void forget(int s) = 0;
    // slot s is being filled in the background (vis-moe-fetch.h): while held it is never a victim
    virtual void hold(int s, bool on) = 0;

    virtual vis_slot_class slot_class(int s) const = 0;
    // the slot a miss of the running pass goes to: an empty one, else an Expired one, else a Speculative one
    // (each by the policy's order); -1 when every slot is Required (a plan bug: passes never need more)
    virtual int victim() const = 0;
};

// Least recently used, with exact recency: one tick per touch, in the order of the touches (hits of a pass
// first, then its misses), as pyvis.runtime's cache simulator models it.
std::unique_ptr<vis_moe_policy> vis_moe_policy_lru(int n_slots);

// LFU with exponential decay: each of the layer's n_expert experts has a score, the sum over its touches of
// 0.95^(steps since), kept while it is not resident; the Expired slot whose expert scores lowest goes first,
// ties to the least recent.  A step is a ubatch in which the layer touched a slot.  Scores grow by 0.95^-step
// instead of decaying and are rescaled by 2^-200 (exactly) before they could overflow, so the simulator
// (pyvis.runtime.policies.LFU) computes the same doubles.  Speculative slots go in LRU order.
// adaptive (lfu-adapt): set dueling between decays 0.5 (nearly LRU) and 0.95: a ghost cache of the same size per
// decay replays the layer's own steps, and the victims follow the decay whose ghost missed least, its misses
// fading by 0.97 per step (pyvis.runtime.policies.AdaptiveLFU).
std::unique_ptr<vis_moe_policy> vis_moe_policy_lfu(int n_slots, int n_expert, bool adaptive = false);

// the policy of `kind` (vis_policy_kind) for a pool of n_slots over n_expert experts
std::unique_ptr<vis_moe_policy> vis_moe_policy_make(int32_t kind, int n_slots, int n_expert);
