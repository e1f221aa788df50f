// vis-moe-configure.cpp - the marginal-value configurator (llama-vis.h, docs/planning.md; WiSP's MV-WSA as a
// start-up configurator): which ubatch size and how many expert slots give a request the lowest predicted latency
// within one budget.  KV stays at the admission floor (the asked context and parallel sequences: a KV byte above it
// is never read, WiSP §3.5), so the bytes that move are the compute buffer's (the ubatch) and the slots'.  Every
// candidate is planned by llama_vis_moe_plan (the runtime's own split), and priced by the cost model below.
#include "llama-vis.h"
#include "vis-error.h"
#include "vis-moe-reserve.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

constexpr double MIB = 1048576.0;
constexpr int32_t UBATCH_MIN = 16;  // n_ubatch_min <= 0: the smallest ubatch the runtime considers

// what one plan of one ubatch costs a request, and per token
struct priced {
    double total = 0;       // seconds per request (prompt + generated tokens)
    double decode_s = 0;    // seconds per generated token
    double prefill_s = 0;   // seconds per prompt token
};

struct cost_model {
    const llama_vis_moe_configure_request & rq;
    int L, n, k;
    double eb;

    explicit cost_model(const llama_vis_moe_configure_request & r)
        : rq(r), L(r.plan.n_managed_layers), n(std::max(1, (int) r.plan.n_expert)),
          k(std::max(1, (int) r.plan.n_expert_used)), eb((double) r.plan.expert_bytes) {}

    // expected misses per decode token of managed layer l with s slots: the trace's curve, or the uniform prior
    // (each of the k routed experts is resident with probability s / n)
    double miss(int l, int s) const {
        s = std::min(std::max(s, 0), n);
        if (rq.miss_curve) {
            return std::max(0.0, (double) rq.miss_curve[(size_t) l * (n + 1) + s]);
        }
        return k * (1.0 - (double) s / n);
    }

    // seconds a missing expert costs: a read from the file, or a copy from the host cache (share `h` of misses)
    double per_miss(double h) const {
        const auto & c = rq.cost;
        return eb * ((1.0 - h) / c.read_bps + h / c.mem_bps);
    }

    // share of a layer's misses the host cache catches: its bytes over the expert bytes the slabs do not hold
    double host_share(const struct llama_vis_moe_plan & p, double mean_slots) const {
        const double outside = (n - mean_slots) * eb * L;
        return outside > 0 ? std::min(1.0, (double) p.host_bytes / outside) : 0.0;
    }

    // seconds of `extra` passes beyond the first of a ubatch of t tokens in one layer
    double passes(double extra, double t) const {
        return extra * (rq.cost.pass_s + t * rq.cost.pass_token_s);
    }

    // does a ubatch of t tokens stream a layer with s slots (the runtime's rule: more than stream_passes passes,
    // counted as ceil(min(n, k t) / s))?
    bool streams(int s, double t) const {
        const int sp = rq.cost.stream_passes;
        return sp > 0 && std::ceil(std::min((double) n, k * t) / std::max(s, 1)) > sp;
    }

    // seconds of one managed layer with s slots per decode token (reads and extra passes; compute is elsewhere)
    double layer_decode(int l, int s, double h) const {
        if (s >= n) {
            return 0.0;  // every expert has a slot: no reads, one pass
        }
        s = std::max(s, 1);
        if (streams(s, 1)) {
            return k * eb / rq.cost.read_bps;
        }
        return miss(l, s) * per_miss(h) + passes((double) ((k + s - 1) / s - 1), 1);
    }

    // bytes of the output matrix (n_vocab x n_embd at the experts' bytes per weight): a prompt's tokens skip it
    // but the last of each ubatch (the logits asked for); it is read once per ubatch with the resident weights
    double head_bytes(const llama_vis_moe_plan_request & pr) const {
        const double per_weight = rq.n_ff_exp > 0 && rq.n_embd > 0 ? eb / (3.0 * rq.n_embd * rq.n_ff_exp) : 0.0;
        return std::min((double) pr.resident_bytes, (double) rq.n_vocab * rq.n_embd * per_weight);
    }

    // compute of one prompt token in a large batch: given; or the probed seconds per token per weight byte times
    // the bytes a token runs through (resident weights but the output matrix, and k experts per layer); or the
    // prior of a quarter of a memory-bound decode step
    double token_s(const llama_vis_moe_plan_request & pr) const {
        const auto & c = rq.cost;
        const double bytes = (double) pr.resident_bytes + L * k * eb;
        return c.token_s > 0 ? c.token_s : c.token_byte_s > 0 ? (bytes - head_bytes(pr)) * c.token_byte_s
                                                              : bytes / c.mem_bps / 4.0;
    }

