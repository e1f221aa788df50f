// vis-moe-capacity.cpp - entropy-weighted capacity, its place in pass 0 and its stats (vis-moe-capacity.h).
#include "vis-moe-capacity.h"
#include "vis-moe-context.h"
#include "vis-moe-modality.h"
#include "vis-moe-passes.h"
#include "vis-error.h"

#include "llama-context.h"
#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <utility>

bool vis_cap_decide(const vis_cap_rule & rule, int n_expert, const std::vector<uint8_t> & resident,
                    const vis_cap_input & in, int32_t * exec, uint8_t * dropped, llama_vis_moe_cap_stats & st) {
    const int64_t n_pairs = in.n_tokens * in.k;
    std::fill(dropped, dropped + n_pairs, 0);
    if (!in.image || in.n_tokens <= 0) {
        return false;
    }
    // 1-2: weights and the effective visual ratio
    double w_img = 0, w_all = 0;
    for (int64_t t = 0; t < in.n_tokens; ++t) {
        const double w = in.image[t] ? (double) in.tok_w[t] : 1.0;
        w_all += w;
        w_img += in.image[t] ? w : 0.0;
    }
    if (w_img <= 0 && w_all <= 0) {
        return false;
    }
    const double rv = w_all > 0 ? w_img / w_all : 0.0;
    const int cap = (int) std::max<long>(0, std::lround(rule.base * (1.0 + rule.rho * (rv - 0.5))));
    st.n_ubatches++;
    st.capacity += cap;
    st.rv_sum   += rv;
    // 4: loads of the missing experts only image tokens route
    std::vector<uint8_t> text(n_expert, 0), routed(n_expert, 0);
    std::vector<double>  load(n_expert, 0.0);
    for (int64_t t = 0; t < in.n_tokens; ++t) {
        for (int r = 0; r < in.k; ++r) {
            const int e = exec[t * in.k + r];
            if (e < 0 || e >= n_expert) {
                continue;
            }
            routed[e] = 1;
            if (in.image[t]) {
                load[e] += in.tok_w[t];
            } else {
                text[e] = 1;
            }
        }
    }
    std::vector<uint8_t> in_mem(n_expert, 0);  // in memory for this ubatch: resident, text-routed, within capacity
    std::vector<std::pair<double, int>> missing;
    for (int e = 0; e < n_expert; ++e) {
        in_mem[e] = resident[e] || text[e] ? 1 : 0;
        if (routed[e] && !resident[e] && !text[e]) {
            const double m = rule.bias ? rule.bias[e] : 0;
            missing.emplace_back(load[e] * (1.0 + rule.rho * m * (rv - 0.5)), e);
        }
    }
    std::stable_sort(missing.begin(), missing.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    st.n_missing += (int64_t) missing.size();
    const int64_t over0 = st.n_overflow;
    std::vector<uint8_t> over(n_expert, 0);
    int64_t loads = 0;  // loaded within capacity, then forced: at most rule.max_loads
    auto may_load = [&]() { return rule.max_loads < 0 || loads < rule.max_loads; };
    for (size_t i = 0; i < missing.size(); ++i) {
        if ((int) i < cap && may_load()) {
            loads++;
            in_mem[missing[i].second] = 1;
            st.n_loaded++;
        } else {
            over[missing[i].second] = 1;
            st.n_overflow++;
        }
    }
    if (st.n_overflow == over0) {
        return false;  // everything fits
    }
    // 5-6: reroute the overflow pairs, tokens of lowest weight first
    std::vector<int64_t> order(in.n_tokens);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        const float wa = in.image[a] ? in.tok_w[a] : 1.0f, wb = in.image[b] ? in.tok_w[b] : 1.0f;
        return wa < wb;
    });
    std::vector<uint8_t> forced(n_expert, 0);
    bool changed = false;
    for (int64_t t : order) {
        if (!in.image[t]) {
            continue;  // text tokens are never rerouted (and never route an overflow expert)
        }
        int32_t * row = exec + t * in.k;
        for (int r = 0; r < in.k; ++r) {
            const int e = row[r];
            if (e < 0 || e >= n_expert || !over[e] || forced[e]) {
                continue;
            }
            int best = -1;
            float best_s = -INFINITY;
            for (int c = 0; c < n_expert; ++c) {
                if (!in_mem[c] || std::find(row, row + in.k, c) != row + in.k) {
                    continue;
                }
                const float s = in.scores ? in.scores[t * in.s_tok + c] : 0.0f;
                if (best < 0 || s > best_s) {
                    best = c;
                    best_s = s;
                }
            }
            if (best >= 0) {
                row[r] = best;
                st.n_rerouted++;
                changed = true;
                continue;
            }
            // no expert in memory the token does not already run: drop the pair onto one it runs, weight 0
            int own = -1;
            for (int q = 0; q < in.k && own < 0; ++q) {
                own = q != r && row[q] >= 0 && row[q] < n_expert && in_mem[row[q]] ? row[q] : -1;
            }
            if (rule.drop && own >= 0) {
                row[r] = own;
                dropped[t * in.k + r] = 1;
                st.n_dropped++;
                changed = true;
            } else if (may_load() || own < 0) {
                // the expert is loaded after all, for every pair still on it (with a bound on loads, only when
                // nothing is in memory at all, which the bound's first pass always leaves room for)
                forced[e] = 1;
                in_mem[e] = 1;
                loads++;
                st.n_forced++;
            } else {
                row[r] = own;  // drop off but the loads are bounded: dropped all the same
                dropped[t * in.k + r] = 1;
                st.n_dropped++;
                changed = true;
            }
        }
    }
    return changed;
}

