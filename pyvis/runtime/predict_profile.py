"""Predictor profiles: the GGUF sidecar that ``--moe-predict-profile`` reads (docs/prediction-calibration.md, issue #16).

Written by ``pyvis calibrate predictor`` (:mod:`pyvis.calibrate.predictor`).  The fingerprint and provenance keys
are the buddy profile's (:mod:`pyvis.runtime.profile`: ``vis.model.arch``, ``vis.model.n_layer``,
``vis.model.n_expert``, ``vis.model.router_hash``, ``vis.profile.k``, ``vis.profile.n_tokens``,
``vis.profile.source``), with ``vis.profile.kind = "predictor"`` and ``vis.profile.version = 1``.  Its own:

    vis.predict.lookahead   u32     W: the tables cover d = 1..W
    vis.predict.weighting   string  "conditional" or "count": how the runtime should sum the rows (predict.Model)
    expert.freq             F32 [n_layer, n_expert]             share of layer l's tokens that selected e (sums to k)
    predict.coact           F32 [W, n_layer, n_expert, n_expert] [d-1, l, i, j] = P(j at l+d | i at l) / k:
                                                                 rows sum to 1, or are all 0 (i never seen at l, or
                                                                 l+d not a traced MoE layer)

Optional, the lookahead MLP of ``--moe-predict mlp`` (``pyvis calibrate predictor --mlp``;
:mod:`pyvis.runtime.predict_mlp` for what it computes; a profile without them serves coact / freq only):

    vis.predict.mlp.lookahead      u32   W_m: heads for d = 1..W_m
    vis.predict.mlp.hidden         u32   H
    vis.predict.mlp.n_embd         u32   hidden-state width (the model's n_embd)
    vis.predict.mlp.history        u32   routing-history layers (1 = layer l only)
    vis.predict.mlp.history_decay  f32   weight of layer l-j's experts: decay^j
    vis.predict.mlp.gamma          f32   decay of the training targets (provenance)
    predict.mlp.layers  I32 [L]                  1 = a trained source layer
    predict.mlp.w1      F32 [L, H, E + n_embd]   (input standardisation folded in)
    predict.mlp.b1      F32 [L, H]
    predict.mlp.w2      F32 [L, W_m * E, H]
    predict.mlp.b2      F32 [L, W_m * E]

Shapes are numpy's; GGUF's ``ne`` is reversed (``predict.coact``: ne = [E, E, L, W]).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import profile as prof
from .predict import WEIGHTINGS, Model
from .predict_mlp import MlpWeights

KIND = "predictor"
VERSION = 1
K_LOOKAHEAD, K_WEIGHTING = "vis.predict.lookahead", "vis.predict.weighting"
T_FREQ, T_COACT = prof.T_FREQ, "predict.coact"
ROW_TOL = 1e-3          # a stored row must sum to 1 within this, or be all 0
K_MLP = "vis.predict.mlp."
T_MLP = ("layers", "w1", "b1", "w2", "b2")      # tensors predict.mlp.<name>


@dataclass
class PredictorProfile:
    path: Path
    arch: str
    n_layer: int
    n_expert: int
    router_hash: int
    k: int                  # top-k of the calibration routing
    n_tokens: int
    source: str
    lookahead: int
    weighting: str
    freq: np.ndarray        # [n_layer, n_expert] float32
    coact: np.ndarray       # [lookahead, n_layer, n_expert, n_expert] float32, row-normalised
    mlp: MlpWeights | None = None   # the lookahead MLP, if fitted (--mlp)

    def model(self, weighting: str | None = None) -> Model:
        """The predictors of :mod:`pyvis.runtime.predict` on these tables."""
        return Model(self.freq.astype(np.float64), self.coact.astype(np.float64), weighting or self.weighting)


def write_predictor_profile(path: str | os.PathLike, fingerprint: dict, freq, coact, k: int, n_tokens: int,
                            source: str, weighting: str = "conditional",
                            model_path: str | os.PathLike | None = None, mlp: MlpWeights | None = None,
                            force: bool = False) -> Path:
    """Write a predictor profile (atomically; never over ``model_path`` or a file that is not a vis profile), with
    the lookahead MLP if given."""
    L, E = int(fingerprint["n_layer"]), int(fingerprint["n_expert"])
    freq = np.ascontiguousarray(freq, np.float32)
    coact = np.ascontiguousarray(coact, np.float32)
    if freq.shape != (L, E):
        raise prof.ProfileError(f"{T_FREQ}: shape {freq.shape}, expected {(L, E)}")
    if coact.ndim != 4 or coact.shape[1:] != (L, E, E) or coact.shape[0] < 1:
        raise prof.ProfileError(f"{T_COACT}: shape {coact.shape}, expected (W, {L}, {E}, {E}) with W >= 1")
    if weighting not in WEIGHTINGS:
        raise prof.ProfileError(f"weighting {weighting!r}: one of {', '.join(WEIGHTINGS)}")
    _check_rows(coact, Path(path))
    if mlp is not None:
        _check_mlp(mlp, L, E, Path(path))
    w = prof.start_profile(path, fingerprint, KIND, VERSION, k, n_tokens, source, model_path, force)
    w.add_uint32(K_LOOKAHEAD, int(coact.shape[0]))
    w.add_string(K_WEIGHTING, weighting)
    w.add_tensor(T_FREQ, freq)
    w.add_tensor(T_COACT, coact)
    if mlp is not None:
        for key in ("lookahead", "hidden", "n_embd", "history"):
            w.add_uint32(K_MLP + key, int(getattr(mlp, key)))
        w.add_float32(K_MLP + "history_decay", float(mlp.history_decay))
        w.add_float32(K_MLP + "gamma", float(mlp.gamma))
        w.add_tensor("predict.mlp.layers", np.ascontiguousarray(mlp.layers, np.int32))
        for t in T_MLP[1:]:
            w.add_tensor(f"predict.mlp.{t}", np.ascontiguousarray(getattr(mlp, t), np.float32))
    return prof.finish_profile(w, path)


def _mlp_shapes(mlp_or_keys, L: int, E: int) -> dict:
    g = (lambda k: mlp_or_keys[k]) if isinstance(mlp_or_keys, dict) else (lambda k: getattr(mlp_or_keys, k))
    H, n, O = int(g("hidden")), int(g("n_embd")), int(g("lookahead")) * E
    return {"layers": (L,), "w1": (L, H, E + n), "b1": (L, H), "w2": (L, O, H), "b2": (L, O)}


def _check_mlp(mlp: MlpWeights, L: int, E: int, path: Path) -> None:
    fix = prof.fix_for(KIND, path) + " with --mlp"
    for name, shape in _mlp_shapes(mlp, L, E).items():
        a = np.asarray(getattr(mlp, name))
        if a.shape != shape:
            raise prof.ProfileError(f"{path}: predict.mlp.{name} is {a.shape}, expected {shape}; {fix}")
        if not np.isfinite(a).all():
            raise prof.ProfileError(f"{path}: predict.mlp.{name} holds a non-finite value; {fix}")
    if not (1 <= mlp.lookahead <= 64 and 1 <= mlp.history <= 64 and 0 <= mlp.history_decay <= 1):
        raise prof.ProfileError(f"{path}: MLP lookahead {mlp.lookahead} / history {mlp.history} / decay "
                                f"{mlp.history_decay} out of range; {fix}")
    if not np.isin(mlp.layers, (0, 1)).all():
        raise prof.ProfileError(f"{path}: predict.mlp.layers holds values other than 0 and 1; {fix}")


def _read_mlp(r, p: Path, L: int, E: int) -> MlpWeights | None:
    if prof.optional_key(r, K_MLP + "lookahead") is None:
        return None
    keys = {}
    for key, typ in (("lookahead", int), ("hidden", int), ("n_embd", int), ("history", int),
                     ("history_decay", float), ("gamma", float)):
        v = prof.optional_key(r, K_MLP + key)
        if v is None or not isinstance(v, (int, float)):
            raise prof.ProfileError(f"{p}: key {K_MLP + key} is missing or has the wrong type; "
                                    + prof.fix_for(KIND, p))
        keys[key] = typ(v)
    if min(keys["lookahead"], keys["hidden"], keys["n_embd"], keys["history"]) < 1:
        raise prof.ProfileError(f"{p}: an MLP size key is 0; {prof.fix_for(KIND, p)}")
    shapes = _mlp_shapes(keys, L, E)
    t = {name: prof.profile_tensor(r, f"predict.mlp.{name}", np.int32 if name == "layers" else np.float32, shape, p,
                                   kind=KIND) for name, shape in shapes.items()}
    mlp = MlpWeights(keys["lookahead"], keys["hidden"], keys["n_embd"], keys["history"], keys["history_decay"],
                     keys["gamma"], **t)
    _check_mlp(mlp, L, E, p)
    return mlp


def _check_rows(coact: np.ndarray, path: Path) -> None:
    s = coact.astype(np.float64).sum(-1)
    bad = ~(np.isfinite(s) & ((np.abs(s - 1) <= ROW_TOL) | (s == 0))) | (coact < 0).any(-1)
    if bad.any():
        d, il, i = (int(x) for x in np.argwhere(bad)[0])
        raise prof.ProfileError(f"{path}: {T_COACT}[{d}, {il}, {i}] is not a distribution (sums to {s[d, il, i]:g}, "
                                f"or has a negative entry); {prof.fix_for(KIND, path)}")


def read_predictor_profile(path: str | os.PathLike, model_path: str | os.PathLike | None = None) -> PredictorProfile:
    """Read and check a predictor profile; with ``model_path``, also check it was calibrated for that model."""
    p = Path(path)
    r, meta = prof.open_profile(p, KIND, VERSION, ((K_LOOKAHEAD, int), (K_WEIGHTING, str)))
    L, E, W = meta[prof.K_NLAYER], meta[prof.K_NEXPERT], meta[K_LOOKAHEAD]
    fix = prof.fix_for(KIND, p)
    if W < 1:
        raise prof.ProfileError(f"{p}: {K_LOOKAHEAD} = {W}: must be at least 1; {fix}")
    if meta[K_WEIGHTING] not in WEIGHTINGS:
        raise prof.ProfileError(f"{p}: {K_WEIGHTING} = {meta[K_WEIGHTING]!r} is not one of {', '.join(WEIGHTINGS)}; "
                                + fix)
    freq = prof.profile_tensor(r, T_FREQ, np.float32, (L, E), p, kind=KIND)
    coact = prof.profile_tensor(r, T_COACT, np.float32, (W, L, E, E), p, kind=KIND)
    mlp = _read_mlp(r, p, L, E)
    del r
    _check_rows(coact, p)
    out = PredictorProfile(p, meta[prof.K_ARCH], L, E, int(meta[prof.K_HASH], 16), meta[prof.K_K],
                           meta[prof.K_NTOK], meta[prof.K_SOURCE], W, meta[K_WEIGHTING], freq, coact, mlp)
    if model_path is not None:
        prof.check_model(out, model_path, KIND)
    return out
