// vis-moe-predict-mlp.cpp - the VisMMOE lookahead MLP predictor (vis-moe-predict-mlp.h).
#include "vis-moe-predict-mlp.h"
#include "vis-moe-profile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

void vis_mlp_forward(const vis_predict_profile & p, int il, const float * hist, const float * hidden, float * a,
                     float * y) {
    const int E = p.n_expert, H = p.mlp_hidden, n = p.mlp_n_embd, D = E + n, O = p.mlp_lookahead * E;
    const float * w1 = p.mlp_w1.data() + (size_t) il * H * D;
    const float * b1 = p.mlp_b1.data() + (size_t) il * H;
    const float * w2 = p.mlp_w2.data() + (size_t) il * O * H;
    const float * b2 = p.mlp_b2.data() + (size_t) il * O;
    for (int h = 0; h < H; ++h) {
        const float * row = w1 + (size_t) h * D;
        float s = b1[h];
        for (int e = 0; e < E; ++e) {
            s += row[e] * hist[e];
        }
        for (int i = 0; i < n; ++i) {
            s += row[E + i] * hidden[i];
        }
        a[h] = s > 0.0f ? s : 0.0f;
    }
    for (int o = 0; o < O; ++o) {
        const float * row = w2 + (size_t) o * H;
        float s = b2[o];
        for (int h = 0; h < H; ++h) {
            s += row[h] * a[h];
        }
        y[o] = s;
    }
}

namespace {

class mlp_predictor final : public vis_moe_predictor {
public:
    mlp_predictor(const std::vector<int> & n_expert_, const vis_predict_profile & profile)
        : n_expert(n_expert_), p(profile) {
        p.coact.clear();  // only the MLP is used
        p.coact.shrink_to_fit();
        last.resize(n_expert.size());
        last_step.assign(n_expert.size(), UINT64_MAX);
    }

    const char * name() const override { return "mlp"; }
    bool wants_hidden() const override { return true; }

    // the routing history: each layer's ids of its last ubatch
    void observe(const vis_predict_input & in) override {
        if (in.il < 0 || in.il >= (int) last.size()) {
            return;
        }
        last[in.il].assign(in.ids, in.ids + in.n_tokens * in.k);
        last_step[in.il] = in.step;
    }

    bool predict(const vis_predict_input & in, int d, int ne, std::vector<float> & score) override {
        const int il = in.il;
        const int E = p.n_expert;
        if (d < 1 || d > p.mlp_lookahead || il < 0 || il >= p.n_layer || !p.mlp_layer[il] || ne != E ||
            il + d >= (int) n_expert.size() || n_expert[il + d] != E || !in.hidden || in.n_embd != p.mlp_n_embd ||
            in.n_tokens <= 0) {
            return false;
        }
        if (cached_il != il || cached_step != in.step) {
            run(in);
        }
        score.assign(y_sum.begin() + (size_t) (d - 1) * E, y_sum.begin() + (size_t) d * E);
        return true;
    }

private:
    // the summed sigmoids of every head for layer in.il's ubatch
    void run(const vis_predict_input & in) {
        const int E = p.n_expert, O = p.mlp_lookahead * E;
        y_sum.assign(O, 0.0f);
        hist.resize(E);
        a.resize(p.mlp_hidden);
        y.resize(O);
        for (int64_t t = 0; t < in.n_tokens; ++t) {
            std::fill(hist.begin(), hist.end(), 0.0f);
            float w = 1.0f;
            for (int j = 0; j < p.mlp_history && in.il - j >= 0; ++j, w *= p.mlp_history_decay) {
                const int src = in.il - j;
                const int32_t * ids = nullptr;
                if (j == 0) {
                    ids = in.ids + t * in.k;
                } else if (n_expert[src] == E && last_step[src] == in.step &&
                           last[src].size() == (size_t) in.n_tokens * in.k) {
                    ids = last[src].data() + t * in.k;
                }
                if (!ids) {
                    continue;  // not a MoE layer, or it did not route this ubatch: no history term (as in training)
                }
                for (int b = 0; b < in.k; ++b) {
                    if (ids[b] >= 0 && ids[b] < E) {
                        hist[ids[b]] += w;
                    }
                }
            }
            vis_mlp_forward(p, in.il, hist.data(), in.hidden + t * in.hidden_stride, a.data(), y.data());
            for (int o = 0; o < O; ++o) {
                y_sum[o] += 1.0f / (1.0f + std::exp(-y[o]));
            }
        }
        cached_il   = in.il;
        cached_step = in.step;
    }

    std::vector<int> n_expert;
    vis_predict_profile p;
    std::vector<std::vector<int32_t>> last;
    std::vector<uint64_t> last_step;
    int cached_il = -1;
    uint64_t cached_step = UINT64_MAX;
    std::vector<float> hist, a, y, y_sum;
};

} // namespace

std::unique_ptr<vis_moe_predictor> vis_moe_predictor_make_mlp(const std::vector<int> & n_expert,
                                                              const vis_predict_profile * profile) {
    const std::string make = "make one with: pyvis calibrate predictor -m MODEL --corpus TEXT --mlp --out FILE";
    if (!profile) {
        throw std::runtime_error("vis-moe: --moe-predict mlp needs --moe-predict-profile FILE holding the MLP; " + make);
    }
    if (!profile->has_mlp()) {
        throw std::runtime_error("vis-moe: --moe-predict-profile " + profile->path + " holds no MLP (it was fitted "
                                 "without --mlp; it serves --moe-predict coact / freq): " + make);
    }
    if ((int) n_expert.size() != profile->n_layer) {
        throw std::runtime_error("vis-moe: --moe-predict-profile " + profile->path + ": " +
                                 std::to_string(profile->n_layer) + " layers, the model has " +
                                 std::to_string(n_expert.size()) + "; " + make);
    }
    return std::make_unique<mlp_predictor>(n_expert, *profile);
}