void vis_moe_capacity_plan(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                           const ggml_tensor * ids, const ggml_tensor * weights, const ggml_tensor * scores) {
    if (!vm.capacity || !vm.modality || !vm.modality->has_image()) {
        return;
    }
    const int k = (int) ids->ne[0];
    const int64_t n_tokens = ids->ne[1], n_pairs = n_tokens * k;
    const vis_cap_rule & cr = vm.capacity->rule();
    vis_cap_rule rule = cr;
    rule.base = cr.base > 0 ? cr.base : L.n_slots;  // auto: one pass of slots
    rule.drop = cr.drop && L.cpu_passes;  // the gate weight is zeroed in the CPU's copy
    rule.bias = vm.capacity->profile() ? vm.capacity->profile()->layer(il) : nullptr;
    vis_cap_input in;
    in.ids      = plan.run_ids((const int32_t *) ids->data);
    in.n_tokens = n_tokens;
    in.k        = k;
    in.tok_w    = vm.modality->weights();
    in.image    = vm.modality->image();
    if (scores) {
        in.scores = (const float *) scores->data;
        in.s_tok  = (int64_t) (scores->nb[1] / sizeof(float));
    }
    std::vector<uint8_t> resident(L.n_expert);
    for (int e = 0; e < L.n_expert; ++e) {
        resident[e] = L.slots.resident(e) ? 1 : 0;
    }
    if (vis_moe_capacity_passes(vm, L) > 0) {
        // the graph has only the passes the capacity needs: hits and loads must fit them
        int64_t hits = 0;
        std::vector<uint8_t> seen(L.n_expert, 0);
        for (int64_t j = 0; j < n_pairs; ++j) {
            const int e = in.ids[j];
            if (e >= 0 && e < L.n_expert && !seen[e]) {
                seen[e] = 1;
                hits += resident[e];
            }
        }
        rule.max_loads = std::max<int64_t>(0, (int64_t) vis_moe_full_passes(vm, L, n_pairs, true) * L.n_slots - hits);
    }
    std::vector<int32_t> exec(in.ids, in.ids + n_pairs);
    std::vector<uint8_t> dropped(n_pairs);
    llama_vis_moe_cap_stats & st = vm.capacity->stats(il);
    const int64_t over0 = st.n_overflow, forced0 = st.n_forced;
    if (!vis_cap_decide(rule, L.n_expert, resident, in, exec.data(), dropped.data(), st)) {
        return;
    }
    st.bytes_saved += ((st.n_overflow - over0) - (st.n_forced - forced0)) * L.expert_bytes;
    if (!vm.sub) {
        plan.outcome.assign(n_pairs, 0);  // with substitution on, its outcomes of this ubatch stay (the trace's SUB1)
    }
    plan.exec.assign(exec.begin(), exec.end());
    plan.sub_active = true;
    float * w = (float *) weights->data;
    const int64_t w_rank = (int64_t) (weights->nb[1] / sizeof(float)), w_tok = (int64_t) (weights->nb[2] / sizeof(float));
    for (int64_t j = 0; j < n_pairs; ++j) {
        if (dropped[j]) {
            w[(j / k) * w_tok + (j % k) * w_rank] = 0.0f;
        }
    }
}

vis_moe_capacity::vis_moe_capacity(const vis_cap_rule & rule, std::unique_ptr<vis_modality_profile> profile, int n_layer)
    : cap_rule(rule), bias(std::move(profile)), layer_stats(n_layer) {}

vis_moe_capacity::~vis_moe_capacity() = default;

int vis_moe_capacity::image_pass_bound(const vis_moe_context & vm, const vis_moe_layer & L) const {
    return vis_moe_capacity_passes(vm, L);
}

void vis_moe_capacity::stats_reset() {
    for (auto & st : layer_stats) {
        st = {};
    }
}

