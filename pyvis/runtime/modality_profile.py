"""Modality profiles: per layer and expert, how much image and text tokens route to it (docs/modality.md, issue #14).

Written by ``pyvis calibrate modality`` (:mod:`pyvis.calibrate.modality`, where the visual share and the labels are
defined).  The fingerprint and provenance keys are the buddy profile's (:mod:`pyvis.runtime.profile`), with
``vis.profile.kind = "modality"`` and ``vis.profile.version = 1``; ``vis.profile.n_tokens`` = image + text tokens.
Its own:

    vis.modality.visual_min      f32   label visual when v >= this
    vis.modality.text_max        f32   label text when v <= this (0 <= text_max < visual_min <= 1)
    vis.modality.n_image_tokens  u64   image (embedding) tokens of the calibration traces
    vis.modality.n_text_tokens   u64   text tokens
    modality.image_pairs   I32 [n_layer, n_expert]  (token, slot) pairs of image tokens routed to the expert
    modality.text_pairs    I32 [n_layer, n_expert]
    modality.image_mass    F32 [n_layer, n_expert]  their gate weights, normalised over each token's k experts
    modality.text_mass     F32 [n_layer, n_expert]
    modality.image_rows    I32 [n_layer]            image tokens the layer routed (= sum of its image_mass)
    modality.text_rows     I32 [n_layer]
    modality.visual_share  F32 [n_layer, n_expert]  v in [0, 1]; NaN where undefined
    modality.label         I32 [n_layer, n_expert]  index into LABELS

Shapes are numpy's; GGUF's ``ne`` is reversed (``modality.image_mass``: ne = [n_expert, n_layer]).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import profile as prof

KIND = "modality"
VERSION = 1
LABELS = ("unused", "text", "shared", "visual", "unknown")   # modality.label values 0..4
UNUSED, TEXT, SHARED, VISUAL, UNKNOWN = range(len(LABELS))
K_VMIN, K_TMAX = "vis.modality.visual_min", "vis.modality.text_max"
K_NIMG, K_NTXT = "vis.modality.n_image_tokens", "vis.modality.n_text_tokens"
T = "modality."
PER_EXPERT = (("image_pairs", np.int32), ("text_pairs", np.int32), ("image_mass", np.float32),
              ("text_mass", np.float32), ("visual_share", np.float32), ("label", np.int32))
PER_LAYER = (("image_rows", np.int32), ("text_rows", np.int32))


def _shape(name: str, L: int, E: int) -> tuple:
    return (L,) if name in dict(PER_LAYER) else (L, E)


@dataclass
class ModalityProfile:
    path: Path
    arch: str
    n_layer: int
    n_expert: int
    router_hash: int
    k: int                     # top-k of the calibration routing
    n_tokens: int              # image + text tokens
    source: str
    visual_min: float
    text_max: float
    n_image_tokens: int
    n_text_tokens: int
    image_pairs: np.ndarray    # [n_layer, n_expert] int32
    text_pairs: np.ndarray
    image_mass: np.ndarray     # [n_layer, n_expert] float32
    text_mass: np.ndarray
    image_rows: np.ndarray     # [n_layer] int32
    text_rows: np.ndarray
    visual_share: np.ndarray   # [n_layer, n_expert] float32, NaN where undefined
    label: np.ndarray          # [n_layer, n_expert] int32, index into LABELS

    def experts(self, label: str, layer: int) -> list[int]:
        """The experts of ``layer`` with this label (one of LABELS)."""
        return [int(e) for e in np.flatnonzero(self.label[layer] == LABELS.index(label))]


def check_thresholds(visual_min: float, text_max: float) -> str | None:
    """Why these thresholds cannot label (None if they can): 0 <= text_max < visual_min <= 1."""
    if not (np.isfinite(visual_min) and 0 <= visual_min <= 1):
        return f"visual_min {visual_min}: must be in [0, 1]"
    if not (np.isfinite(text_max) and 0 <= text_max <= 1):
        return f"text_max {text_max}: must be in [0, 1]"
    if not text_max < visual_min:
        return f"text_max {text_max:g} must be below visual_min {visual_min:g} (an expert has one label)"
    return None


def _check(a: dict, L: int, E: int, path: Path, fix: str) -> None:
    for name, _ in PER_EXPERT + PER_LAYER:
        shape = _shape(name, L, E)
        if a[name].shape != shape:
            raise prof.ProfileError(f"{path}: {T}{name} is {a[name].shape}, expected {shape}; {fix}")
    for name in ("image_pairs", "text_pairs", "image_mass", "text_mass", "image_rows", "text_rows"):
        x = a[name]
        if not (np.isfinite(x).all() and (x >= 0).all()):
            raise prof.ProfileError(f"{path}: {T}{name} holds a negative or non-finite value; {fix}")
    v = a["visual_share"]
    if ((v < 0) | (v > 1)).any():
        raise prof.ProfileError(f"{path}: {T}visual_share holds a value outside [0, 1]; {fix}")
    lab = a["label"]
    if lab.size and (lab.min() < 0 or lab.max() >= len(LABELS)):
        raise prof.ProfileError(f"{path}: {T}label holds a value outside 0..{len(LABELS) - 1} "
                                f"({', '.join(LABELS)}); {fix}")
    unused = (a["image_pairs"] + a["text_pairs"]) == 0
    if (unused != (lab == UNUSED)).any():
        il, e = (int(x) for x in np.argwhere(unused != (lab == UNUSED))[0])
        raise prof.ProfileError(f"{path}: {T}label[{il}, {e}] = {LABELS[lab[il, e]]} but the expert has "
                                f"{int(a['image_pairs'][il, e] + a['text_pairs'][il, e])} routed pairs; {fix}")


def write_modality_profile(path: str | os.PathLike, fingerprint: dict, arrays: dict, visual_min: float,
                           text_max: float, n_image_tokens: int, n_text_tokens: int, k: int, source: str,
                           model_path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write a modality profile (atomically; never over ``model_path`` or a file that is not a vis profile).
    ``arrays``: every name of PER_EXPERT and PER_LAYER (without the ``modality.`` prefix)."""
    L, E = int(fingerprint["n_layer"]), int(fingerprint["n_expert"])
    a = {name: np.ascontiguousarray(arrays[name], dt) for name, dt in PER_EXPERT + PER_LAYER}
    why = check_thresholds(visual_min, text_max)
    if why:
        raise prof.ProfileError(why)
    _check(a, L, E, Path(path), "a bug in the caller")
    w = prof.start_profile(path, fingerprint, KIND, VERSION, k, int(n_image_tokens) + int(n_text_tokens), source,
                           model_path, force)
    w.add_float32(K_VMIN, float(visual_min))
    w.add_float32(K_TMAX, float(text_max))
    w.add_uint64(K_NIMG, int(n_image_tokens))
    w.add_uint64(K_NTXT, int(n_text_tokens))
    for name, _ in PER_EXPERT + PER_LAYER:
        w.add_tensor(T + name, a[name])
    return prof.finish_profile(w, path)


