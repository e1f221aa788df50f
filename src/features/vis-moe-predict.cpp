// vis-moe-predict.cpp - the expert predictors (vis-moe-predict.h).
#include "vis-moe-predict.h"
#include "vis-moe-predict-mlp.h"
#include "vis-moe-profile.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace {

// the router logits of layer il+d, as a softmax per token summed over the ubatch's tokens
class next_router_predictor final : public vis_moe_predictor {
public:
    const char * name() const override { return "next-router"; }
    bool wants_logits() const override { return true; }

    bool predict(const vis_predict_input & in, int d, int n_expert, std::vector<float> & score) override {
        const float * lg = in.logits[d];
        if (!lg) {
            return false;
        }
        score.assign(n_expert, 0.0f);
        for (int64_t t = 0; t < in.n_tokens; ++t) {
            const float * row = lg + t * in.stride[d];
            const float mx = *std::max_element(row, row + n_expert);
            double sum = 0;
            for (int e = 0; e < n_expert; ++e) {
                sum += std::exp((double) row[e] - mx);
            }
            for (int e = 0; e < n_expert; ++e) {
                score[e] += (float) (std::exp((double) row[e] - mx) / sum);
            }
        }
        return true;
    }
};

// WiSP Appendix C: P(j at l+d | i at l) from counts of the steps seen so far; the score of j sums it over the
// experts i each token routed at l
class coact_predictor final : public vis_moe_predictor {
public:
    coact_predictor(const std::vector<int> & n_expert_, int lookahead) : n_expert(n_expert_), W(lookahead) {
        const int n_layer = (int) n_expert.size();
        counts.resize(n_layer);
        uses.resize(n_layer);
        last.resize(n_layer);
        last_step.assign(n_layer, UINT64_MAX);
        for (int il = 0; il < n_layer; ++il) {
            uses[il].assign(n_expert[il], 0.0f);
            counts[il].resize(W + 1);
            for (int d = 1; d <= W && il + d < n_layer; ++d) {
                counts[il][d].assign((size_t) n_expert[il] * n_expert[il + d], 0.0f);
            }
        }
    }

    const char * name() const override { return "coact"; }

    // the profile's tables as counts (vis_moe_predictor_make); layers whose expert count differs are left empty
    void seed(const vis_predict_profile & p) {
        count_weighting = p.weighting == "count";
        const double n = (double) p.n_tokens;
        const int n_layer = std::min<int>((int) n_expert.size(), p.n_layer);
        for (int il = 0; il < n_layer; ++il) {
            if (n_expert[il] != p.n_expert) {
                continue;
            }
            const int E = p.n_expert;
            for (int e = 0; e < E; ++e) {
                uses[il][e] += (float) (p.freq_at(il, e) * n);
            }
            for (int d = 1; d <= std::min(W, p.lookahead) && il + d < n_layer; ++d) {
                if (counts[il][d].size() != (size_t) E * E) {
                    continue;
                }
                std::vector<float> & c = counts[il][d];
                for (int i = 0; i < E; ++i) {
                    const double base = (double) p.k * p.freq_at(il, i) * n;
                    const float * row = p.row(d, il, i);
                    for (int j = 0; j < E; ++j) {
                        c[(size_t) i * E + j] += (float) (row[j] * base);
                    }
                }
            }
        }
    }

    void observe(const vis_predict_input & in) override {
        const int il = in.il;
        for (int d = 1; d <= W && il - d >= 0; ++d) {
            const int src = il - d;
            if (last_step[src] != in.step || counts[src][d].empty() || last[src].size() != (size_t) in.n_tokens * in.k) {
                continue;  // layer src did not route this ubatch (or routed it differently)
            }
            std::vector<float> & c = counts[src][d];
            const int ne = n_expert[il];
            for (int64_t t = 0; t < in.n_tokens; ++t) {
                for (int a = 0; a < in.k; ++a) {
                    const int i = last[src][t * in.k + a];
                    for (int b = 0; b < in.k; ++b) {
                        const int j = in.ids[t * in.k + b];
                        if (i >= 0 && j >= 0 && j < ne) {
                            c[(size_t) i * ne + j] += 1.0f;
                        }
                    }
                }
            }
        }
        last[il].assign(in.ids, in.ids + in.n_tokens * in.k);
        last_step[il] = in.step;
        for (int64_t x = 0; x < in.n_tokens * in.k; ++x) {
            if (in.ids[x] >= 0 && in.ids[x] < n_expert[il]) {
                uses[il][in.ids[x]] += 1.0f;
            }
        }
    }

