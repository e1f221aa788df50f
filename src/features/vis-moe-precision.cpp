// vis-moe-precision.cpp - the precision policy, its controller and its place in pass 0 (vis-moe-precision.h).
#include "vis-moe-precision.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-modality.h"
#include "vis-moe-shadow.h"
#include "vis-moe-shadow-slots.h"

#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cmath>
#include <stdexcept>
#include <utility>

int vis_prec_decide(const vis_prec_rule & rule, int n_expert, const std::vector<uint8_t> & resident,
                    const vis_prec_input & in, std::vector<uint8_t> & serve, llama_vis_moe_prec_stats & st) {
    serve.assign(n_expert, 0);
    if (rule.mode == VIS_PREC_OFF || in.n_tokens <= 0) {
        return 0;
    }
    int64_t n_image = 0;
    for (int64_t t = 0; in.image && t < in.n_tokens; ++t) {
        n_image += in.image[t] ? 1 : 0;
    }
    const bool by_vision = (rule.mode == VIS_PREC_VISION || rule.mode == VIS_PREC_AUTO) && n_image > 0 &&
                           (double) n_image >= rule.vision * (double) in.n_tokens;
    const bool by_gate   = (rule.mode == VIS_PREC_GATE || rule.mode == VIS_PREC_AUTO) && in.decode;
    if (by_vision) {
        st.n_vision_ubatches++;
    }
    // per routed expert: routed by a text token?  the largest share of a token's gate weight among its pairs (the
    // share, not the weight: models scale their gate weights differently, e.g. deepseek2's routed scaling factor)
    std::vector<uint8_t> routed(n_expert, 0), text(n_expert, 0);
    std::vector<float>   wmax(n_expert, 0.0f);
    for (int64_t t = 0; t < in.n_tokens; ++t) {
        const bool img = in.image && in.image[t];
        double sum = 0;
        for (int r = 0; in.weights && r < in.k; ++r) {
            const float w = in.weights[t * in.w_tok + r * in.w_rank];
            sum += std::isfinite(w) && w > 0 ? w : 0.0;
        }
        for (int r = 0; r < in.k; ++r) {
            const int e = in.ids[t * in.k + r];
            if (e < 0 || e >= n_expert) {
                continue;
            }
            const float w = in.weights ? in.weights[t * in.w_tok + r * in.w_rank] : 1.0f;
            const float share = !in.weights ? 1.0f : std::isfinite(w) && sum > 0 ? (float) (w / sum) : INFINITY;
            routed[e] = 1;
            text[e]   = text[e] || !img;
            wmax[e]   = std::max(wmax[e], share);
        }
    }
    std::vector<std::pair<float, int>> eligible;  // (largest gate weight, expert)
    for (int e = 0; e < n_expert; ++e) {
        if (!routed[e] || resident[e]) {
            continue;
        }
        const bool ok = rule.mode == VIS_PREC_ALL || (by_vision && !text[e]) || (by_gate && wmax[e] < rule.gate);
        if (ok) {
            eligible.emplace_back(wmax[e], e);
        }
    }
    std::stable_sort(eligible.begin(), eligible.end(),
                     [](const auto & a, const auto & b) { return a.first < b.first; });
    const double share = std::clamp(rule.share, 0.0, 1.0);
    const size_t n = std::min(eligible.size(), (size_t) std::ceil(share * (double) eligible.size() - 1e-9));
    for (size_t i = 0; i < n; ++i) {
        serve[eligible[i].second] = 1;
    }
    st.n_eligible += (int64_t) eligible.size();
    st.n_shadow   += (int64_t) n;
    return (int) n;
}

void vis_prec_controller::update(int64_t stall_us, int64_t ubatch_us) {
    if (target <= 0 || ubatch_us <= 0) {
        return;
    }
    const double stall = (double) stall_us / (double) ubatch_us;
    const double prev  = s;
    if (stall > target) {
        s = std::min(1.0, s + STEP);
    } else {
        s *= 0.5;
        if (s < 1.0 / 64) {
            s = 0;  // every eligible miss in full precision until the stalls come back
        }
    }
    switches += s != prev ? 1 : 0;
}

const char * vis_moe_precision::mode_name() const {
    switch (cfg.mode) {
        case VIS_PREC_VISION: return "vision";
        case VIS_PREC_GATE:   return "gate";
        case VIS_PREC_ALL:    return "all";
        case VIS_PREC_AUTO:   return "auto";
        default:              return "off";
    }
}

vis_prec_rule vis_moe_precision::rule() const {
    vis_prec_rule r;
    r.mode   = cfg.mode;
    r.vision = cfg.vision;
    r.gate   = cfg.gate;
    r.share  = cfg.mode == VIS_PREC_AUTO ? ctl.share() : 1.0;
    return r;
}

// the load time of every managed layer so far (full-precision and shadow slots)
static int64_t total_load_us(const vis_moe_context & vm) {
    int64_t us = 0;
    for (const auto & L : vm.layers) {
        us += L.stats.load_us + (vm.precision ? vm.precision->stats(vm.index_of(L)).load_us : 0);
    }
    return us;
}

