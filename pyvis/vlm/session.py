"""Pruned multimodal evaluation through libmtmd: prompt + images -> a ready llama context.

    import pyvis.vlm as vlm
    p = vlm.prepare("model.gguf", "Describe the image.", ["cat.png"], mmproj="mmproj.gguf",
                    keep_ratio=0.5, method="affinity")
    print(p.generate(32))               # greedy
    print(p.summary())                  # kept tokens and per-stage timings

What :meth:`Session.prepare` does, per chunk of ``mtmd_tokenize``'s output:

* **text** -- decoded in ``n_batch`` slices at explicit positions ``n_past, n_past+1, ...``
  (as ``mtmd_helper_eval_chunk_single`` does);
* **image** -- ``mtmd_encode_chunk``, then the output embeddings ``[N, n_embd_inp]`` are copied
  (for Qwen3-VL a row is the main embedding followed by the deepstack features; rows are kept
  whole). The tokens are scored, a subset is chosen (:mod:`pyvis.vlm.prune`), and only the kept rows are
  decoded, in increasing token order:

  - **M-RoPE models** (``mtmd_decode_use_mrope``): every kept token keeps its original 4-section
    position ``(t, y, x, z)`` from ``mtmd_helper_image_get_decoder_pos``, and ``n_past`` advances
    by the *unpruned* extent ``mtmd_input_chunk_get_n_pos`` (``max(nx, ny)``), so the following
    text lands exactly where it would without pruning;
  - **other models**: llama.cpp rejects non-contiguous positions, so the kept tokens are
    renumbered ``n_past .. n_past+|K|-1`` and ``n_past`` advances by ``|K|`` (docs/pruning.md);
  - models that decode images with non-causal attention (gemma3 & co.) get it around the image,
    as in upstream's helper.

With ``keep_ratio=1`` (or ``method="none"``) the batches, positions and output flags are exactly
those of upstream's ``mtmd_helper_eval_chunks``, so the logits are byte-identical
(tests/test_vlm.py).

Scores: ``entropy`` (MACS, from the output embeddings, numpy), ``saliency`` (the vision encoder's
head-averaged attention received per merged patch, from the native side; with ``saliency="auto"`` a
projector without saliency support gets the entropy score instead, and ``ImageReport.saliency_source``
says so), ``random``.

Expert affinity (``method="affinity"``): each image token's experts in the first
``prefix_layers`` MoE layers.  The *native* probe (default) runs the full image through only those
layers of the same context with the layer limit (``llama_vis_set_layer_limit``), captures their
routing, and drops the probe's KV with ``llama_memory_seq_rm``.  The *shadow* probe (``probe="shadow"``)
uses a second context of the same model (no expert cache, routing trace on) that mirrors every decode
of the prompt and runs the full image through the whole model; only its prefix layers' routing is
used.  Both give the routing of the full image in the same left context; the shadow costs a
full-model forward instead of a prefix one.
"""
from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import prune
from ..runtime import native as _native
from ..runtime.native import llama_cpp  # noqa: F401  (llama_cpp after pyvis set the library paths)
from ..runtime.settings import MoeParams, applied

from llama_cpp import llama_cpp as L  # noqa: E402
from llama_cpp import mtmd_cpp as M  # noqa: E402
from llama_cpp import _internals as I  # noqa: E402

SALIENCY_SOURCES = ("auto", "attention", "entropy")


class VLMError(RuntimeError):
    """A user-facing error of the multimodal path (bad image, no vision support, decode failure)."""


# --------------------------------------------------------------------------
# logging: keep libmtmd / libllama quiet unless verbose
# --------------------------------------------------------------------------
_ERR_LEVEL = 4  # GGML_LOG_LEVEL_ERROR


@L.llama_log_callback
def _errors_only(level, text, user_data):  # pragma: no cover - passthrough
    if level == _ERR_LEVEL:
        sys.stderr.write(text.decode(errors="replace"))


def _set_quiet(quiet: bool) -> None:
    cb = _errors_only if quiet else ctypes.cast(None, L.llama_log_callback)
    M.mtmd_log_set(cb, None)
    M.mtmd_helper_log_set(cb, None)


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------
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


