"""The VisMMOE lookahead MLP (§3.3, ``../shared/papers/vismmoe-visual-expert-affinity.txt``): its weights, its
features and its forward pass, exactly as the runtime computes them (``--moe-predict mlp``,
``src/features/vis-moe-predict-mlp.cpp``; docs/prediction-calibration.md "The lookahead MLP").  Fitted by :mod:`pyvis.calibrate.mlp`,
stored in the predictor profile (:mod:`pyvis.runtime.predict_profile`).

At MoE layer l, for one token:

    x = [hist; h]      hist[e] = sum_{j < history} decay^j [e in S_{l-j}]   (a term only where l-j is a MoE layer
                                                                             that routed the same tokens)
                       h       = layer l's FFN input (the router's input), n_embd floats
    a = relu(W1[l] x + b1[l])                 H units (the input standardisation is folded into W1, b1)
    y = W2[l] a + b2[l]                       lookahead * E logits, head d-1 = layer l+d
    score of expert e at layer l+d = sigmoid(y[(d-1) E + e]); a ubatch sums its tokens' sigmoids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_HIDDEN = 64
DEFAULT_HISTORY = 2
DEFAULT_HISTORY_DECAY = 0.5


@dataclass
class MlpWeights:
    lookahead: int           # heads: d = 1..lookahead
    hidden: int              # H
    n_embd: int
    history: int             # routing-history layers (1 = layer l only)
    history_decay: float
    gamma: float             # the decay of the training targets (provenance; the runtime does not use it)
    layers: np.ndarray       # [L] int32: 1 = a trained source layer
    w1: np.ndarray           # [L, H, E + n_embd] float32
    b1: np.ndarray           # [L, H]
    w2: np.ndarray           # [L, lookahead * E, H]
    b2: np.ndarray           # [L, lookahead * E]

    @property
    def n_expert(self) -> int:
        return int(self.w1.shape[2]) - self.n_embd

    def logits(self, il: int, hist: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """``[T, lookahead * E]`` logits of source layer ``il`` for ``hist [T, E]`` and ``hidden [T, n_embd]``."""
        x = np.concatenate([np.asarray(hist, np.float32), np.asarray(hidden, np.float32)], axis=1)
        a = np.maximum(x @ self.w1[il].T + self.b1[il], 0.0)
        return a @ self.w2[il].T + self.b2[il]

    def scores(self, il: int, d: int, hist: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """``[T, E]`` per-token scores (sigmoids) for layer ``il + d``."""
        E = self.n_expert
        y = self.logits(il, hist, hidden)[:, (d - 1) * E: d * E]
        return 1.0 / (1.0 + np.exp(-y))


def history(masks: dict, il: int, n_hist: int, decay: float) -> np.ndarray:
    """``[T, E]`` routing-history histogram of layer ``il``: ``sum_j decay^j masks[il - j]`` over the MoE layers
    ``il - j`` (j < n_hist) present in ``masks`` ({layer: [T, E] bool})."""
    h = masks[il].astype(np.float32)
    for j in range(1, n_hist):
        if il - j in masks:
            h = h + np.float32(decay ** j) * masks[il - j]
    return h