    bool predict(const vis_predict_input & in, int d, int ne, std::vector<float> & score) override {
        const int il = in.il;
        if (d > W || il + d >= (int) n_expert.size() || counts[il][d].empty()) {
            return false;
        }
        const std::vector<float> & c = counts[il][d];
        score.assign(ne, 0.0f);
        bool any = false;
        for (int64_t x = 0; x < in.n_tokens * in.k; ++x) {
            const int i = in.ids[x];
            if (i < 0 || i >= n_expert[il] || uses[il][i] <= 0) {
                continue;
            }
            // count weighting: raw counts, frequent sources weigh more
            const float inv = count_weighting ? 1.0f : 1.0f / uses[il][i];
            for (int j = 0; j < ne; ++j) {
                score[j] += c[(size_t) i * ne + j] * inv;
            }
            any = true;
        }
        // all zero: nothing counted for this distance yet (e.g. beyond a profile's W), no prediction
        return any && *std::max_element(score.begin(), score.end()) > 0.0f;
    }

private:
    std::vector<int> n_expert;
    int W;
    bool count_weighting = false;                         // a profile's "count" weighting: sum raw counts
    std::vector<std::vector<std::vector<float>>> counts;  // [il][d] -> [n_expert(il)][n_expert(il+d)]
    std::vector<std::vector<float>> uses;                 // [il][e] routings of e at il
    std::vector<std::vector<int32_t>> last;               // the ids layer il routed in step last_step[il]
    std::vector<uint64_t> last_step;
};

// the target layer's experts by how often they were routed so far
class freq_predictor final : public vis_moe_predictor {
public:
    explicit freq_predictor(const std::vector<int> & n_expert) {
        uses.resize(n_expert.size());
        for (size_t il = 0; il < n_expert.size(); ++il) {
            uses[il].assign(n_expert[il], 0.0f);
        }
    }
    const char * name() const override { return "freq"; }
    void seed(const vis_predict_profile & p) {
        for (size_t il = 0; il < uses.size() && (int) il < p.n_layer; ++il) {
            if ((int) uses[il].size() != p.n_expert) {
                continue;
            }
            for (int e = 0; e < p.n_expert; ++e) {
                uses[il][e] += (float) ((double) p.freq_at((int) il, e) * (double) p.n_tokens);
            }
        }
    }
    void observe(const vis_predict_input & in) override {
        std::vector<float> & u = uses[in.il];
        for (int64_t x = 0; x < in.n_tokens * in.k; ++x) {
            if (in.ids[x] >= 0 && in.ids[x] < (int) u.size()) {
                u[in.ids[x]] += 1.0f;
            }
        }
    }
    bool predict(const vis_predict_input & in, int d, int ne, std::vector<float> & score) override {
        const int t = in.il + d;
        if (t >= (int) uses.size() || (int) uses[t].size() != ne) {
            return false;
        }
        score = uses[t];
        return true;
    }

private:
    std::vector<std::vector<float>> uses;
};

class random_predictor final : public vis_moe_predictor {
public:
    explicit random_predictor(uint32_t seed) : rng(seed) {}
    const char * name() const override { return "random"; }
    bool predict(const vis_predict_input & in, int d, int ne, std::vector<float> & score) override {
        (void) in;
        (void) d;
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        score.resize(ne);
        for (float & s : score) {
            s = u(rng);
        }
        return true;
    }

private:
    std::mt19937 rng;
};

} // namespace

std::unique_ptr<vis_moe_predictor> vis_moe_predictor_make(int mode, const std::vector<int> & n_expert, int lookahead,
                                                          uint32_t seed, const vis_predict_profile * profile) {
    switch (mode) {
        case VIS_PRED_NEXT_ROUTER: return std::make_unique<next_router_predictor>();
        case VIS_PRED_COACT: {
            auto p = std::make_unique<coact_predictor>(n_expert, lookahead);
            if (profile) {
                p->seed(*profile);
            }
            return p;
        }
        case VIS_PRED_FREQ: {
            auto p = std::make_unique<freq_predictor>(n_expert);
            if (profile) {
                p->seed(*profile);
            }
            return p;
        }
        case VIS_PRED_RANDOM:      return std::make_unique<random_predictor>(seed);
        case VIS_PRED_MLP:         return vis_moe_predictor_make_mlp(n_expert, profile);
        default:                   return nullptr;
    }
}

std::vector<int32_t> vis_predict_top(const std::vector<float> & score, int b) {
    std::vector<int32_t> idx(score.size());
    std::iota(idx.begin(), idx.end(), 0);
    b = std::max(0, std::min(b, (int) idx.size()));
    std::partial_sort(idx.begin(), idx.begin() + b, idx.end(), [&](int32_t x, int32_t y) {
        return score[x] != score[y] ? score[x] > score[y] : x < y;
    });
    idx.resize(b);
    return idx;
}

double vis_predict_recall(const std::vector<int32_t> & pred, const int32_t * actual, int64_t n_actual) {
    std::vector<int32_t> a(actual, actual + n_actual);
    std::sort(a.begin(), a.end());
    a.erase(std::unique(a.begin(), a.end()), a.end());
    if (a.empty()) {
        return 0.0;
    }
    int64_t hit = 0;
    for (int32_t e : a) {
        hit += std::find(pred.begin(), pred.end(), e) != pred.end() ? 1 : 0;
    }
    return (double) hit / (double) a.size();
}

const char * vis_predict_mode_name(int mode) {
    switch (mode) {
        case VIS_PRED_OFF:         return "off";
        case VIS_PRED_NEXT_ROUTER: return "next-router";
        case VIS_PRED_COACT:       return "coact";
        case VIS_PRED_FREQ:        return "freq";
        case VIS_PRED_RANDOM:      return "random";
        case VIS_PRED_MLP:         return "mlp";
        case VIS_PRED_AUTO:        return "auto";
        default:                   return "?";
    }
}