@dataclass
class Prepared:
    """A context holding the evaluated prompt, ready to generate."""
    session: "Session"
    n_past: int
    logits: np.ndarray               # [n_vocab] logits of the last prompt token
    images: list[ImageReport]
    n_text_tokens: int
    method: str
    keep_ratio: float
    timings_ms: dict
    moe_stats: object = None         # pyvis.moe.MoeStats of the prefill (expert cache on), else None
    generated: list[int] = field(default_factory=list)

    @property
    def n_image_tokens(self) -> int:
        return sum(im.n_tokens for im in self.images)

    @property
    def n_image_kept(self) -> int:
        return sum(im.n_kept for im in self.images)

    def generate(self, n_predict: int = 32, temp: float = 0.0, seed: int = 0, top_k: int = 40,
                 on_text=None) -> str:
        return self.session.generate(self, n_predict, temp=temp, seed=seed, top_k=top_k, on_text=on_text)

    def summary(self) -> str:
        t = self.timings_ms
        out = [f"image tokens: kept {self.n_image_kept} of {self.n_image_tokens} "
               f"({self.method}, keep ratio {self.keep_ratio:g}); text tokens: {self.n_text_tokens}"]
        for im in self.images:
            src = f", saliency from {im.saliency_source}" if im.saliency_source else ""
            if im.core_coverage is not None:
                src += f", {im.probe} probe, core covers {100 * im.core_coverage:.0f}% of the prefix experts"
            out.append(f"  image {im.index}: {im.nx}x{im.ny} grid, kept {im.n_kept}/{im.n_tokens}{src}")
        keys = ["tokenize", "encode", "score", "probe", "select", "decode_image", "decode_text", "prefill"]
        out.append("timings: " + ", ".join(f"{k} {t.get(k, 0.0):.1f} ms" for k in keys if k in t))
        if self.moe_stats is not None:
            s = self.moe_stats
            out.append(f"expert cache (prefill): hit rate {s.hit_rate:.3f} ({s.n_hits}/{s.n_routed}), "
                       f"{s.bytes_loaded / (1 << 20):.2f} MiB loaded, {s.n_passes} passes")
        return "\n".join(out)


