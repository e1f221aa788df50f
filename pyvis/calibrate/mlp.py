"""The lookahead MLP of ``--moe-predict mlp`` (VisMMOE §3.3): capture its training data, fit it in NumPy, and score it
(with the next-router predictor, which needs the same hidden states) on held-out text.  Used by
``pyvis calibrate predictor --mlp`` (:mod:`pyvis.calibrate.predictor`); what the MLP computes is
:mod:`pyvis.runtime.predict_mlp`'s; docs/prediction-calibration.md "The lookahead MLP".

**Capture.**  Routing traces (``--moe-trace``) carry no hidden states, so ``--mlp`` runs the model itself through
the Python bindings with llama.cpp's eval callback (:class:`pyvis.testbed._llm.Runner`, as ``pyvis report`` does):
per MoE layer it copies ``ffn_moe_topk-<il>`` (the routed experts) and the second source of ``ffn_moe_logits-<il>``
(the router matmul's input: the layer's FFN input, exactly what the runtime's predict op receives), for every token
(every token outputs logits, so the last layer computes all rows).  Text is cut like llama-perplexity: the first
``chunks`` chunks of ``ctx`` tokens, BOS first, a fresh KV cache each; the BOS rows are dropped.  Hidden states are
kept as float16 (tokens x MoE layers x n_embd x 2 bytes).

**Training**, per source layer l (a MoE layer whose l+1 is one): inputs = the routing-history histogram and the
hidden state standardised with the training mean and deviation (folded into W1, b1 when written); targets = for
d = 1..W the multi-hot of the experts at l+d, the BCE of head d weighted by gamma^(d-1) (VisMMOE's decayed targets;
a head whose l+d is not a MoE layer has weight 0).  Adam, minibatches of 512, output biases started at the
training frequencies (the MLP starts as the frequency predictor); the last tenth of the training tokens is kept
aside and each layer keeps the epoch with the lowest loss on it.
"""
from __future__ import annotations

import ctypes
import re
import time
from dataclasses import dataclass

import numpy as np

from ..runtime import predict
from ..runtime.predict_mlp import (DEFAULT_HIDDEN, DEFAULT_HISTORY, DEFAULT_HISTORY_DECAY, MlpWeights, history)
from .inputs import CalibrationError, log

DEFAULT_EPOCHS = 12
DEFAULT_LR = 2e-3
_BATCH = 512
_TOPK = re.compile(r"^ffn_moe_topk-(\d+)$")
_LOGITS = re.compile(r"^ffn_moe_logits-(\d+)$")


@dataclass
class Capture:
    """Routing and hidden states of a text run: every MoE layer that routed every token."""
    ids: np.ndarray         # [Lr, T, k] int32
    layers: np.ndarray      # [Lr] model layer numbers
    hidden: np.ndarray      # [Lr, T, n_embd] float16: each layer's FFN input
    source: str = ""

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[1])

    def routes(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(self.ids, self.layers)]

    def take(self, sl: slice) -> "Capture":
        return Capture(self.ids[:, sl], self.layers, self.hidden[:, sl], self.source)

    def split(self, holdout: float) -> tuple["Capture", "Capture"]:
        """The first ``1 - holdout`` of the tokens, and the rest."""
        cut = int(round(self.n_tokens * (1 - holdout)))
        if not 0 < holdout < 1 or cut < 1 or cut >= self.n_tokens:
            raise CalibrationError(f"--holdout {holdout}: {self.n_tokens} tokens leave nothing to fit or to evaluate")
        return self.take(slice(0, cut)), self.take(slice(cut, None))

    def save(self, path) -> None:
        np.savez(path, ids=self.ids, layers=self.layers, hidden=self.hidden, source=np.array(self.source))

    @classmethod
    def load(cls, path) -> "Capture":
        z = np.load(path)
        return cls(z["ids"], z["layers"], z["hidden"], str(z["source"]))


