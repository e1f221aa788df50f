// vis-moe-passes.cpp - pass planning and the slot table (vis-moe-passes.h).
#include "vis-moe-passes.h"
#include "vis-moe-context.h"
#include "vis-moe-transfer.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

int vis_moe_max_passes(int n_expert, int64_t n_pairs, int n_slots) {
    return std::max(1, (int) ((std::min<int64_t>(n_expert, n_pairs) + n_slots - 1) / n_slots));
}

int vis_moe_overlap_passes(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image) {
    if (vm.overlap <= 0 || image || n_pairs <= 0 || !L.cpu_passes || !L.deferred || !L.direct_write || !vm.io ||
        vis_moe_max_passes(L.n_expert, n_pairs, L.slots.n_active()) != 1) {
        return 0;
    }
    return (int) std::min<int64_t>(vm.overlap, std::min<int64_t>(n_pairs, L.n_expert));
}

int vis_moe_full_passes(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image) {
    const int n = vis_moe_max_passes(L.n_expert, n_pairs, L.slots.n_active()) + vis_moe_overlap_passes(vm, L, n_pairs, image);
    const int cap = image ? vm.image_pass_bound(L) : 0;
    return cap > 0 ? std::min(n, cap) : n;
}

int vis_moe_shadow_passes(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image) {
    if (!vm.precision || !L.shadow.on()) {
        return 0;
    }
    const int n = vis_moe_max_passes(L.n_expert, n_pairs, L.shadow.n_slots);
    if (image && vm.image_pass_bound(L) > 0) {
        // the capacity bounds the experts loaded to what the full passes hold: the shadows served are among them
        const int64_t most = (int64_t) vis_moe_full_passes(vm, L, n_pairs, image) * L.n_slots;
        return std::min<int>(n, (int) ((most + L.shadow.n_slots - 1) / L.shadow.n_slots));
    }
    return n;
}

bool vis_moe_streams(const vis_moe_context & vm, const vis_moe_layer & L, int64_t n_pairs, bool image) {
    if (vm.stream_passes <= 0 || !L.can_stream() || (image && vm.image_pass_bound(L) > 0)) {
        return false;
    }
    bool early = false;
    for (const auto & f : vm.features) {
        early = early || f->streams_early(vm, L, image);
    }
    return vis_moe_max_passes(L.n_expert, n_pairs, L.slots.n_active()) > (early ? 1 : vm.stream_passes);
}

void vis_moe_plan_passes(const vis_moe_layer & L, vis_ubatch_plan & plan, const int32_t * ids, int64_t n_pairs) {
    const uint8_t * skip = L.shadow.on() ? plan.shadow_serve.data() : nullptr;
    std::vector<int32_t> & pass_of = plan.pass_of;
    pass_of.assign(L.n_expert, -1);
    std::vector<int32_t> hits, misses;
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = ids[j];
        GGML_ASSERT(e >= 0 && e < L.n_expert);
        if (pass_of[e] == -1 && !(skip && skip[e])) {
            pass_of[e] = -2;  // seen
            (L.slots.resident(e) ? hits : misses).push_back(e);
        }
    }
    plan.passes.clear();
    std::vector<int32_t> order = hits;
    order.insert(order.end(), misses.begin(), misses.end());
    const size_t chunk = (size_t) L.slots.n_active();  // the online controller's limit, else every slot
    for (size_t i = 0; i < order.size(); i += chunk) {
        const size_t end = std::min(order.size(), i + chunk);
        plan.passes.emplace_back(order.begin() + i, order.begin() + end);
        for (size_t x = i; x < end; ++x) {
            pass_of[order[x]] = (int32_t) plan.passes.size() - 1;
        }
    }
}