# --------------------------------------------------------------------------
# the session
# --------------------------------------------------------------------------
def _check_file(path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise VLMError(f"{what} not found: {p}")
    if p.stat().st_size == 0:
        raise VLMError(f"{what} is empty (0 bytes): {p}")
    return str(p)


class _Ctx:
    """A llama context (with its own llama_batch_ext) on the session's model."""

    def __init__(self, model, params, moe: MoeParams | None, verbose: bool, borrowed=None):
        if borrowed is not None:          # a context owned by someone else (a llama_cpp.Llama)
            self.ctx, self.owned = borrowed, False
            self.ptr = borrowed.ctx
            self.batch = L.llama_batch_ext_init(self.ptr)
            return
        self.owned = True
        with applied(moe or MoeParams()):     # this context only; the caller's settings stay
            try:
                self.ctx = I.LlamaContext(model=model, params=params, verbose=verbose)
            except ValueError as e:
                err = _native.last_error()     # cleared by applied(): this creation's own error
                raise VLMError(err or f"failed to create a llama context: {e}") from e
        self.ptr = self.ctx.ctx
        self.batch = L.llama_batch_ext_init(self.ptr)

    def close(self):
        if self.batch:
            L.llama_batch_ext_free(self.batch)
            self.batch = None
        if self.ctx is not None:
            if self.owned:
                self.ctx.close()
            self.ctx = None

    def memory_clear(self):
        L.llama_memory_clear(L.llama_get_memory(self.ptr), True)


class Session:
    """A model, its mmproj (libmtmd) and a llama context, for pruned multimodal prompts.

    ``model_path`` is a GGUF path, or a loaded ``llama_cpp.Llama`` (e.g. from ``pyvis.moe.load``):
    its model and context are then used as they are (its n_ctx, n_batch, threads and expert cache;
    the session does not free them, and the Llama's own token bookkeeping does not see the prompt,
    so generate through :meth:`Prepared.generate`).
    ``moe`` configures the fork's expert cache (:class:`pyvis.moe.MoeParams`; slots < n_expert turns
    it on).  ``n_batch`` is the decode slice size (as ``-b`` in llama-mtmd-cli); ``n_ubatch``
    defaults to it."""

    def __init__(self, model_path, mmproj_path, *, n_ctx: int = 4096, n_batch: int = 512,
                 n_ubatch: int | None = None, n_threads: int | None = None, moe: MoeParams | None = None,
                 use_gpu: bool = True, n_gpu_layers: int = 0, image_max_tokens: int = -1,
                 verbose: bool = False):
        llm = model_path if isinstance(model_path, llama_cpp.Llama) else None
        if llm is None:
            model_path = _check_file(model_path, "model")
        mmproj_path = _check_file(mmproj_path, "mmproj")
        from llama_cpp import _logger
        if llm is None:
            _logger.set_verbose(verbose)
        _set_quiet(not verbose)
        self.verbose = verbose
        self._owns_model = llm is None
        if llm is None:
            mp = L.llama_model_default_params()
            mp.n_gpu_layers = n_gpu_layers
            try:
                self.model = I.LlamaModel(path_model=model_path, params=mp, verbose=verbose)
            except ValueError as e:
                raise VLMError(f"failed to load model {model_path}: {e}") from e
        else:
            self.model = llm._model
            model_path = llm.model_path
            n_ctx, n_batch = llm.n_ctx(), llm.n_batch
            n_ubatch = llm.context_params.n_ubatch
            n_threads = llm.context_params.n_threads_batch
        self.model_path, self.mmproj_path = model_path, mmproj_path
        nt = n_threads or max(1, min(os.cpu_count() or 1, 8))
        self.n_threads = nt
        self.n_batch = int(n_batch)
        self.n_ubatch = int(n_ubatch or n_batch)
        self.n_ctx = int(n_ctx)
        self._cparams = self._context_params()
        if llm is None:
            self.moe = moe
            self.main = _Ctx(self.model, self._cparams, moe, verbose)
        else:
            self.main = _Ctx(None, None, None, verbose, borrowed=llm._ctx)
            self.moe = moe if moe is not None else (MoeParams() if _native.moe_n_managed(self.main.ptr) else None)
        self.n_ctx = int(L.llama_n_ctx(self.main.ptr))     # llama.cpp may round the requested size up
        self._shadow: _Ctx | None = None
        self._shadow_trace: str | None = None
        mcp = M.mtmd_context_params_default()
        mcp.use_gpu = use_gpu
        mcp.n_threads = nt
        mcp.print_timings = verbose
        mcp.warmup = False
        if image_max_tokens > 0:
            mcp.image_max_tokens = image_max_tokens
        self.mctx = M.mtmd_init_from_file(mmproj_path.encode(), self.model.model, mcp)
        if not self.mctx:
            self.main.close()
            raise VLMError(f"failed to load the multimodal projector {mmproj_path} for {model_path} "
                           "(not an mmproj GGUF, or it does not match the model)")
        if not M.mtmd_support_vision(self.mctx):
            self.close()
            raise VLMError(f"{mmproj_path} has no vision encoder: image prompts are not supported")
        self.mrope = bool(M.mtmd_decode_use_mrope(self.mctx))
        self.n_pos_per_embd = 4 if self.mrope else 1
        self.n_embd_inp = int(L.llama_model_n_embd_inp(self.model.model))
        self.n_embd = int(L.llama_model_n_embd(self.model.model))   # the main part of a row (entropy score)
        self.n_vocab = int(self.model.n_vocab())
        self.vocab = L.llama_model_get_vocab(self.model.model)
        self.info = _native.moe_info(self.model.model)
        self.marker = (M.mtmd_default_marker() or b"<__media__>").decode()
        self.saliency_layers = 1          # last k encoder layers averaged for the attention saliency

    def _context_params(self):
        cp = L.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_ubatch
        cp.n_threads = self.n_threads
        cp.n_threads_batch = self.n_threads
        return cp

    # ---- lifetime
    def close(self) -> None:
        if getattr(self, "mctx", None):
            M.mtmd_free(self.mctx)
            self.mctx = None
        for c in ("_shadow", "main"):
            x = getattr(self, c, None)
            if x is not None:
                x.close()
                setattr(self, c, None)
        if getattr(self, "_shadow_trace", None):
            Path(self._shadow_trace).unlink(missing_ok=True)
            self._shadow_trace = None
        if getattr(self, "model", None) is not None:
            if self._owns_model:
                self.model.close()
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def reset(self) -> None:
        """Drop the KV cache (the expert cache and its stats stay)."""
        self.main.memory_clear()
        if self._shadow is not None:
            self._shadow.memory_clear()

    # ---- input
    def format_prompt(self, prompt: str, n_images: int, chat_template: bool = True) -> str:
        """Put one media marker per image in front of the prompt unless it has them, then apply the
        model's chat template (as llama-mtmd-cli does) when it has one and ``chat_template``."""
        n_mark = prompt.count(self.marker)
        if n_mark == 0 and n_images:
            prompt = self.marker * n_images + "\n" + prompt
        elif n_mark != n_images:
            raise VLMError(f"the prompt has {n_mark} media markers ({self.marker}) for {n_images} images")
        if not chat_template:
            return prompt
        tmpl = L.llama_model_chat_template(self.model.model, None)
        if not tmpl:
            return prompt
        msgs = (L.llama_chat_message * 1)(L.llama_chat_message(b"user", prompt.encode()))
        n = L.llama_chat_apply_template(tmpl, msgs, 1, True, None, 0)
        if n < 0:      # a template llama.cpp does not know: use the raw prompt
            return prompt
        buf = ctypes.create_string_buffer(n + 1)
        L.llama_chat_apply_template(tmpl, msgs, 1, True, buf, n + 1)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def load_bitmaps(self, images) -> list:
        out = []
        for img in images:
            path = _check_file(img, "image")
            bm = M.mtmd_helper_bitmap_init_from_file(self.mctx, path.encode(), False)
            if not bm:
                for b in out:
                    M.mtmd_bitmap_free(b)
                raise VLMError(f"failed to load image {path} (not a readable image file)")
            out.append(bm)
        return out

    def tokenize(self, text: str, bitmaps: list):
        chunks = M.mtmd_input_chunks_init()
        t = M.mtmd_input_text()
        b = text.encode()
        t.text, t.text_len, t.add_special, t.parse_special = b, len(b), True, True
        arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        r = M.mtmd_tokenize(self.mctx, chunks, ctypes.byref(t), arr, len(bitmaps))
        if r != 0:
            M.mtmd_input_chunks_free(chunks)
            raise VLMError({1: "the number of images does not match the media markers in the prompt",
                            2: "image preprocessing failed"}.get(r, f"mtmd_tokenize failed ({r})"))
        return chunks

    # ---- batches
    def _process(self, c: _Ctx, what: str) -> None:
        r = L.llama_process(c.ptr, L.LLAMA_PROCESS_TYPE_DECODE, c.batch)
        if r != 0:
            err = _native.moe_failures(c.ptr)[1]     # this decode's failure in the expert cache, if it was one
            raise VLMError(f"decoding {what} failed (llama_process returned {r})" + (f": {err}" if err else ""))

    def _decode_text(self, c: _Ctx, tokens, n_past: int, logits_last: bool) -> int:
        """Text tokens at explicit positions, in n_batch slices (mtmd_helper_eval_chunk_single)."""
        n = len(tokens)
        i = 0
        pos = L.llama_pos(0)
        while i < n:
            L.llama_batch_ext_clear(c.batch)
            idx = -1
            n_added = 0
            while i < n and n_added < self.n_batch:
                idx = L.llama_batch_ext_add_token(c.batch, 0, int(tokens[i]))
                if idx < 0:
                    raise VLMError(f"llama_batch_ext_add_token failed ({idx})")
                pos.value = n_past
                L.llama_batch_ext_set_pos(c.batch, idx, ctypes.byref(pos))
                n_past += 1
                n_added += 1
                i += 1
            if logits_last and i == n:
                L.llama_batch_ext_set_output_logits(c.batch, idx, True)
            self._process(c, "text")
        return n_past

    def _decode_embd(self, c: _Ctx, rows: np.ndarray, pos: np.ndarray, non_causal: bool = False) -> None:
        """Embedding rows [n, n_embd_inp] at positions [n_pos_per_embd, n], in n_batch slices
        (mtmd_helper_decode_image_chunk's decode_embd_batch::render)."""
        n = rows.shape[0]
        if n == 0:
            return
        rows = np.ascontiguousarray(rows, np.float32)
        base = rows.ctypes.data
        stride = rows.strides[0]
        p4 = (L.llama_pos * 4)()
        fptr = ctypes.POINTER(ctypes.c_float)
        if non_causal:
            L.llama_set_causal_attn(c.ptr, False)
        try:
            for off in range(0, n, self.n_batch):
                L.llama_batch_ext_clear(c.batch)
                for i in range(off, min(n, off + self.n_batch)):
                    e = L.llama_embd(ctypes.cast(base + i * stride, fptr), 1, self.n_embd_inp)
                    idx = L.llama_batch_ext_add_embd(c.batch, 0, e)
                    if idx < 0:
                        raise VLMError(f"llama_batch_ext_add_embd failed ({idx})")
                    for j in range(4):
                        p4[j] = int(pos[j, i]) if j < pos.shape[0] else 0
                    L.llama_batch_ext_set_pos(c.batch, idx, p4)
                self._process(c, "image")
        finally:
            if non_causal:
                L.llama_set_causal_attn(c.ptr, True)

    # ---- image helpers
    def _image_positions(self, chunk, n_past: int, n: int) -> np.ndarray:
        """[n_pos_per_embd, N] decoder positions of all N tokens of an image chunk, section-major."""
        if not self.mrope:
            return (n_past + np.arange(n, dtype=np.int64))[None, :]
        it = M.mtmd_input_chunk_get_tokens_image(chunk)
        if not it:
            raise VLMError("image chunk without image tokens")
        buf = (M.mtmd_decoder_pos * n)()
        M.mtmd_helper_image_get_decoder_pos(it, n_past, buf)
        a = np.ctypeslib.as_array(ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint32)), shape=(n, 4)).astype(np.int64)
        # struct order is (t, x, y, z); llama's section order is (t, y, x, z)
        return np.stack([a[:, 0], a[:, 2], a[:, 1], a[:, 3]])

    def _shadow_ctx(self) -> _Ctx:
        if self._shadow is None:
            fd, path = tempfile.mkstemp(prefix="vis-probe-", suffix=".trace")
            os.close(fd)
            self._shadow_trace = path
            self._shadow = _Ctx(self.model, self._context_params(), MoeParams(trace=path), self.verbose)
        return self._shadow

    def _probe_prefix(self, rows: np.ndarray, pos: np.ndarray, n_past: int, n_layers: int, non_causal: bool,
                      use_shadow: bool) -> np.ndarray:
        """Routing ids [n_layers, N, k] of all N image rows in the first n_layers MoE layers."""
        if not use_shadow:
            return self._probe_native(rows, pos, n_past, n_layers, non_causal)
        from ..runtime import trace as vtrace
        sh = self._shadow_ctx()
        off = Path(self._shadow_trace).stat().st_size
        self._decode_embd(sh, rows, pos, non_causal)
        data = Path(self._shadow_trace).read_bytes()
        tr = vtrace.parse(data[:vtrace.HEADER_BYTES] + data[off:], self._shadow_trace)   # this probe's records
        # drop the probe's KV: every image token shares section-0 position n_past (M-RoPE), or
        # occupies n_past .. n_past+N-1
        L.llama_memory_seq_rm(L.llama_get_memory(sh.ptr), 0, n_past, -1)
        moe_layers = [int(x) for x in tr.layers()][:n_layers]
        if len(moe_layers) < n_layers:
            raise VLMError(f"the probe saw {len(moe_layers)} MoE layers, {n_layers} requested")
        ids = []
        for il in moe_layers:
            t = tr.for_layer(il)
            if len(t) != rows.shape[0]:
                raise VLMError(f"probe: layer {il} routed {len(t)} rows for {rows.shape[0]} image tokens")
            ids.append(t.ids)
        return np.stack(ids)

    def moe_layers(self) -> list[int]:
        """Model layer indices of the MoE layers (first_moe_layer onwards)."""
        i = self.info
        return list(range(i.first_moe_layer, i.n_layer)) if i.first_moe_layer >= 0 else []

    def _trace_size(self) -> int | None:
        tr = self.moe.trace if self.moe is not None else None
        return os.path.getsize(tr) if tr and os.path.exists(tr) else None

    def _probe_native(self, rows, pos, n_past, n_layers, non_causal) -> np.ndarray:
        """Run all image rows through only the layers up to the n_layers-th MoE layer of the main context,
        capture their routing in memory, then drop the probe's KV (llama_memory_seq_rm)."""
        c = self.main
        self._last_probe_bytes = None
        t_start = self._trace_size()
        moe = self.moe_layers()[:n_layers]
        limit = moe[-1] + 1
        _native.moe_capture(c.ptr, True)
        try:
            _native.set_layer_limit(c.ptr, limit)
            try:
                self._decode_embd(c, rows, pos, non_causal)
            finally:
                _native.set_layer_limit(c.ptr, 0)
            ids = [np.asarray(_native.moe_routes(c.ptr, il)) for il in moe]
        finally:
            _native.moe_capture(c.ptr, False)
            L.llama_memory_seq_rm(L.llama_get_memory(c.ptr), 0, n_past, -1)
            if t_start is not None:     # the trace is flushed after every ubatch
                self._last_probe_bytes = (t_start, self._trace_size())
        for il, x in zip(moe, ids):
            if x.shape[0] != rows.shape[0]:
                raise VLMError(f"probe: layer {il} routed {x.shape[0]} rows for {rows.shape[0]} image tokens")
        return np.stack(ids).astype(np.int32)

    # ---- evaluation
    def eval_reference(self, prompt: str, images, chat_template: bool = True) -> tuple[np.ndarray, int]:
        """Upstream's path: ``mtmd_helper_eval_chunks`` on a cleared context. Returns (logits, n_past)."""
        bms = self.load_bitmaps(images)
        try:
            chunks = self.tokenize(self.format_prompt(prompt, len(bms), chat_template), bms)
        finally:
            for b in bms:
                M.mtmd_bitmap_free(b)
        try:
            self.reset()
            new_n_past = L.llama_pos(0)
            r = M.mtmd_helper_eval_chunks(self.mctx, self.main.ptr, chunks, 0, 0, self.n_batch, True,
                                          ctypes.byref(new_n_past))
            if r != 0:
                raise VLMError(f"mtmd_helper_eval_chunks failed ({r})")
            return self._last_logits(), int(new_n_past.value)
        finally:
            M.mtmd_input_chunks_free(chunks)

    def _last_logits(self) -> np.ndarray:
        ptr = L.llama_get_logits_ith(self.main.ptr, -1)
        if not ptr:
            raise VLMError("no logits (the prompt must end with a text token)")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def prepare(self, prompt: str, images=(), *, keep_ratio: float = 1.0, method: str = "none",
                alpha: float = prune.DEFAULT_ALPHA, lam: float = prune.DEFAULT_LAMBDA, prefix_layers: int = 1,
                saliency: str = "auto", seed: int = 0, min_keep: int = 1, chat_template: bool = True,
                probe: str = "auto", keep_scores: bool = False, progress=None) -> Prepared:
        """Evaluate ``prompt`` with ``images`` (paths) on a cleared context, pruning each image's tokens;
        see the module doc.

        method      none | random | saliency | entropy | affinity (pyvis.vlm.prune)
        keep_ratio  beta in (0, 1]: keep floor(beta N) tokens of each image (at least ``min_keep``)
        alpha, lam  Algorithm 1's salient-core ratio and trade-off weight
        prefix_layers  MoE layers whose routing defines a token's expert set (affinity)
        saliency    auto (encoder attention if the projector supports it, else entropy) | attention | entropy
        probe       auto (= native) | native | shadow: how the affinity probe runs (module doc)
        """
        images = [str(i) for i in images]
        if method not in prune.METHODS:
            raise VLMError(f"unknown pruning method {method!r} (choose from {', '.join(prune.METHODS)})")
        try:
            prune.check_ratios(keep_ratio, alpha if method == "affinity" else None)
        except prune.PruneError as e:
            raise VLMError(str(e)) from e
        if saliency not in SALIENCY_SOURCES:
            raise VLMError(f"unknown saliency source {saliency!r} (choose from {', '.join(SALIENCY_SOURCES)})")
        if probe not in ("auto", "native", "shadow"):
            raise VLMError(f"unknown probe {probe!r} (auto, native, shadow)")
        pruning = method != "none" and keep_ratio < 1.0
        use_shadow = False
        if pruning and method == "affinity":
            if not (1 <= prefix_layers <= self.info.n_moe_layers):
                raise VLMError(f"prefix_layers must be in 1..{self.info.n_moe_layers}, got {prefix_layers}")
            use_shadow = probe == "shadow"
        T: dict[str, float] = {k: 0.0 for k in ("tokenize", "encode", "score", "probe", "select",
                                                 "decode_image", "decode_text")}
        t_all = time.perf_counter()
        t0 = time.perf_counter()
        bms = self.load_bitmaps(images)
        try:
            chunks = self.tokenize(self.format_prompt(prompt, len(bms), chat_template), bms)
        finally:
            for b in bms:
                M.mtmd_bitmap_free(b)
        T["tokenize"] = _ms(t0)
        n_need = int(M.mtmd_helper_get_n_tokens(chunks))
        if n_need + 1 > self.n_ctx:      # the probe holds a whole image in the KV cache, so count all tokens
            M.mtmd_input_chunks_free(chunks)
            raise VLMError(f"the prompt has {n_need} tokens (text + unpruned images) but the context holds "
                           f"{self.n_ctx}: raise the context size (-c)")
        self.reset()
        if use_shadow:
            self._shadow_ctx()
        if self.moe is not None:
            _native.moe_reset_stats(self.main.ptr)
        reports: list[ImageReport] = []
        n_past = 0
        n_text = 0
        try:
            n_chunks = M.mtmd_input_chunks_size(chunks)
            for ci in range(n_chunks):
                chunk = M.mtmd_input_chunks_get(chunks, ci)
                ctype = M.mtmd_input_chunk_get_type(chunk)
                last = ci == n_chunks - 1
                if ctype == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n_tok = ctypes.c_size_t(0)
                    ptr = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n_tok))
                    toks = [ptr[i] for i in range(n_tok.value)]
                    t0 = time.perf_counter()
                    start = n_past
                    n_past = self._decode_text(self.main, toks, start, last)
                    T["decode_text"] += _ms(t0)
                    if use_shadow:
                        self._decode_text(self._shadow, toks, start, False)
                    n_text += len(toks)
                elif ctype == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    rep = self._eval_image(chunk, len(reports), n_past, keep_ratio if pruning else 1.0,
                                           method if pruning else "none", alpha, lam, prefix_layers, saliency,
                                           seed + len(reports), min_keep, use_shadow, keep_scores, T)
                    reports.append(rep)
                    n_past = next_position(rep.pos_0, rep.n_pos, rep.n_kept, self.mrope)
                    if progress:
                        progress(rep)
                else:   # audio: upstream's path, unpruned
                    new = L.llama_pos(n_past)
                    r = M.mtmd_helper_eval_chunk_single(self.mctx, self.main.ptr, chunk, n_past, 0, self.n_batch,
                                                        last, ctypes.byref(new))
                    if r != 0:
                        raise VLMError(f"audio chunk failed ({r})")
                    if use_shadow:
                        sh_past = L.llama_pos(n_past)
                        M.mtmd_helper_eval_chunk_single(self.mctx, self._shadow.ptr, chunk, n_past, 0, self.n_batch,
                                                        False, ctypes.byref(sh_past))
                    n_past = int(new.value)
            if n_chunks == 0:
                raise VLMError("empty prompt")
            logits = self._last_logits()
        finally:
            M.mtmd_input_chunks_free(chunks)
        T["prefill"] = _ms(t_all)
        st = _native.moe_stats(self.main.ptr) if self.moe is not None else None
        return Prepared(self, n_past, logits, reports, n_text, method, keep_ratio, T, st)

    def _eval_image(self, chunk, index, n_past, keep_ratio, method, alpha, lam, prefix_layers, saliency, seed,
                    min_keep, use_shadow, keep_scores, T) -> ImageReport:
        it = M.mtmd_input_chunk_get_tokens_image(chunk)
        n = int(M.mtmd_input_chunk_get_n_tokens(chunk))
        n_pos = int(M.mtmd_input_chunk_get_n_pos(chunk))
        nx, ny = int(M.mtmd_image_tokens_get_nx(it)), int(M.mtmd_image_tokens_get_ny(it))
        tm: dict[str, float] = {}
        t0 = time.perf_counter()
        want_attn = method in ("saliency", "affinity") and saliency != "entropy"
        attn = None
        if want_attn:      # saliency only for this encode: other encodes stay upstream's graph
            _native.saliency_enable(self.mctx, self.saliency_layers)
        try:
            if M.mtmd_encode_chunk(self.mctx, chunk) != 0:
                raise VLMError(f"encoding image {index} failed")
            if want_attn:
                try:
                    attn = np.asarray(_native.mtmd_saliency(self.mctx), np.float64)
                except _native.VisError as e:      # e.g. a projector without saliency support
                    if saliency == "attention":
                        raise VLMError(f"encoder saliency: {e}") from e
                    attn = None
                if attn is not None and attn.size != n:
                    raise VLMError(f"encoder saliency has {attn.size} scores for {n} image tokens")
        finally:
            if want_attn:
                _native.saliency_enable(self.mctx, 0)
        ptr = M.mtmd_get_output_embd(self.mctx)
        if not ptr:
            raise VLMError(f"image {index}: the encoder returned no embeddings")
        rows = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd_inp)).copy()
        tm["encode"] = _ms(t0)
        pos = self._image_positions(chunk, n_past, n)
        scores: dict[str, np.ndarray] = {}
        src = ""
        t0 = time.perf_counter()
        if method in ("saliency", "affinity"):
            if attn is not None:
                scores["saliency"], src = prune.normalize(attn), "attention"
            else:
                scores["saliency"], src = prune.entropy_scores(rows[:, :self.n_embd]), "entropy"
        if method == "entropy":
            scores["entropy"] = prune.entropy_scores(rows[:, :self.n_embd])
        tm["score"] = _ms(t0)
        prefix = None
        masks = None
        tm["probe"] = 0.0
        self._last_probe_bytes = None
        if method == "affinity":
            t0 = time.perf_counter()
            non_causal = bool(M.mtmd_decode_use_non_causal(self.mctx, chunk))
            prefix = self._probe_prefix(rows, pos, n_past, prefix_layers, non_causal, use_shadow)
            masks = prune.expert_masks(prefix, self.info.n_expert)
            tm["probe"] = _ms(t0)
        t0 = time.perf_counter()
        coverage = None
        if method == "affinity":
            kept, d = prune.affinity_select(scores["saliency"], masks, keep_ratio, alpha, lam, min_keep, details=True)
            coverage = float(d["target"].mean()) if d["target"].size else 0.0
        else:
            kept = prune.select(method, n, keep_ratio, saliency=scores.get("saliency"), entropy=scores.get("entropy"),
                                masks=masks, alpha=alpha, lam=lam, seed=seed, min_keep=min_keep)
        tm["select"] = _ms(t0)
        kpos = kept_positions(pos, kept, n_past, self.mrope)
        t0 = time.perf_counter()
        non_causal = bool(M.mtmd_decode_use_non_causal(self.mctx, chunk))
        self._decode_embd(self.main, rows[kept], kpos, non_causal)
        tm["decode_image"] = _ms(t0)
        if use_shadow:   # keep the shadow's left context identical to the main context
            self._decode_embd(self._shadow, rows[kept], kpos, non_causal)
        for k, v in tm.items():
            T[k] = T.get(k, 0.0) + v
        return ImageReport(index, n, len(kept), nx, ny, n_pos, n_past, kept, kpos, src,
                           scores if keep_scores else {}, prefix, tm,
                           ("shadow" if use_shadow else "native") if method == "affinity" else "",
                           self._last_probe_bytes, coverage)

    # ---- generation
    def generate(self, p: Prepared, n_predict: int = 32, temp: float = 0.0, seed: int = 0, top_k: int = 40,
                 on_text=None) -> str:
        """Sample ``n_predict`` tokens after a prepared prompt (greedy when temp <= 0). Text tokens get
        explicit positions continuing from ``p.n_past`` (needed after a pruned M-RoPE image)."""
        rng = np.random.default_rng(seed)
        logits = p.logits
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        t0 = time.perf_counter()
        for _ in range(n_predict):
            if temp <= 0:
                tok = int(np.argmax(logits))
            else:
                z = logits.astype(np.float64) / temp
                if 0 < top_k < z.size:
                    cut = np.partition(z, -top_k)[-top_k]
                    z = np.where(z >= cut, z, -np.inf)
                z = np.exp(z - z.max())
                tok = int(rng.choice(z.size, p=z / z.sum()))
            if L.llama_vocab_is_eog(self.vocab, tok):
                break
            p.generated.append(tok)
            n = L.llama_token_to_piece(self.vocab, tok, buf, len(buf), 0, False)
            piece = buf.raw[:max(n, 0)]
            out += piece
            if on_text:
                on_text(piece.decode("utf-8", errors="replace"))
            p.n_past = self._decode_text(self.main, [tok], p.n_past, True)
            logits = self._last_logits()
        p.timings_ms["generate"] = _ms(t0)
        return out.decode("utf-8", errors="replace")


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