def capture(model: str, text: str, ctx: int = 512, chunks: int | None = None, threads: int | None = None,
            k: int | None = None) -> Capture:
    """Run ``text`` (a file or a named text) through ``model`` and capture every MoE layer's routing and FFN input."""
    from ..runtime import profile as prof
    from ..testbed import _llm, quality
    from ..testbed.corpus import CorpusError
    try:
        f, sha = quality._text_file(text)
    except (CorpusError, OSError) as e:
        raise CalibrationError(f"--corpus {text}: {e}") from e
    arch = prof.model_fingerprint(model)["arch"]
    kv = {f"{arch}.expert_used_count": int(k)} if k else None
    per_ids: dict[int, list] = {}
    per_h: dict[int, list] = {}

    def on_tensor(name, t):
        if m := _TOPK.match(name):
            per_ids.setdefault(int(m.group(1)), []).append(_llm.read_tensor(t))
            return
        il = int(_LOGITS.match(name).group(1))
        x = ctypes.cast(t, ctypes.POINTER(_llm.ggml_tensor)).contents
        src = x.src[1]
        if not src:
            raise CalibrationError(f"{name}: no input tensor to read the hidden state from")
        per_h.setdefault(il, []).append(_llm.read_tensor(src).astype(np.float16))

    with _llm.Runner(model, n_ctx=ctx, n_threads=threads, kv_overrides=kv, raw=True, on_tensor=on_tensor,
                     want=lambda n: _TOPK.match(n) is not None or _LOGITS.match(n) is not None) as run:
        toks = run.tokenize(f.read_text(encoding="utf-8", errors="replace"), add_bos=False)
        body = ctx - 1
        n = len(toks) // body if chunks is None else min(int(chunks), len(toks) // body)
        if n < 1:
            raise CalibrationError(f"--corpus {text}: {len(toks)} tokens, too short for one chunk of {ctx}")
        from ..progress import Progress
        bar = Progress("capture", n * ctx, unit="tokens", scale=1)
        t0 = time.monotonic()
        for i in range(n):
            run.eval_chunk([run.bos] + toks[i * body:(i + 1) * body])
            bar((i + 1) * ctx)
    log(f"captured {n} chunks of {ctx} tokens in {time.monotonic() - t0:.1f} s")
    layers = sorted(il for il in per_ids if len(per_ids[il]) == n and len(per_h.get(il, [])) == n)
    if not layers:
        raise CalibrationError(f"{model}: no MoE layer routed every chunk (not a MoE model?)")
    ids = np.stack([np.concatenate([p[1:] for p in per_ids[il]]) for il in layers]).astype(np.int32)
    hid = np.stack([np.concatenate([p[1:] for p in per_h[il]]) for il in layers])
    run_s = f"eval-callback capture -c {ctx} --chunks {n}" + (f" top-{k}" if k else "")
    return Capture(ids, np.array(layers), hid, f"corpus {f} sha256:{sha} ({run_s})")


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------
def _masks(cap: Capture, E: int) -> dict:
    return {int(il): predict.masks(cap.ids[a], E) for a, il in enumerate(cap.layers)}


def _adam(params, grads, state, lr, t, b1=0.9, b2=0.999, eps=1e-8):
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state[i]
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        p -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def _loss(X, Y, cw, W1, b1, W2, b2) -> float:
    y = np.maximum(X @ W1.T + b1, 0) @ W2.T + b2
    return float(((np.logaddexp(0, y) - Y * y) * cw).sum() / len(X))