void vis_moe_precision::end_ubatch(vis_moe_context & vm, int64_t ubatch_us) {
    const int64_t now = total_load_us(vm);
    if (cfg.mode == VIS_PREC_AUTO && eligible_seen) {
        ctl.update(now - stall0_us, ubatch_us);
    }
    stall0_us = now;
}

void vis_moe_precision::ubatch_end(vis_moe_context & vm) {
    end_ubatch(vm, ggml_time_us() - vm.ub_t0_us);  // the controller sees the ubatch's stalls
}

void vis_moe_precision::stats_reset() {
    for (auto & st : layer_stats) {
        st = {};
    }
}

static void print_prec_row(const std::string & label, const llama_vis_moe_prec_stats & s) {
    std::fprintf(stderr, "vis-moe: %5s %8" PRId64 " %8" PRId64 " %8" PRId64 " %8" PRId64 " %8" PRId64 " %10.2f %10.2f %8" PRId64
                         " %9.2f %7" PRId64 "\n", label.c_str(), s.n_eligible, s.n_shadow, s.n_shadow_pairs, s.n_shadow_hits,
                 s.n_shadow_reads, s.bytes_shadow / 1048576.0, s.bytes_saved / 1048576.0, s.n_refetch, s.load_us / 1000.0,
                 s.n_vision_ubatches);
}

void vis_moe_precision::stats_print(const vis_moe_context & vm) const {
    std::fprintf(stderr, "vis-moe: precision (--moe-precision %s, %s shadows): misses served from shadow experts\n",
                 mode_name(), ggml_type_name(vm.shadow->type));
    std::fprintf(stderr, "vis-moe: %5s %8s %8s %8s %8s %8s %10s %10s %8s %9s %7s\n", "layer", "eligibl", "shadow", "pairs",
                 "sh hits", "sh reads", "MiB read", "MiB saved", "refetch", "stall ms", "vision");
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].shadow.on()) {
            print_prec_row(std::to_string(il), layer_stats[il]);
        }
    }
    llama_vis_moe_prec_stats t;
    vis_moe_total_prec_stats(vm, t);
    print_prec_row("total", t);
    std::fprintf(stderr, "vis-moe: precision: %" PRId64 " of %" PRId64 " eligible misses ran from shadows (%" PRId64
                         " pairs); %.2f MiB of full-precision reads left off the critical path%s",
                 t.n_shadow, t.n_eligible, t.n_shadow_pairs, t.bytes_saved / 1048576.0,
                 cfg.mode == VIS_PREC_AUTO ? "" : "\n");
    if (cfg.mode == VIS_PREC_AUTO) {
        std::fprintf(stderr, "; controller: share %d %%, %" PRId64 " switches\n", t.share_pct, t.n_switches);
    }
}

void vis_moe_precision_attach(vis_moe_context & vm, const vis_moe_settings & s, int n_shadow_slots, bool file_store) {
    const auto & c = s.prec;
    if (!c.on()) {
        return;
    }
    if (c.shadow.empty()) {
        throw std::runtime_error(std::string("vis-moe: --moe-precision ") + (c.mode == VIS_PREC_AUTO ? "auto" : "on") +
                                 " serves misses from shadow experts: add --moe-shadow FILE (make one with: pyvis "
                                 "shadow MODEL --type Q4_0 --out FILE)");
    }
    if (!vm.shadow) {
        return;  // no managed layer: the shadow loader said so
    }
    vm.precision = vm.add(std::make_unique<vis_moe_precision>(c, (int) vm.layers.size()));
    if (!vm.modality) {
        vm.modality = vm.add(std::make_unique<vis_moe_modality>(s.cap.delta));  // which tokens are image tokens
    }
    vis_shadow_slots_create(vm, n_shadow_slots);
    if (!vm.io) {
        vm.io = std::make_unique<vis_io_pool>(s.tier.io_threads, s.tier.direct_io);  // the sidecar is read per expert
    }
    if (file_store && c.refetch && !vm.fetch) {
        vm.fetch = std::make_unique<vis_moe_fetcher>(1, s.tier.direct_io);
    }
    int ns = 0;
    for (const auto & L : vm.layers) {
        ns = std::max(ns, L.shadow.n_slots);
    }
    char ctl[96] = "";
    if (c.mode == VIS_PREC_AUTO) {
        std::snprintf(ctl, sizeof(ctl), ", controller target stall share %g", c.target);
    }
    LLAMA_LOG_INFO("vis-moe: precision (lossy): --moe-precision %s, vision share >= %g, gate < %g%s; %d shadow slots per "
                   "managed layer (%.2f MiB of %s slabs); full-precision refetch %s\n", vm.precision->mode_name(), c.vision,
                   c.gate, ctl, ns, vm.shadow_slab_bytes / 1048576.0, ggml_type_name(vm.shadow->type),
                   c.refetch && vm.fetch ? "on" : "off");
}

