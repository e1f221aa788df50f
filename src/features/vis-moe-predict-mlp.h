// vis-moe-predict-mlp.h - the VisMMOE lookahead MLP predictor (--moe-predict mlp; src/features/vis-moe-predict-mlp.cpp,
// docs/prediction.md "The lookahead MLP").
//
// Fitted offline by `pyvis calibrate predictor --mlp` (pyvis/calibrate/mlp.py) and carried by the predictor
// profile (vis-moe-profile.h: vis_predict_profile::mlp_*).  At MoE layer l, per token of the ubatch:
//   x = [hist; h]   hist[e] = sum_{j < history} decay^j [e routed at MoE layer l-j]   (routing-history histogram)
//                   h       = layer l's FFN input (the router's input), n_embd floats
//   a = relu(W1 x + b1)            (bottleneck of H; the input standardisation is folded into W1, b1)
//   y = W2 a + b2                  (lookahead * n_expert logits: one head per distance d)
//   score of expert e at layer l+d = sigmoid(y[(d-1) n_expert + e])
// Pooling over a ubatch: the tokens' sigmoids are summed (as next-router sums its softmaxes).
#pragma once

#include "vis-moe-predict.h"

#include <memory>
#include <vector>

struct vis_predict_profile;

// the logits y [p.mlp_lookahead * p.n_expert] of source layer il for one token: hist [p.n_expert], hidden
// [p.mlp_n_embd]; `a` is scratch of p.mlp_hidden floats.  The reference the tests check against NumPy.
void vis_mlp_forward(const vis_predict_profile & p, int il, const float * hist, const float * hidden, float * a,
                     float * y);

// the mlp predictor over `profile`'s MLP (copied: the profile may go away); throws
// std::runtime_error naming the fix when there is no profile, or it holds no MLP
std::unique_ptr<vis_moe_predictor> vis_moe_predictor_make_mlp(const std::vector<int> & n_expert,
                                                              const vis_predict_profile * profile);
