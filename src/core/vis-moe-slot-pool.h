// vis-moe-slot-pool.h - one slot pool: which expert each slot of a set of slabs holds, and its eviction policy
// (vis-moe-policy.h).  A managed layer has one for its full-precision slabs (vis_moe_layer::slots) and, with
// --moe-precision, one for its shadow slabs (vis_shadow_slots::pool).  The expert <-> slot maps are private: this
// class is the only writer of a slot table, through the verbs below; everyone else looks up.
//
// A slot is empty, holds a resident expert, or is being filled in the background (reserve .. settle / release):
// then expert_of(s) names the expert on its way while slot_of(e) stays -1, so no id points at the slot meanwhile,
// and the policy holds the slot (never a victim).
#pragma once

#include "vis-moe-policy.h"

#include "ggml.h"

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

class vis_slot_pool {
public:
    // n_slots empty slots for experts 0..n_expert-1, evicted by `policy`
    void init(int n_expert, int n_slots, std::unique_ptr<vis_moe_policy> policy);

    int  n_slots() const { return (int) expert_of_.size(); }
    // the slot holding e, -1 unless e is resident (an expert still being filled is not)
    int  slot_of(int e) const { return slot_of_[e]; }
    bool resident(int e) const { return slot_of_[e] >= 0; }
    // the expert in s (or on its way into it), -1 if s is empty
    int  expert_of(int s) const { return expert_of_[s]; }
    // is e on its way into some slot (reserve'd, not settled)?
    bool filling(int e) const;

    vis_moe_policy &       policy()       { return *policy_; }
    const vis_moe_policy & policy() const { return *policy_; }

    // s emptied (the policy forgets it); the expert it held, -1 if it was empty (then nothing changes)
    int  evict(int s);
    // e resident in the empty slot s
    void place(int e, int s);
    // s (empty) is being filled with e in the background: held by the policy until settle or release
    void reserve(int e, int s);
    // the fill of s landed: its expert resident, the hold released
    void settle(int s);
    // the fill of s failed or was cancelled: s empty, the hold released, forgotten by the policy
    void release(int s);
    // every slot emptied and forgotten: the slab memory is about to be lent or overwritten (vis-moe-lend.cpp)
    void forget_all();

    // the slots a pass may use are 0 .. n_active() - 1 (n_slots() unless limited; the online controller,
    // docs/planning.md#online-controller).  The passes are planned in chunks of n_active().
    int  n_active() const { return active_ < 0 ? n_slots() : active_; }
    // use at most n slots (1 <= n <= n_slots()): the experts in slots n.. are evicted and those slots held out of the
    // policy (never a victim); slots below n held out before are given back, empty.  The caller collected the
    // background reads first (no slot is being filled).  Returns the slots emptied, whose memory may be released.
    std::vector<int> limit(int n);

private:
    // s emptied, whatever it held or was being filled with, and forgotten by the policy
    void empty_(int s);

    std::vector<int32_t> slot_of_;    // expert -> slot, -1 if not resident
    std::vector<int32_t> expert_of_;  // slot -> expert, -1 if empty
    std::unique_ptr<vis_moe_policy> policy_;
    int active_ = -1;                 // limit(n): n; -1 never limited
};

struct vis_shadow_tensor;

// the shadow slots of a managed layer (docs/precision.md, --moe-precision): the second slot pool, whose slabs hold
// low-bit shadow experts (the --moe-shadow sidecar, vis-moe-shadow.h); the shadow passes that run from them are in
// vis-moe-shadow-slots.h
struct vis_shadow_slots {
    int     n_slots      = 0;      // 0: the layer serves nothing from shadows
    int64_t expert_bytes = 0;      // bytes of one shadow expert (all its tensors)
    bool    host_write   = false;  // the slabs are host memory the compute thread writes directly
    std::array<ggml_tensor *, 4>             slab = {};  // [ne0, ne1, n_slots (+ staging)] of the shadow type
    std::array<const vis_shadow_tensor *, 4> src  = {};  // the sidecar's tensors, in VIS_T_* order
    vis_slot_pool pool;              // which shadow slot holds which expert, and who is evicted (vis-moe-slot-pool.h)
    // what the running ubatch serves from them: the layer's ubatch plan (shadow_serve, shadow_passes)

    bool on() const { return n_slots > 0; }
};