def targets(M: dict, il: int, E: int, W: int, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """``(Y [T, W*E], cw [W*E])``: head d-1 = the multi-hot of layer il+d's experts, weighted ``gamma^(d-1)`` in the
    loss (VisMMOE's decayed targets, one head per distance); 0 where il+d is not a MoE layer of ``M``."""
    T = len(M[il])
    Y = np.zeros((T, W * E), np.float32)
    cw = np.zeros(W * E, np.float32)
    for d in range(1, W + 1):
        if il + d in M:
            Y[:, (d - 1) * E: d * E] = M[il + d]
            cw[(d - 1) * E: d * E] = gamma ** (d - 1)
    return Y, cw


def fit_mlp(cap: Capture, n_layer: int, n_expert: int, lookahead: int = predict.DEFAULT_LOOKAHEAD,
            hidden: int = DEFAULT_HIDDEN, n_hist: int = DEFAULT_HISTORY, decay: float = DEFAULT_HISTORY_DECAY,
            gamma: float = predict.DEFAULT_GAMMA, epochs: int = DEFAULT_EPOCHS, lr: float = DEFAULT_LR,
            seed: int = 0, progress=None) -> MlpWeights:
    """Fit the lookahead MLP on ``cap`` (see the module doc)."""
    L, E, W, H = int(n_layer), int(n_expert), int(lookahead), int(hidden)
    n_embd = int(cap.hidden.shape[2])
    M = _masks(cap, E)
    src = [il for il in sorted(M) if il + 1 in M]
    if not src:
        raise CalibrationError("the capture holds no pair of adjacent MoE layers to learn from")
    O, D = W * E, E + n_embd
    out = MlpWeights(W, H, n_embd, n_hist, decay, gamma, np.zeros(L, np.int32), np.zeros((L, H, D), np.float32),
                     np.zeros((L, H), np.float32), np.zeros((L, O, H), np.float32), np.zeros((L, O), np.float32))
    rng = np.random.default_rng(seed)
    T = cap.n_tokens
    n_val = T // 10 if T >= 200 else 0
    tr, va = slice(0, T - n_val), slice(T - n_val, T)
    done = 0
    for il in src:
        a = int(np.searchsorted(cap.layers, il))
        h = cap.hidden[a].astype(np.float32)
        mu, sd = h[tr].mean(0), h[tr].std(0) + 1e-6
        X = np.concatenate([history(M, il, n_hist, decay), (h - mu) / sd], axis=1).astype(np.float32)
        Y, cw = targets(M, il, E, W, gamma)
        f = np.clip(Y[tr].mean(0), 1e-3, 1 - 1e-3)
        W1 = (rng.standard_normal((H, D)) * np.sqrt(2.0 / D)).astype(np.float32)
        B1 = np.zeros(H, np.float32)
        W2 = (rng.standard_normal((O, H)) * 0.01).astype(np.float32)
        B2 = np.log(f / (1 - f)).astype(np.float32)
        params = [W1, B1, W2, B2]
        state = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
        Xt, Yt = X[tr], Y[tr]
        best = (_loss(X[va], Y[va], cw, *params) if n_val else np.inf, [p.copy() for p in params])
        step = 0
        for _ in range(epochs):
            perm = rng.permutation(len(Xt))
            for s in range(0, len(perm), _BATCH):
                idx = perm[s: s + _BATCH]
                xb, yb = Xt[idx], Yt[idx]
                z = xb @ W1.T + B1
                act = np.maximum(z, 0)
                y = act @ W2.T + B2
                dy = (1 / (1 + np.exp(-y)) - yb) * cw / len(idx)
                da = (dy @ W2) * (z > 0)
                grads = [da.T @ xb + 1e-4 * W1, da.sum(0), dy.T @ act + 1e-4 * W2, dy.sum(0)]
                step += 1
                _adam(params, grads, state, lr, step)
            if n_val:
                v = _loss(X[va], Y[va], cw, *params)
                if v < best[0]:
                    best = (v, [p.copy() for p in params])
            done += 1
            if progress:
                progress(done, len(src) * epochs)
        W1, B1, W2, B2 = best[1] if n_val else params
        # fold the standardisation: W1 [hist; (h - mu) / sd] = W1' [hist; h] + (b1' - b1)
        W1f = W1.copy()
        W1f[:, E:] = W1[:, E:] / sd
        out.w1[il], out.b1[il] = W1f, B1 - W1f[:, E:] @ mu
        out.w2[il], out.b2[il] = W2, B2
        out.layers[il] = 1
    return out


# --------------------------------------------------------------------------
# evaluation: the MLP and next-router next to frequency and coact (pyvis.runtime.predict.evaluate)
# --------------------------------------------------------------------------
def routers(model_path: str) -> dict:
    """``{layer: (W [E, n_embd] float32, bias [E] or None)}``: each MoE layer's router, dequantised."""
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(model_path)
    out: dict = {}
    for t in r.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.(weight|bias)", t.name)
        if m:
            a = dequantize(t.data, t.tensor_type).astype(np.float32)
            w, b = out.get(int(m.group(1)), (None, None))
            out[int(m.group(1))] = (a, b) if m.group(2) == "weight" else (w, a.reshape(-1))
    return out


class CaptureScorer:
    """A :class:`pyvis.runtime.predict.Model` look-alike for :func:`predict.evaluate` on one :class:`Capture`:
    ``frequency`` and ``coact`` from ``base``, ``mlp`` from the fitted weights, ``next-router`` from the routers of
    the layers ahead on each layer's FFN input (softmax per token; the runtime's predictor, offline)."""

    def __init__(self, base: predict.Model, cap: Capture, mlp: MlpWeights | None, router: dict | None):
        self.base, self.cap, self.mlp, self.router = base, cap, mlp, router
        self.freq, self.tables, self.weighting = base.freq, base.tables, base.weighting
        self._M = _masks(cap, base.freq.shape[1])
        self._logits: dict = {}

    @property
    def lookahead(self) -> int:
        return self.base.lookahead

    def _h(self, il: int) -> np.ndarray:
        return self.cap.hidden[int(np.searchsorted(self.cap.layers, il))].astype(np.float32)

    def scores(self, p: str, src: np.ndarray, il: int, d: int) -> np.ndarray:
        E = self.freq.shape[1]
        if p == "mlp":
            if self.mlp is None or not self.mlp.layers[il] or d > self.mlp.lookahead:
                return np.zeros(src.shape)
            if il not in self._logits:
                self._logits = {il: self.mlp.logits(il, history(self._M, il, self.mlp.history,
                                                                self.mlp.history_decay), self._h(il))}
            return 1 / (1 + np.exp(-self._logits[il][:, (d - 1) * E: d * E]))
        if p == "next-router":
            w, b = self.router[il + d]
            z = self._h(il) @ w.T + (0 if b is None else b)
            z = np.exp(z - z.max(1, keepdims=True))
            return z / z.sum(1, keepdims=True)
        return self.base.scores(p, src, il, d)


def evaluate(base: predict.Model, cap: Capture, mlp: MlpWeights | None, model_path: str, budgets: list[int],
             gamma: float, expert_bytes: np.ndarray) -> dict:
    """Held-out accuracy of frequency, coact, mlp and next-router on ``cap`` (:func:`predict.evaluate`'s dict)."""
    preds = predict.PREDICTORS + (("mlp",) if mlp is not None else ()) + ("next-router",)
    sc = CaptureScorer(base, cap, mlp, routers(model_path))
    return predict.evaluate(sc, cap.routes(), budgets, predictors=preds, gamma=gamma, expert_bytes=expert_bytes)