    // every managed layer's miss(l, 0..n), [L][n + 1], as llama_vis_moe_split_slots and llama_vis_moe_extra_slots
    // read them
    std::vector<double> curves() const {
        std::vector<double> cv((size_t) L * (n + 1));
        for (int l = 0; l < L; ++l) {
            for (int x = 0; x <= n; ++x) {
                cv[(size_t) l * (n + 1) + x] = miss(l, x);
            }
        }
        return cv;
    }

    // the managed layers' slots: `base` (or `s` each when empty), then one more in the plan's extra_slots layers
    // that llama_vis_moe_extra_slots picks, as the attach does (by the curves where `by_curves`: the split file's
    // case; else spread over depth: no split file)
    std::vector<int> with_extra(const struct llama_vis_moe_plan & p, int s, std::vector<int> base,
                                bool by_curves) const {
        if (base.empty()) {
            base.assign(L, std::min(std::max(s, 0), n));
        }
        if (p.extra_slots <= 0 || L <= 0) {
            return base;
        }
        const std::vector<double> cv = by_curves && rq.miss_curve ? curves() : std::vector<double>();
        std::vector<int32_t> in(base.begin(), base.end()), out(L);
        if (llama_vis_moe_extra_slots(cv.empty() ? nullptr : cv.data(), L, n, in.data(), p.extra_slots, out.data()) != 0) {
            return base;  // cannot happen for slots in 0..n; priced without them
        }
        return std::vector<int>(out.begin(), out.end());
    }

    // the whole request at ubatch u with per-layer slots `slots`, or, when it is empty, `s_all` in every layer and
    // the plan's extra slots spread over depth (what the runtime runs without a split file)
    priced price(const struct llama_vis_moe_plan & p, const llama_vis_moe_plan_request & pr, int u, int s_all,
                 const std::vector<int> & given = {}) const {
        const auto & c = rq.cost;
        const std::vector<int> slots = given.empty() ? with_extra(p, s_all, {}, false) : given;
        auto s_of = [&](int l) { return slots[l]; };
        double mean = 0;
        for (int l = 0; l < L; ++l) {
            mean += std::min(s_of(l), n);
        }
        mean = L > 0 ? mean / L : 0;
        const double h = host_share(p, mean);
        const double resident = (double) pr.resident_bytes - (double) p.pageable_bytes;
        // pageable resident weights (not locked, left to the page cache) are read from memory every step like the
        // locked ones while the page cache holds them.  The compute estimate is an upper bound: a ubatch touches
        // about the smallest ubatch's estimate, so the bytes above it are room the pages keep, and so is the
        // headroom the reserve leaves to the kernel.  Pageable bytes beyond that room are a cyclic scan larger than
        // the cache: LRU drops every page before its next use, so all of them are re-read from the file every step
        // (measured on the testbed: docs/planning.md)
        const double room = (double) pr.reserve_bytes - (double) llama_vis_moe_estimate_reserve(
                                UBATCH_MIN, rq.n_vocab, rq.n_embd, rq.plan.n_expert_used, rq.n_ff_exp) +
                            (double) VIS_MOE_RESERVE_KERNEL;
        const double paged = (double) p.pageable_bytes / c.mem_bps +
                             ((double) p.pageable_bytes > room ? (double) p.pageable_bytes / c.read_bps : 0.0);
        priced r;
        // decode: every resident byte and the k routed experts of each layer are read once per token
        r.decode_s = (resident + L * k * eb) / c.mem_bps + paged;
        for (int l = 0; l < L; ++l) {
            r.decode_s += layer_decode(l, s_of(l), h);
        }
        // prefill: ceil(P / u) ubatches; each reads the resident weights once and, per layer, the distinct experts
        // its tokens route to (uniform: n (1 - (1 - k/n)^tokens)) in ceil(distinct / s) passes
        const int P = std::max(1, (int) c.prompt_tokens);
        const int nub = (P + u - 1) / u;
        const double ut = (double) P / nub;
        const double D = n * (1.0 - std::pow(1.0 - (double) k / n, ut));
        double ub_s = (resident + L * D * eb) / c.mem_bps + paged + ut * token_s(pr);
        for (int l = 0; l < L; ++l) {
            const int s = std::max(1, s_of(l));
            if (s >= n) {
                continue;
            }
            if (streams(s, ut)) {
                ub_s += D * eb / c.read_bps;  // streamed: every routed expert read once, no passes
                continue;
            }
            const double scale = rq.miss_curve ? miss(l, s) / std::max(miss(l, 0), 1e-9) : 1.0 - std::min((double) s, D) / n;
            ub_s += D * scale * per_miss(h) + passes(std::ceil(D / s) - 1.0, ut);
        }
        r.prefill_s = nub * ub_s / P;
        r.total = total(r);
        return r;
    }
    // seconds per request: the prompt's tokens at prefill_s, the generated ones at decode_s
    double total(const priced & r) const {
        return std::max(1, (int) rq.cost.prompt_tokens) * r.prefill_s + std::max(0, (int) rq.cost.gen_tokens) * r.decode_s;
    }
};

