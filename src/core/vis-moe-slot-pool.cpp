// vis-moe-slot-pool.cpp - one slot pool (vis-moe-slot-pool.h): the only writer of a slot table.
#include "vis-moe-slot-pool.h"

#include <algorithm>

void vis_slot_pool::init(int n_expert, int n_slots, std::unique_ptr<vis_moe_policy> policy) {
    slot_of_.assign(n_expert, -1);
    expert_of_.assign(n_slots, -1);
    policy_ = std::move(policy);
    active_ = -1;
}

bool vis_slot_pool::filling(int e) const {
    return slot_of_[e] < 0 && std::find(expert_of_.begin(), expert_of_.end(), e) != expert_of_.end();
}

int vis_slot_pool::evict(int s) {
    const int old = expert_of_[s];
    if (old < 0) {
        return -1;
    }
    slot_of_[old] = -1;
    expert_of_[s] = -1;
    policy_->forget(s);
    return old;
}

void vis_slot_pool::place(int e, int s) {
    expert_of_[s] = e;
    slot_of_[e]   = s;
}

void vis_slot_pool::reserve(int e, int s) {
    expert_of_[s] = e;  // slot_of_[e] stays -1 until settled
    policy_->hold(s, true);
}

void vis_slot_pool::settle(int s) {
    policy_->hold(s, false);
    slot_of_[expert_of_[s]] = s;
}

void vis_slot_pool::release(int s) {
    policy_->hold(s, false);
    expert_of_[s] = -1;
    policy_->forget(s);
}

void vis_slot_pool::empty_(int s) {
    if (expert_of_[s] >= 0) {
        slot_of_[expert_of_[s]] = -1;
        expert_of_[s] = -1;
    }
    policy_->forget(s);
}

void vis_slot_pool::forget_all() {
    for (int s = 0; s < n_slots(); ++s) {
        empty_(s);
    }
}

std::vector<int> vis_slot_pool::limit(int n) {
    const int was = n_active();
    std::vector<int> emptied;
    for (int s = n; s < was; ++s) {
        empty_(s);
        policy_->hold(s, true);
        emptied.push_back(s);
    }
    for (int s = was; s < n; ++s) {
        policy_->hold(s, false);  // back in use, empty (its pages read as zeros until refilled)
    }
    active_ = n;
    return emptied;
}