void vis_moe_precision_plan(const vis_moe_context & vm, const vis_moe_layer & L, const int32_t * ids,
                            const ggml_tensor * ids_t, const ggml_tensor * weights, std::vector<uint8_t> & serve) {
    if (!vm.precision || !L.shadow.on()) {
        return;
    }
    vis_prec_input in;
    in.ids      = ids;
    in.k        = (int) ids_t->ne[0];
    in.n_tokens = ids_t->ne[1];
    in.weights  = (const float *) weights->data;
    in.w_rank   = (int64_t) (weights->nb[1] / sizeof(float));
    in.w_tok    = (int64_t) (weights->nb[2] / sizeof(float));
    in.image    = vm.modality ? vm.modality->image() : nullptr;
    in.decode   = vm.ub_decode;
    std::vector<uint8_t> resident(L.n_expert);
    for (int e = 0; e < L.n_expert; ++e) {
        resident[e] = L.slots.resident(e) ? 1 : 0;
    }
    llama_vis_moe_prec_stats & st = vm.precision->stats(vm.index_of(L));
    const int64_t before = st.n_eligible;
    vis_prec_decide(vm.precision->rule(), L.n_expert, resident, in, serve, st);
    vm.precision->eligible_seen = vm.precision->eligible_seen || st.n_eligible > before;
}

bool vis_moe_precision_stages_shadows(const vis_moe_context & vm, bool image_ubatch) {
    if (!vm.precision || !vm.shadow) {
        return false;
    }
    const vis_prec_rule r = vm.precision->rule();
    return r.mode == VIS_PREC_ALL ||
           (image_ubatch && (r.mode == VIS_PREC_VISION || r.mode == VIS_PREC_AUTO) && r.vision <= 1.0 && r.share >= 1.0);
}

void vis_moe_precision_staged(vis_moe_context & vm, vis_moe_layer & L, const ggml_tensor * ids_t,
                              const ggml_tensor * weights, int64_t n_routed) {
    if (!vm.precision || !L.shadow.on()) {
        return;
    }
    const int32_t * ids = (const int32_t *) ids_t->data;
    std::vector<uint8_t> & serve = vm.precision->staged_serve;
    vis_moe_precision_plan(vm, L, ids, ids_t, weights, serve);
    auto & st = vm.precision->stats(vm.index_of(L));
    for (int64_t j = 0; j < ggml_nelements(ids_t); ++j) {
        st.n_shadow_pairs += ids[j] >= 0 && ids[j] < L.n_expert && serve[ids[j]] ? 1 : 0;
    }
    st.n_shadow_reads += n_routed;
    st.bytes_shadow   += n_routed * L.shadow.expert_bytes;
    st.bytes_saved    += n_routed * (L.expert_bytes - L.shadow.expert_bytes);
}

void vis_moe_total_prec_stats(const vis_moe_context & vm, llama_vis_moe_prec_stats & t) {
    t = {};
    if (!vm.precision) {
        return;
    }
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        const auto & s = vm.precision->stats((int) il);
        t.n_eligible += s.n_eligible;
        t.n_shadow += s.n_shadow;
        t.n_shadow_pairs += s.n_shadow_pairs;
        t.n_shadow_hits += s.n_shadow_hits;
        t.n_shadow_reads += s.n_shadow_reads;
        t.bytes_shadow += s.bytes_shadow;
        t.bytes_saved += s.bytes_saved;
        t.n_refetch += s.n_refetch;
        t.load_us += s.load_us;
        t.n_vision_ubatches += s.n_vision_ubatches;
    }
    t.n_switches = vm.precision->controller().n_switches();
    t.share_pct  = (int32_t) std::lround(100.0 * vm.precision->rule().share);
}

void vis_moe_precision::plan_serve(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan,
                                   const ggml_tensor * ids, const ggml_tensor * weights) {
    (void) il;
    // which misses run from shadows, among the experts the pairs run
    vis_moe_precision_plan(vm, L, plan.run_ids((const int32_t *) ids->data), ids, weights, plan.shadow_serve);
}

void vis_moe_precision::plan_reads(const vis_moe_context & vm, const vis_moe_layer & L, int il, vis_ubatch_plan & plan) {
    (void) L;
    (void) il;
    if (!cfg.refetch || !vm.fetch || plan.passes.size() > 1) {
        return;  // several full passes: every slot may serve a later pass of this ubatch
    }
    for (const auto & pass : plan.shadow_passes) {
        for (int e : pass) {
            plan.read(e, VIS_READ_REFETCH, true);  // the full-precision expert, unless resident by then
        }
    }
}

void vis_moe_precision::plan_applied(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                                     const vis_ubatch_plan & plan) {
    (void) vm;
    (void) L;
    for (const auto & r : plan.reads) {
        layer_stats[il].n_refetch += r.why == VIS_READ_REFETCH && (r.done == VIS_READ_SERVED || r.done == VIS_READ_QUEUED);
    }
}