int vis_moe_capacity_passes(const vis_moe_context & vm, const vis_moe_layer & L) {
    if (!vm.capacity || !vm.capacity->rule().drop || !L.cpu_passes || L.n_slots <= 0) {
        return 0;
    }
    const vis_cap_rule & cr = vm.capacity->rule();
    const int base = cr.base > 0 ? cr.base : L.n_slots;
    const long cmax = std::max<long>(0, std::lround(base * (1.0 + cr.rho * 0.5)));
    return 1 + (int) ((cmax + L.n_slots - 1) / L.n_slots);
}

void vis_moe_capacity_attach(vis_moe_context & vm, const llama_model & model, const vis_moe_settings & s) {
    const auto & c = s.cap;
    if (!c.on() || vm.n_managed == 0) {
        return;
    }
    std::unique_ptr<vis_modality_profile> profile;
    if (!c.profile.empty()) {
        profile = std::make_unique<vis_modality_profile>(vis_modality_profile_load(c.profile, model));
    }
    vis_cap_rule rule;
    rule.base = c.capacity;  // 0: auto, resolved per layer
    rule.rho  = c.rho;
    rule.drop = c.drop != 0;
    vm.capacity = vm.add(std::make_unique<vis_moe_capacity>(rule, std::move(profile), (int) vm.layers.size()));
    if (!vm.modality) {
        vm.modality = vm.add(std::make_unique<vis_moe_modality>(c.delta));
    }
    LLAMA_LOG_INFO("vis-moe: entropy-weighted capacity (lossy): --moe-capacity %s per managed layer and image ubatch, "
                   "rho %g, delta %g, drop %s%s%s\n", c.capacity == 0 ? "auto (its slots)" : std::to_string(c.capacity).c_str(),
                   c.rho, c.delta, c.drop ? "on (CPU)" : "off", c.profile.empty() ? ", no modality profile" : ", modality profile ",
                   c.profile.c_str());
}

void vis_moe_total_cap_stats(const vis_moe_context & vm, llama_vis_moe_cap_stats & t) {
    t = {};
    if (!vm.capacity) {
        return;
    }
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        const auto & s = vm.capacity->stats((int) il);
        t.n_ubatches += s.n_ubatches;
        t.capacity += s.capacity;
        t.rv_sum += s.rv_sum;
        t.n_missing += s.n_missing;
        t.n_loaded += s.n_loaded;
        t.n_overflow += s.n_overflow;
        t.n_forced += s.n_forced;
        t.n_rerouted += s.n_rerouted;
        t.n_dropped += s.n_dropped;
        t.bytes_saved += s.bytes_saved;
    }
}

static void print_cap_row(const std::string & label, const llama_vis_moe_cap_stats & s) {
    std::fprintf(stderr, "vis-moe: %5s %8" PRId64 " %8.1f %6.3f %8" PRId64 " %8" PRId64 " %8" PRId64 " %7" PRId64 " %9" PRId64
                         " %8" PRId64 " %10.2f\n", label.c_str(), s.n_ubatches,
                 s.n_ubatches ? (double) s.capacity / s.n_ubatches : 0.0, s.n_ubatches ? s.rv_sum / s.n_ubatches : 0.0,
                 s.n_missing, s.n_loaded, s.n_overflow, s.n_forced, s.n_rerouted, s.n_dropped, s.bytes_saved / 1048576.0);
}

void vis_moe_capacity::stats_print(const vis_moe_context & vm) const {
    std::fprintf(stderr, "vis-moe: entropy-weighted capacity (--moe-capacity): missing image-only experts per layer\n");
    std::fprintf(stderr, "vis-moe: %5s %8s %8s %6s %8s %8s %8s %7s %9s %8s %10s\n", "layer", "ubatches", "cap avg",
                 "R_v", "missing", "loaded", "overflow", "forced", "rerouted", "dropped", "MiB saved");
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].stats.managed) {
            print_cap_row(std::to_string(il), layer_stats[il]);
        }
    }
    llama_vis_moe_cap_stats t;
    vis_moe_total_cap_stats(vm, t);
    print_cap_row("total", t);
}

int32_t llama_vis_moe_macs_weights(const float * embd, int64_t n_tokens, int64_t n_embd, float delta, float * out) {
    vis_clear_last_error();
    if (!embd || !out || n_tokens < 0 || n_embd <= 0 || !std::isfinite(delta)) {
        vis_set_last_error("llama_vis_moe_macs_weights: need embeddings, an output, n_tokens >= 0, n_embd > 0 and a "
                           "finite delta");
        return -1;
    }
    vis_macs_weights(embd, n_tokens, n_embd, n_embd, delta, out);
    return 0;
}
