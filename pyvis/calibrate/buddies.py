"""Buddy calibration (``pyvis calibrate buddies``): the profile that ``--moe-substitute buddy`` and ``--moe-sub-tae pN``
read (docs/substitution.md; BuddyMoE §3, ``../shared/papers/buddymoe-expert-substitution.txt``).

Input: routing traces (:func:`pyvis.runtime.trace.load`; ``--trace``), or a text run through our ``llama-perplexity``
with ``--moe-trace`` (``--corpus``).  Per MoE layer, over the trace rows (one per token) of that layer:

* activations ``A[i]`` = rows whose top-k holds i; co-activations ``C[i, j]`` = rows holding both i and j (i != j);
* Laplace smoothing: ``M[i, j] = C[i, j] + eps`` for j != i, ``M[i, i] = 0``; ``q(j|i) = M[i, j] / sum_j M[i, j]``;
* buddy list of i (CFT): peers sorted by q(j|i) descending (ties: lower id), the shortest prefix whose cumulative q
  reaches alpha, at most k_max long (k_max <= E - 1) and at least 1 long when ``A[i] > 0``; experts never seen: no
  buddies (-1);
* TAE of a row: ``p = w / sum(w)`` (float64) over its k gate weights, ``TAE = -sum p ln p / ln k`` (k = 1: 0);
  the profile stores the percentiles 0..100 (``np.percentile``) per layer, NaN for layers without routing or weights;
* ``expert.freq[l, i] = A[i] / rows of layer l`` (sums to k over a traced layer).

The routed ids are used (``Trace.ids``), not the executed ones of a run with substitution on.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..runtime import profile as prof
from ..runtime.trace import Trace, TraceError
from .inputs import CalibrationError, add_input_args, check_traces, traces_from_args

DEFAULT_ALPHA = 0.9
DEFAULT_K_MAX = 8
DEFAULT_SMOOTHING = 1e-3
_CHUNK_ROWS = 1 << 14


# --------------------------------------------------------------------------
# the maths, one layer at a time
# --------------------------------------------------------------------------
def coactivation(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """``(C [E, E] int64 with a zero diagonal, A [E] int64)`` of the rows ``ids [N, k]``."""
    ids = np.asarray(ids, np.int64)
    E = int(n_expert)
    A = np.bincount(ids.ravel(), minlength=E).astype(np.int64)
    C = np.zeros(E * E, np.int64)
    k = ids.shape[1] if ids.ndim == 2 else 0
    if k > 1:
        off = ~np.eye(k, dtype=bool)
        for s in range(0, len(ids), _CHUNK_ROWS):
            x = ids[s: s + _CHUNK_ROWS]
            pairs = (x[:, :, None] * E + x[:, None, :])[:, off]
            C += np.bincount(pairs.ravel(), minlength=E * E)
    return C.reshape(E, E), A


def conditional_q(C: np.ndarray, smoothing: float) -> np.ndarray:
    """``q [E, E]`` float64: ``q(j|i)`` after Laplace smoothing, zero diagonal (rows of a smoothed-away expert with
    no co-activation at all, possible only with smoothing 0: uniform over its peers)."""
    E = C.shape[0]
    M = C.astype(np.float64) + float(smoothing)
    off = ~np.eye(E, dtype=bool)
    M[~off] = 0.0
    s = M.sum(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(s > 0, M / s, off / max(E - 1, 1))
    q[~off] = 0.0
    return q


def buddy_lists(q: np.ndarray, active: np.ndarray, alpha: float, k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """CFT lists: ``(ids [E, k_max] int32, q [E, k_max] float32)``, best first, -1 / 0 padded."""
    E = q.shape[0]
    order = np.argsort(-q, axis=1, kind="stable")                    # ties: the lower id first
    qs = np.take_along_axis(q, order, axis=1)
    cum = np.cumsum(qs, axis=1)
    n = (cum < alpha - 1e-12).sum(1) + 1                               # shortest prefix with cum >= alpha
    n = np.minimum(np.minimum(n, (qs > 0).sum(1)), k_max)             # only peers with q > 0, at most k_max
    n = np.where(np.asarray(active, bool), n, 0)
    ids = np.full((E, k_max), -1, np.int32)
    qo = np.zeros((E, k_max), np.float32)
    w = min(k_max, E)
    keep = np.arange(w)[None, :] < n[:, None]
    ids[:, :w] = np.where(keep, order[:, :w], -1)
    qo[:, :w] = np.where(keep, qs[:, :w], 0.0)
    return ids, qo


def token_tae(weights: np.ndarray) -> np.ndarray:
    """``[N]`` float64 TAE of each row's gate weights; NaN where they are missing, negative or sum to 0."""
    w = np.asarray(weights, np.float64)
    N, k = w.shape
    s = w.sum(1)
    ok = np.isfinite(w).all(1) & (w >= 0).all(1) & (s > 0)
    out = np.full(N, np.nan)
    if k == 1:
        out[ok] = 0.0
        return out
    p = w[ok] / s[ok, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(1)
    out[ok] = ent / np.log(k)
    return out


def tae_quantiles(tae: np.ndarray) -> np.ndarray:
    """``[101]`` float64 percentiles 0..100 of the finite values (all NaN if none)."""
    v = np.asarray(tae, np.float64)
    v = v[np.isfinite(v)]
    if not len(v):
        return np.full(prof.N_QUANTILES, np.nan)
    return np.percentile(v, np.arange(prof.N_QUANTILES, dtype=np.float64))


# --------------------------------------------------------------------------
# the whole model
# --------------------------------------------------------------------------
@dataclass
class BuddyFit:
    n_layer: int
    n_expert: int
    k: int
    alpha: float
    k_max: int
    smoothing: float
    ids: np.ndarray          # [L, E, k_max] int32
    q: np.ndarray            # [L, E, k_max] float32
    tae: np.ndarray          # [L, 101] float64
    freq: np.ndarray         # [L, E] float32
    rows: np.ndarray         # [L] int64, trace rows of each layer
    n_tokens: int
    n_tae: np.ndarray = field(default=None)   # [L] rows with usable gate weights

    def summary(self) -> str:
        """One line per layer with routing: rows, experts seen, mean and largest buddy list, TAE p10 / p50."""
        out = [f"buddies: alpha {self.alpha:g}, k_max {self.k_max}, smoothing {self.smoothing:g}, top-{self.k} of "
               f"{self.n_expert} experts, {self.n_tokens} tokens",
               "layer    rows  seen  mean|B|  max|B|  TAE p10  TAE p50"]
        traced = np.flatnonzero(self.rows)
        sizes = [(self.ids[il] >= 0).sum(1)[self.freq[il] > 0] for il in traced]
        for il, sz in zip(traced, sizes):
            out.append(f"{il:5d}  {self.rows[il]:6d}  {len(sz):4d}  {_mean(sz):7.2f}  {_max(sz):6d}  "
                       f"{self.tae[il, 10]:7.3f}  {self.tae[il, 50]:7.3f}")
        if len(traced) > 1:
            s = np.concatenate(sizes)
            out.append(f" mean  {'':6s}  {'':4s}  {_mean(s):7.2f}  {_max(s):6d}  "
                       f"{_mean(self.tae[traced, 10]):7.3f}  {_mean(self.tae[traced, 50]):7.3f}")
        return "\n".join(out)


def _mean(a) -> float:
    a = np.asarray(a, np.float64)
    a = a[np.isfinite(a)]
    return float(a.mean()) if len(a) else float("nan")


def _max(a) -> int:
    return int(np.max(a)) if len(a) else 0


def fit(traces: list[Trace], n_layer: int, n_expert: int, alpha: float = DEFAULT_ALPHA, k_max: int = DEFAULT_K_MAX,
        smoothing: float = DEFAULT_SMOOTHING, progress: Callable[[int, int], None] | None = None) -> BuddyFit:
    """Buddy lists, TAE quantiles and activation shares of every layer of a model from its routing traces."""
    if not 0 < alpha <= 1:
        raise CalibrationError(f"--alpha {alpha}: must be in (0, 1]")
    if k_max < 1:
        raise CalibrationError(f"--k-max {k_max}: must be at least 1")
    k_max = min(int(k_max), max(int(n_expert) - 1, 1))      # no list is longer than the peers of an expert
    if not smoothing >= 0 or not np.isfinite(smoothing):
        raise CalibrationError(f"--smoothing {smoothing}: must be >= 0")
    k = check_traces(traces, n_layer, n_expert)
    L, E = int(n_layer), int(n_expert)
    C = np.zeros((L, E, E), np.int64)
    A = np.zeros((L, E), np.int64)
    rows = np.zeros(L, np.int64)
    taes: list[list[np.ndarray]] = [[] for _ in range(L)]
    total, done = sum(len(t) for t in traces), 0
    n_tokens = 0
    for t in traces:
        per_layer = []
        for il in t.layers():
            m = t.layer == il
            ids = t.ids[m]
            for s in range(0, len(ids), _CHUNK_ROWS):
                c, a = coactivation(ids[s: s + _CHUNK_ROWS], E)
                C[il] += c
                A[il] += a
                done += min(_CHUNK_ROWS, len(ids) - s)
                if progress:
                    progress(done, total)
            taes[il].append(token_tae(t.weights[m]))
            rows[il] += len(ids)
            per_layer.append(len(ids))
        n_tokens += max(per_layer, default=0)
    ids = np.full((L, E, k_max), -1, np.int32)
    q = np.zeros((L, E, k_max), np.float32)
    tae = np.full((L, prof.N_QUANTILES), np.nan)
    n_tae = np.zeros(L, np.int64)
    for il in np.flatnonzero(rows):
        ids[il], q[il] = buddy_lists(conditional_q(C[il], smoothing), A[il] > 0, alpha, k_max)
        v = np.concatenate(taes[il])
        n_tae[il] = int(np.isfinite(v).sum())
        tae[il] = tae_quantiles(v)
    freq = (A / np.maximum(rows, 1)[:, None]).astype(np.float32)
    return BuddyFit(L, E, k, float(alpha), int(k_max), float(smoothing), ids, q, tae, freq, rows, n_tokens, n_tae)


def write(fit_: BuddyFit, out: str | os.PathLike, fingerprint: dict, source: str,
          model_path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The profile of a fit (:func:`pyvis.runtime.profile.write_buddy_profile`)."""
    return prof.write_buddy_profile(out, fingerprint, fit_.ids, fit_.q, fit_.tae, fit_.alpha, fit_.k_max, fit_.k,
                                    fit_.n_tokens, source, freq=fit_.freq, smoothing=fit_.smoothing,
                                    model_path=model_path, force=force)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _cmd_buddies(args) -> int:
    from ..progress import Progress
    from ..testbed.quality import QualityError
    from .inputs import log
    try:
        if not Path(args.model).is_file():
            raise CalibrationError(f"model not found: {args.model}")
        out = Path(args.out)
        prof.check_output_path(out, Path(args.model), prof.KIND, args.force)     # before minutes of work
        fp = prof.model_fingerprint(args.model)
        traces, source = traces_from_args(args)
        total = sum(len(t) for t in traces)
        r = fit(traces, fp["n_layer"], fp["n_expert"], args.alpha, args.k_max, args.smoothing,
                progress=Progress("buddies", total, unit="rows", scale=1))
        if r.k_max != args.k_max:
            log(f"--k-max {args.k_max}: an expert has only {r.k_max} peers, the lists hold at most {r.k_max}")
        if not r.rows.any():
            raise CalibrationError("the traces hold no routing records")
        if not r.n_tae.any():
            log("warning: the traces hold no gate weights: TAE quantiles are NaN (--moe-sub-tae pN cannot use them)")
        path = write(r, out, fp, source, model_path=args.model, force=args.force)
    except (CalibrationError, prof.ProfileError, TraceError, QualityError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(r.summary())
    print(f"\nwrote {path} (router hash {fp['router_hash']:016x})")
    return 0


def register(sub) -> None:
    """``pyvis calibrate buddies`` (``sub``: the subparsers of ``pyvis calibrate``)."""
    s = sub.add_parser("buddies", help="buddy lists and TAE quantiles for --moe-substitute buddy / --moe-sub-tae pN",
                       description="Fit a substitution profile (GGUF sidecar, docs/substitution.md) from routing "
                       "traces (--trace) or from a text run through llama-perplexity --moe-trace (--corpus): "
                       "per MoE layer, the buddy list of every expert (co-activation, cumulative frequency "
                       "threshold) and the percentiles of the token routing entropy (TAE).")
    add_input_args(s, "profile")
    s.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, metavar="A",
                   help=f"CFT coverage: buddies cover this share of q(.|i) (default: {DEFAULT_ALPHA})")
    s.add_argument("--k-max", type=int, default=DEFAULT_K_MAX, metavar="N",
                   help=f"at most N buddies per expert (default: {DEFAULT_K_MAX})")
    s.add_argument("--smoothing", type=float, default=DEFAULT_SMOOTHING, metavar="EPS",
                   help=f"Laplace smoothing added to each co-activation count (default: {DEFAULT_SMOOTHING:g})")
    s.set_defaults(fn=_cmd_buddies)
