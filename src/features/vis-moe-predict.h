// vis-moe-predict.h - expert predictors: which experts layers l+1 .. l+W will route, known at layer l
// (src/features/vis-moe-predict.cpp; docs/prediction.md).
//
// A predictor scores the experts of a later layer; the prefetch engine (vis-moe-prefetch.h) reads the best
// ones in the background.  Predictions only decide *when* bytes arrive, never what is computed: outputs are
// the same with every predictor.  Implementations:
//   next-router  the routers of layers l+1 .. l+W applied to layer l's FFN input (computed in the graph, one
//                small matmul per layer ahead; parameter-free, the routers are resident)
//   coact        co-activation counts C_d[l][i][j] of expert i at layer l firing with j at layer l+d (WiSP
//                Appendix C), learned online from the routing of every step
//   freq         the most used experts of the target layer so far (the baseline every predictor is reported
//                against)
//   mlp          the VisMMOE lookahead MLP (§3.3) fitted by pyvis calibrate predictor --mlp: routing-history
//                histogram + this layer's FFN input -> bottleneck -> scores of layers l+1 .. l+W
//                (src/features/vis-moe-predict-mlp.{h,cpp}; needs a profile with the MLP)
//   random       random scores, for tests (stress: predictions that are mostly wrong)
// coact and freq can start from a calibrated predictor profile (--moe-predict-profile, vis-moe-profile.h): its
// tables are turned back into counts and online learning goes on counting on top of them.
#pragma once

#include "vis-moe-settings.h"

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

struct vis_predict_profile;

// the predict op's source holding the layer's FFN input (mlp): after the ids, the dependency and the W logits
constexpr int VIS_PREDICT_SRC_HIDDEN = 2 + VIS_MAX_LOOKAHEAD;

// what a predictor sees when layer il has routed a ubatch
struct vis_predict_input {
    int             il       = -1;
    uint64_t        step     = 0;         // ubatch serial: layers of one ubatch share it
    int64_t         n_tokens = 0;
    int             k        = 0;         // experts per token at il
    const int32_t * ids      = nullptr;   // [n_tokens][k] routed experts of layer il
    // next-router: router logits of layer il+d for every token, [n_tokens][n_expert(il+d)] with `stride` floats per
    // token; null where the graph did not compute them
    const float *   logits[VIS_MAX_LOOKAHEAD + 1] = {};
    int64_t         stride[VIS_MAX_LOOKAHEAD + 1] = {};
    // mlp: layer il's FFN input (the router's input), [n_tokens][n_embd] with hidden_stride floats per token; null
    // where the graph did not pass it
    const float *   hidden        = nullptr;
    int64_t         n_embd        = 0;
    int64_t         hidden_stride = 0;
};

class vis_moe_predictor {
public:
    virtual ~vis_moe_predictor() = default;
    virtual const char * name() const = 0;
    // does it read the routers' logits of the layers ahead (the graph computes them only then)?
    virtual bool wants_logits() const { return false; }
    // does it read the layer's FFN input (the graph passes it to the predict op only then)?
    virtual bool wants_hidden() const { return false; }
    // learn from layer in.il's routing (every managed-or-not MoE layer, every ubatch, in layer order)
    virtual void observe(const vis_predict_input & in) { (void) in; }
    // score the n_expert experts of layer in.il + d (higher = more likely); false = no prediction
    virtual bool predict(const vis_predict_input & in, int d, int n_expert, std::vector<float> & score) = 0;
};

// n_expert[il]: experts of layer il (0: not a MoE layer); lookahead: W; profile: seeds coact and freq (their counts
// start as the profile's: C_d[l][i, j] = P_d[l][i, j] * k * freq[l][i] * n_tokens for d = 1..min(W, the profile's W),
// uses[l][e] = freq[l][e] * n_tokens; coact sums the rows by the profile's weighting); mlp runs its MLP (throws
// std::runtime_error without a profile holding one); the others ignore it
std::unique_ptr<vis_moe_predictor> vis_moe_predictor_make(int mode, const std::vector<int> & n_expert, int lookahead,
                                                          uint32_t seed = 1234,
                                                          const vis_predict_profile * profile = nullptr);

// the --moe-predict value of a mode ("next-router", ...)
const char * vis_predict_mode_name(int mode);

// the indices of the `b` largest scores (ties: lower index first), best first
std::vector<int32_t> vis_predict_top(const std::vector<float> & score, int b);

// recall@k of a prediction: |pred & actual| / |actual| over the distinct experts of `actual`
double vis_predict_recall(const std::vector<int32_t> & pred, const int32_t * actual, int64_t n_actual);