def read_decode_trace(p: Prepared, path):
    """The --moe-trace file of a prepared prompt without the native prefix probe's records (the probe runs in
    the same context, so its routing lands in the same trace)."""
    from ..runtime import trace as vtrace
    data = Path(path).read_bytes()
    keep, at = [], 0
    for a, b in sorted(im.probe_trace_bytes for im in p.images if im.probe_trace_bytes):
        keep.append(data[at:a])
        at = b
    keep.append(data[at:])
    return vtrace.parse(b"".join(keep), str(path))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def prepare(model, prompt: str, images=(), *, mmproj=None, keep_ratio: float = 0.5, method: str = "affinity",
            session_kw: dict | None = None, **kw) -> Prepared:
    """One call: prompt + images + options -> a :class:`Prepared` context ready to ``generate``.

    ``model`` is a :class:`Session`, a loaded ``llama_cpp.Llama`` (e.g. ``pyvis.moe.load(...)``) or a GGUF
    path; for the last two ``mmproj`` is required and a new session is opened with ``session_kw``
    (close it with ``prepared.session.close()``). Other keywords go to
    :meth:`Session.prepare` (alpha, lam, prefix_layers, saliency, seed, ...)."""
    if isinstance(model, Session):
        s = model
    else:
        if mmproj is None:
            raise VLMError("prepare(model_path, ...) needs mmproj=")
        s = Session(model, mmproj, **(session_kw or {}))
    return s.prepare(prompt, images, keep_ratio=keep_ratio, method=method, **kw)
