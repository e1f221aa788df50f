"""One image chunk of a prompt: encode, score, probe, select, decode the kept rows at their positions.

:func:`eval_image` is the image step of :meth:`pyvis.vlm.Session.prepare`; :class:`ImageOptions` holds how
each image is pruned (prepare's arguments, checked there) and :class:`ImageReport` what happened to it.
The position rules (M-RoPE keeps original positions, other models are renumbered) are in
:func:`kept_positions` and :func:`next_position`.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..runtime import native
from ..runtime.native import MoeInfo
from ..runtime.settings import MoeParams
from . import prune
from .context import Ctx, VLMError, ms
from .probe import Shadow, probe_native

from llama_cpp import mtmd_cpp as M  # noqa: E402  (pyvis set the library paths)


class SessionView(Protocol):
    """What :func:`eval_image` reads of the session that calls it (:class:`pyvis.vlm.Session` is one): the mtmd
    context and its model's shape, the main context, the shadow context on demand.  A protocol, so that this
    module does not depend on the session that depends on it."""
    mctx: Any                  # mtmd_context *
    main: Ctx
    moe: MoeParams | None
    info: MoeInfo
    mrope: bool
    n_embd: int
    n_embd_inp: int
    saliency_layers: int

    def shadow(self) -> Shadow: ...

    def moe_layers(self) -> list[int]: ...


@dataclass(frozen=True)
class ImageOptions:
    """How each image of a prompt is pruned (Session.prepare's arguments)."""
    method: str = "none"          # none | random | saliency | entropy | affinity (pyvis.vlm.prune)
    keep_ratio: float = 1.0       # beta in (0, 1]
    alpha: float = prune.DEFAULT_ALPHA
    lam: float = prune.DEFAULT_LAMBDA
    prefix_layers: int = 1        # affinity: MoE layers whose routing defines a token's expert set
    saliency: str = "auto"        # auto | attention | entropy
    seed: int = 0                 # random method: image i uses seed + i
    min_keep: int = 1
    shadow: bool = False          # affinity: probe in the shadow context instead of the native prefix probe
    keep_scores: bool = False     # keep the [N] scores in the report


@dataclass
class ImageReport:
    """What happened to one image chunk."""
    index: int                       # image number in the prompt (0-based)
    n_tokens: int                    # N, image tokens before pruning
    n_kept: int
    nx: int
    ny: int
    n_pos: int                       # positions the image spans (M-RoPE: max(nx, ny))
    pos_0: int                       # n_past at the image
    kept: np.ndarray                 # kept token indices (sorted)
    positions: np.ndarray            # [n_pos_per_embd, n_kept] positions they were decoded at
    saliency_source: str = ""        # "attention", "entropy" or "" (not needed)
    scores: dict = field(default_factory=dict)   # name -> [N] in [0, 1]
    prefix_ids: np.ndarray | None = None         # [L, N, k] prefix routing (affinity)
    timings_ms: dict = field(default_factory=dict)
    probe: str = ""                              # "native", "shadow" or "" (no probe)
    probe_trace_bytes: tuple | None = None       # (start, end) of the native probe's records in the --moe-trace file
    core_coverage: float | None = None           # affinity: |E_target| / (prefix layers x n_expert)


# --------------------------------------------------------------------------
# positions
# --------------------------------------------------------------------------
def mrope_positions(pos_0: int, nx: int, n: int) -> np.ndarray:
    """[4, n] (t, y, x, z) M-RoPE positions of an image's n tokens on an nx-wide merged grid, as
    ``mtmd_image_tokens_get_decoder_pos`` gives them (section-major, llama's section order)."""
    i = np.arange(n, dtype=np.int64)
    return np.stack([np.full(n, pos_0, np.int64), pos_0 + i // nx, pos_0 + i % nx, np.zeros(n, np.int64)])


def kept_positions(pos: np.ndarray, kept: np.ndarray, pos_0: int, mrope: bool) -> np.ndarray:
    """Positions the kept tokens are decoded at: for M-RoPE their original (t, y, x, z) columns of
    ``pos [4, N]``; otherwise renumbered ``pos_0 .. pos_0 + |K| - 1`` (llama.cpp requires contiguous
    positions without M-RoPE)."""
    kept = np.asarray(kept, np.int64)
    if mrope:
        return np.asarray(pos)[:, kept]
    return (pos_0 + np.arange(kept.size, dtype=np.int64))[None, :]


def next_position(pos_0: int, n_pos: int, n_kept: int, mrope: bool) -> int:
    """n_past after an image: the unpruned extent (n_pos = max(nx, ny)) for M-RoPE, else the kept count."""
    return pos_0 + (n_pos if mrope else n_kept)


def image_positions(chunk, n_past: int, n: int, mrope: bool) -> np.ndarray:
    """[n_pos_per_embd, N] decoder positions of all N tokens of an image chunk, section-major."""
    if not mrope:
        return (n_past + np.arange(n, dtype=np.int64))[None, :]
    it = M.mtmd_input_chunk_get_tokens_image(chunk)
    if not it:
        raise VLMError("image chunk without image tokens")
    buf = (M.mtmd_decoder_pos * n)()
    M.mtmd_helper_image_get_decoder_pos(it, n_past, buf)
    a = np.ctypeslib.as_array(ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint32)), shape=(n, 4)).astype(np.int64)
    # struct order is (t, x, y, z); llama's section order is (t, y, x, z)
    return np.stack([a[:, 0], a[:, 2], a[:, 1], a[:, 3]])


# --------------------------------------------------------------------------
# the steps
# --------------------------------------------------------------------------
def _encode(s: SessionView, chunk, index: int, n: int, want_attn: bool, saliency: str):
    """Encode the chunk: output rows [N, n_embd_inp], and the encoder saliency [N] when asked (None when the
    projector has none and ``saliency`` is auto).  Saliency is on for this encode only: other encodes stay
    upstream's graph."""
    attn = None
    if want_attn:
        native.saliency_enable(s.mctx, s.saliency_layers)
    try:
        if M.mtmd_encode_chunk(s.mctx, chunk) != 0:
            raise VLMError(f"encoding image {index} failed")
        if want_attn:
            try:
                attn = np.asarray(native.mtmd_saliency(s.mctx), np.float64)
            except native.VisError as e:      # e.g. a projector without saliency support
                if saliency == "attention":
                    raise VLMError(f"encoder saliency: {e}") from e
            if attn is not None and attn.size != n:
                raise VLMError(f"encoder saliency has {attn.size} scores for {n} image tokens")
    finally:
        if want_attn:
            native.saliency_enable(s.mctx, 0)
    ptr = M.mtmd_get_output_embd(s.mctx)
    if not ptr:
        raise VLMError(f"image {index}: the encoder returned no embeddings")
    return np.ctypeslib.as_array(ptr, shape=(n, s.n_embd_inp)).copy(), attn


def _scores(s: SessionView, method: str, rows: np.ndarray, attn) -> tuple[dict, str]:
    """The scores a method needs (name -> [N]) and where the saliency came from."""
    scores: dict[str, np.ndarray] = {}
    src = ""
    if method in ("saliency", "affinity"):
        if attn is not None:
            scores["saliency"], src = prune.normalize(attn), "attention"
        else:
            scores["saliency"], src = prune.entropy_scores(rows[:, :s.n_embd]), "entropy"
    if method == "entropy":
        scores["entropy"] = prune.entropy_scores(rows[:, :s.n_embd])
    return scores, src


def eval_image(s: SessionView, chunk, index: int, n_past: int, o: ImageOptions, timings: dict) -> ImageReport:
    """Encode, score, (affinity) probe, select and decode one image chunk at n_past; adds its stage times to
    ``timings``."""
    it = M.mtmd_input_chunk_get_tokens_image(chunk)
    n = int(M.mtmd_input_chunk_get_n_tokens(chunk))
    n_pos = int(M.mtmd_input_chunk_get_n_pos(chunk))
    nx, ny = int(M.mtmd_image_tokens_get_nx(it)), int(M.mtmd_image_tokens_get_ny(it))
    non_causal = bool(M.mtmd_decode_use_non_causal(s.mctx, chunk))
    affinity = o.method == "affinity"
    tm: dict[str, float] = {}

    t0 = time.perf_counter()
    rows, attn = _encode(s, chunk, index, n, o.method in ("saliency", "affinity") and o.saliency != "entropy",
                         o.saliency)
    tm["encode"] = ms(t0)
    pos = image_positions(chunk, n_past, n, s.mrope)

    t0 = time.perf_counter()
    scores, src = _scores(s, o.method, rows, attn)
    tm["score"] = ms(t0)

    t0 = time.perf_counter()
    prefix, masks, span = None, None, None
    if affinity:
        if o.shadow:
            prefix = s.shadow().probe(o.prefix_layers, rows, pos, n_past, non_causal)
        else:
            prefix, span = probe_native(s.main, s.moe_layers()[:o.prefix_layers], rows, pos, n_past, non_causal,
                                        s.config.trace if s.config is not None else None)
        masks = prune.expert_masks(prefix, s.info.n_expert)
    tm["probe"] = ms(t0) if affinity else 0.0

    t0 = time.perf_counter()
    coverage = None
    if affinity:
        kept, d = prune.affinity_select(scores["saliency"], masks, o.keep_ratio, o.alpha, o.lam, o.min_keep,
                                        details=True)
        coverage = float(d["target"].mean()) if d["target"].size else 0.0
    else:
        kept = prune.select(o.method, n, o.keep_ratio, saliency=scores.get("saliency"), entropy=scores.get("entropy"),
                            masks=masks, alpha=o.alpha, lam=o.lam, seed=o.seed + index, min_keep=o.min_keep)
    tm["select"] = ms(t0)

    kpos = kept_positions(pos, kept, n_past, s.mrope)
    t0 = time.perf_counter()
    s.main.decode_embd(rows[kept], kpos, non_causal)
    tm["decode_image"] = ms(t0)
    if o.shadow:   # keep the shadow's left context identical to the main context
        s.shadow().ctx.decode_embd(rows[kept], kpos, non_causal)
    for k, v in tm.items():
        timings[k] = timings.get(k, 0.0) + v
    return ImageReport(index, n, len(kept), nx, ny, n_pos, n_past, kept, kpos, src,
                       scores if o.keep_scores else {}, prefix, tm,
                       ("shadow" if o.shadow else "native") if affinity else "", span, coverage)