std::string fmt(double v) {
    char b[48];
    std::snprintf(b, sizeof(b), "%g", v);
    return b;
}

// the managed layers' slot counts for `s` slots each on average: the one per-layer rule (llama_vis_moe_split_slots,
// what VIS_MOE_SLOT_SPLIT runs at attach and pyvis.runtime.cachesim_split.split_slots in the simulator) on the
// curves the plans are priced with, so the configurator's split is the runtime's at start-up
std::vector<int> split_per_layer(const cost_model & m, int s) {
    const std::vector<double> cv = m.curves();
    std::vector<int32_t> out(m.L, s);
    if (s >= 1 && s < m.n) {
        llama_vis_moe_split_slots(cv.data(), m.L, m.n, std::min(m.k, m.n), s, nullptr, out.data());
    }
    return std::vector<int>(out.begin(), out.end());
}

} // namespace

int32_t llama_vis_moe_configure(const struct llama_vis_moe_configure_request * req,
                                struct llama_vis_moe_configuration * out) {
    vis_clear_last_error();
    if (!req || !out) {
        vis_set_last_error("llama_vis_moe_configure: NULL argument");
        return -1;
    }
    llama_vis_moe_configure_request rq = *req;
    const auto & c = rq.cost;
    if (rq.n_ubatch_min <= 0) {
        rq.n_ubatch_min = std::min(UBATCH_MIN, std::max(rq.n_ubatch, 1));
    }
    if (rq.n_ubatch < 1 || rq.n_ubatch_min > rq.n_ubatch) {
        vis_set_last_error("llama_vis_moe_configure: need 1 <= n_ubatch_min <= n_ubatch, got " +
                           std::to_string(rq.n_ubatch_min) + " and " + std::to_string(rq.n_ubatch));
        return -1;
    }
    if (!(c.read_bps > 0) || !(c.mem_bps > 0) || !(c.pass_s >= 0) || !(c.pass_token_s >= 0) ||
        !(c.token_byte_s >= 0) || !std::isfinite(c.token_byte_s) ||
        !std::isfinite(c.read_bps) || !std::isfinite(c.mem_bps) || !std::isfinite(c.pass_s) ||
        !std::isfinite(c.pass_token_s) || c.stream_passes < 0 || c.prompt_tokens < 0 || c.gen_tokens < 0 ||
        c.prompt_tokens + c.gen_tokens <= 0) {
        vis_set_last_error("llama_vis_moe_configure: the cost needs read_bps > 0, mem_bps > 0, pass_s >= 0, "
                           "pass_token_s >= 0, token_byte_s >= 0, stream_passes >= 0 and a "
                           "request of prompt_tokens + gen_tokens > 0 tokens (read_bps " + fmt(c.read_bps) + ", mem_bps " +
                           fmt(c.mem_bps) + ", pass_s " + fmt(c.pass_s) + ")");
        return -1;
    }
    const cost_model m(rq);
    struct cand {
        int u;
        llama_vis_moe_plan_request pr;
        struct llama_vis_moe_plan p;
        priced cost;
        std::string err;
    };
    // VIS_MOE_BORROW: decode steps run the slots of the plan at the smallest ubatch's compute estimate, whatever the
    // ubatch (src/features/vis-moe-borrow.h); prefill is priced at the candidate's own plan (the runtime's floor)
    llama_vis_moe_plan_request pr_small = rq.plan;
    struct llama_vis_moe_plan p_small = {};
    bool borrow = false;
    if (rq.borrow) {
        pr_small.reserve_bytes = llama_vis_moe_estimate_reserve(rq.n_ubatch_min, rq.n_vocab, rq.n_embd,
                                                                rq.plan.n_expert_used, rq.n_ff_exp);
        borrow = llama_vis_moe_plan(&pr_small, &p_small) == 0 && p_small.ok && p_small.pageable_bytes == 0;
        vis_clear_last_error();
    }
    // the asked ubatch, halved down to the smallest (the last candidate is n_ubatch_min itself)
    std::vector<cand> cs;
    for (int u = rq.n_ubatch;; u = std::max(rq.n_ubatch_min, u / 2)) {
        cand x;
        x.u  = u;
        x.pr = rq.plan;
        x.pr.reserve_bytes = llama_vis_moe_estimate_reserve(u, rq.n_vocab, rq.n_embd, rq.plan.n_expert_used, rq.n_ff_exp);
        if (llama_vis_moe_plan(&x.pr, &x.p) != 0) {
            return -1;  // a bad request: the plan's error stands
        }
        if (x.p.ok) {
            x.cost = m.price(x.p, x.pr, u, x.p.n_slots);
            if (borrow && u > rq.n_ubatch_min && p_small.n_slots > x.p.n_slots) {
                x.cost.decode_s = m.price(p_small, pr_small, u, p_small.n_slots).decode_s;
                x.cost.total    = m.total(x.cost);
            }
        } else {
            x.err = llama_vis_last_error();
        }
        cs.push_back(x);
        if (u == rq.n_ubatch_min) {
            break;
        }
    }
    vis_clear_last_error();
    llama_vis_moe_configuration o = {};
    // the best plan; a smaller ubatch only where it saves more than 2 % (the asked one stands on near-ties)
    int best = -1;
    for (int i = 0; i < (int) cs.size(); ++i) {
        if (cs[i].p.ok && (best < 0 || cs[i].cost.total < cs[best].cost.total * 0.98)) {
            best = i;
        }
    }
    if (cs[0].p.ok) {
        o.asked_n_slots     = cs[0].p.n_slots;
        o.asked_extra_slots = cs[0].p.extra_slots;
        o.asked_decode_tps  = 1.0 / cs[0].cost.decode_s;
        o.asked_prefill_tps = 1.0 / cs[0].cost.prefill_s;
    }
    if (best < 0) {
        o.ok       = 0;
        o.n_ubatch = cs.back().u;
        o.plan     = cs.back().p;  // min_budget at the smallest ubatch: the smallest budget that works
        vis_set_last_error(cs.back().err);
        *out = o;
        return 0;
    }
    const cand & b = cs[best];
    o.ok          = 1;
    o.n_ubatch    = b.u;
    o.plan        = b.p;
    o.decode_tps  = 1.0 / b.cost.decode_s;
    o.prefill_tps = 1.0 / b.cost.prefill_s;
    // marginal values at the optimum, seconds per request per MiB: a slot row (one slot in every managed layer),
    // and a ubatch doubling (its compute-buffer bytes), the other side held where it is
    const int s = b.p.n_slots;
    const double row_mib = m.L * m.eb / MIB;
    if (row_mib > 0 && s < m.n) {
        if (s > 1) {
            o.mv_slot = (m.price(b.p, b.pr, b.u, s - 1).total - b.cost.total) / row_mib;
        }
        o.mv_next_slot = (b.cost.total - m.price(b.p, b.pr, b.u, s + 1).total) / row_mib;
    }
    auto mv_ubatch = [&](const cand & lo, const cand & hi) {  // saving of hi's ubatch over lo's, slots held at s
        const double d_mib = (hi.pr.reserve_bytes - lo.pr.reserve_bytes) / MIB;
        return d_mib > 0 ? (m.price(b.p, b.pr, lo.u, s).total - m.price(b.p, b.pr, hi.u, s).total) / d_mib : 0.0;
    };
    if (best + 1 < (int) cs.size() && cs[best + 1].u < b.u) {
        o.mv_ubatch_down = mv_ubatch(cs[best + 1], b);
    }
    if (best > 0) {
        o.mv_ubatch_up = mv_ubatch(b, cs[best - 1]);
    }
    if (rq.layer_slots && m.L > 0) {
        // the split, then the bytes left after whole rows by the same curves: what the attach runs with the split
        // file written from this profile
        const std::vector<int> ls = m.with_extra(b.p, s, split_per_layer(m, std::min(s, m.n)), true);
        std::copy(ls.begin(), ls.end(), rq.layer_slots);
        while (o.n_pinned < m.L && ls[o.n_pinned] >= m.n) {
            o.n_pinned++;
        }
        o.layer_decode_tps = 1.0 / m.price(b.p, b.pr, b.u, s, ls).decode_s;
    }
    *out = o;
    return 0;
}

int32_t llama_vis_moe_configure_applies(const struct llama_vis_moe_configure_request * req,
                                        const struct llama_vis_moe_configuration * conf, int32_t mode,
                                        int32_t all_f32) {
    if (mode == 0) {
        return LLAMA_VIS_MOE_CONFIGURE_OFF;
    }
    if (mode > 0) {
        return LLAMA_VIS_MOE_CONFIGURE_APPLIED;
    }
    (void) req;
    (void) conf;
    // auto runs the priced choice (the cheapest plan by the measured cost model) wherever outputs stay the same.
    // The former top-k rule (keep -ub where the slots a smaller one buys stay below top-k) was fitted to the prior
    // cost model; with the measured one the priced choice was within noise of or better than the rule's in every
    // cell of the testbed grid, and 1.4x the rule's at 450 MiB, -c 4096 (docs/planning.md#repeated-runs)
    return all_f32 ? LLAMA_VIS_MOE_CONFIGURE_APPLIED : LLAMA_VIS_MOE_CONFIGURE_NOT_F32;
}