def load_modality_profile(path: str | os.PathLike, model: str | os.PathLike | None = None) -> ModalityProfile:
    """Read and check a modality profile; with ``model`` (a GGUF path), also check it was calibrated for it."""
    p = Path(path)
    fix = prof.fix_for(KIND, p)
    r, meta = prof.open_profile(p, KIND, VERSION, ((K_VMIN, float), (K_TMAX, float), (K_NIMG, int), (K_NTXT, int)))
    L, E = meta[prof.K_NLAYER], meta[prof.K_NEXPERT]
    a = {name: prof.profile_tensor(r, T + name, dt, _shape(name, L, E), p, kind=KIND)
         for name, dt in PER_EXPERT + PER_LAYER}
    del r
    why = check_thresholds(meta[K_VMIN], meta[K_TMAX])
    if why:
        raise prof.ProfileError(f"{p}: {why}; {fix}")
    _check(a, L, E, p, fix)
    out = ModalityProfile(p, meta[prof.K_ARCH], L, E, int(meta[prof.K_HASH], 16), meta[prof.K_K], meta[prof.K_NTOK],
                          meta[prof.K_SOURCE], meta[K_VMIN], meta[K_TMAX], meta[K_NIMG], meta[K_NTXT], **a)
    if model is not None:
        prof.check_model(out, model, KIND)
    return out