void vis_moe_pass_ids(const vis_moe_layer & L, int p, const int32_t * ids, int64_t n_pairs, int32_t * out) {
    const std::vector<int32_t> & pass_of = L.ubatch_plan.pass_of;
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = ids[j];
        out[j] = pass_of[e] == p ? L.slots.slot_of(e) : L.foreign_id();
    }
    if (!L.cpu_passes && L.any_slab()) {
        vis_moe_distinct_foreign(out, n_pairs, L.ubatch_plan.n_used, (int32_t) L.any_slab()->ne[2], L.foreign_id());
    }
}

bool vis_moe_distinct_foreign(int32_t * out, int64_t n_pairs, int64_t k, int32_t n_ids, int32_t marker) {
    if (k <= 1 || n_ids < k || n_pairs % k != 0) {
        return k <= 1;  // one pair per token cannot repeat
    }
    std::vector<uint8_t> used((size_t) n_ids, 0);
    for (int64_t r = 0; r < n_pairs; r += k) {
        int32_t * row = out + r;
        bool any = false;
        for (int64_t i = 0; i < k; ++i) {
            if (row[i] != marker) {
                used[(size_t) row[i]] = 1;
            } else {
                any = true;
            }
        }
        int32_t c = n_ids - 1;
        for (int64_t i = 0; any && i < k; ++i) {
            if (row[i] == marker) {
                while (used[(size_t) c]) {
                    --c;  // n_ids >= k: a free id remains for every foreign pair
                }
                row[i] = c--;
            }
        }
        for (int64_t i = 0; i < k; ++i) {
            if (row[i] >= 0 && row[i] < n_ids) {
                used[(size_t) row[i]] = 0;
            }
        }
    }
    return true;
}

int vis_moe_staging_slots(bool cpu_only, int n_slots, int k) {
    return cpu_only ? 0 : std::max(1, k - n_slots);
}

void vis_moe_evict_slot(vis_moe_context & vm, vis_moe_layer & L, int il, int s) {
    const int old = L.slots.evict(s);
    if (old < 0) {
        return;
    }
    if (vm.host && vm.host_exclusive && L.deferred) {
        if (uint8_t * h = vm.host->insert(il, old)) {
            vis_moe_slab_read(L, s, h);
        }
    }
}

void vis_moe_run_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int p, const int32_t * ids, int64_t n_pairs,
                      int32_t * out) {
    const auto t0 = std::chrono::steady_clock::now();
    auto add_stall = [&]() {
        L.stats.load_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    };
    static const std::vector<int32_t> none;
    const vis_ubatch_plan & plan = L.ubatch_plan;
    const std::vector<int32_t> & experts = p < (int) plan.passes.size() ? plan.passes[p] : none;
    L.stats.n_passes++;
    L.slots.policy().begin_pass();

    // hits first: touched (Required) before any miss looks for a victim
    for (int e : experts) {
        const int s = L.slots.slot_of(e);
        if (s >= 0) {
            L.slots.policy().touch(s, e);
            L.stats.n_hits++;
        }
    }
    std::vector<std::pair<int, int>> misses;  // (expert, slot)
    for (int e : experts) {
        if (L.slots.resident(e)) {
            continue;
        }
        const int s = L.slots.policy().victim();
        GGML_ASSERT(s >= 0 && "vis-moe: a pass needs more experts than slots (plan bug)");
        vis_moe_evict_slot(vm, L, il, s);
        L.slots.place(e, s);
        L.slots.policy().touch(s, e);
        misses.emplace_back(e, s);
        L.stats.n_misses++;
        L.stats.bytes_loaded += L.expert_bytes;
    }
    L.stats.n_routed += (int64_t) experts.size();

    try {
        vis_moe_fill_slots(vm, L, il, misses);
    } catch (...) {
        // never leave a slot marked as holding an expert it does not hold
        for (const auto & [e, s] : misses) {
            L.slots.evict(s);
        }
        add_stall();
        throw;
    }

    vis_moe_pass_ids(L, p, ids, n_pairs, out);
    add_stall();
}
