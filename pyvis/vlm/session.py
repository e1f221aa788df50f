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

import contextlib
import ctypes
import os
import sys
import time
import warnings

import numpy as np

from . import prune
from ..runtime import native as _native
from ..runtime.native import llama_cpp  # noqa: F401  (llama_cpp after pyvis set the library paths)
from ..runtime.config import MoeConfig, VisTypeError, applied
from ..runtime.settings import MoeParams
from .context import Ctx, VLMError, check_file, ms
from .image import ImageOptions, ImageReport, eval_image, next_position
from .prepared import Prepared
from .probe import Shadow

from llama_cpp import llama_cpp as L  # noqa: E402
from llama_cpp import mtmd_cpp as M  # noqa: E402
from llama_cpp import _internals as I  # noqa: E402

SALIENCY_SOURCES = ("auto", "attention", "entropy")


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
# the session
# --------------------------------------------------------------------------
_NO_CACHE = MoeConfig.of(MoeParams())    # a session without a config: the residency settings off


def _session_config(config, moe, precision, capacity) -> MoeConfig | None:
    """The session's MoeConfig; the deprecated sections (moe, precision, capacity) joined into one, with a
    DeprecationWarning saying how to write it."""
    if config is not None and not isinstance(config, MoeConfig):
        raise VisTypeError(f"pyvis.vlm.Session(): config must be a pyvis.moe.MoeConfig, got {type(config).__name__}"
                           + (" (write MoeConfig.of(moe) for a MoeParams)" if isinstance(config, MoeParams) else ""))
    old = {n: v for n, v in (("moe", moe), ("precision", precision), ("capacity", capacity)) if v is not None}
    if not old:
        return config
    if config is not None:
        raise TypeError(f"pyvis.vlm.Session(): give the settings in the MoeConfig, not also as {', '.join(old)}=")
    warnings.warn(f"pyvis.vlm.Session(..., {'=, '.join(old)}=) is deprecated and goes in the next release: write "
                  f"pyvis.vlm.Session(model, mmproj, pyvis.moe.MoeConfig(...)) (MoeConfig.of(moe or MoeParams(), "
                  f"precision, capacity) is the same config)", DeprecationWarning, stacklevel=3)
    return MoeConfig.of(moe or MoeParams(), precision, capacity)


class Session:
    """A model, its mmproj (libmtmd) and a llama context, for pruned multimodal prompts.

    ``model_path`` is a GGUF path, or a loaded ``llama_cpp.Llama`` (e.g. from ``pyvis.moe.load``):
    its model and context are then used as they are (its n_ctx, n_batch, threads and expert cache;
    the session does not free them, and the Llama's own token bookkeeping does not see the prompt,
    so generate through :meth:`Prepared.generate`).
    ``config`` (a :class:`pyvis.moe.MoeConfig`, as ``pyvis.moe.load`` takes it) configures the fork's expert cache
    for the session's context: slots, memory, the lossy options of docs/precision.md, ...; the fields given are
    applied, the others keep the value in force.  None: no expert cache of the session's own (slots, cache_mib,
    pinned_layers, stats and trace off; the other settings as in force).  Under ``--moe-mem`` (``VIS_MOE_MEM``, or
    ``mem`` in ``config``) the projector's weights, compute buffer and image copies at ``image_max_tokens`` (<= 0:
    the projector's limit) are planned in the same budget (``self.encoder``; docs/planning.md#the-vision-encoder).
    ``n_batch`` is the decode slice size (as ``-b`` in llama-mtmd-cli); ``n_ubatch`` defaults to it.

    Deprecated, for one release: the sections ``moe=MoeParams(...)``, ``precision=PrecisionParams(...)`` and
    ``capacity=CapacityParams(...)`` still work, with a DeprecationWarning; they mean
    ``MoeConfig.of(moe or MoeParams(), precision, capacity)``, as before."""

    def __init__(self, model_path, mmproj_path, config: MoeConfig | None = None, *, n_ctx: int = 4096,
                 n_batch: int = 512, n_ubatch: int | None = None, n_threads: int | None = None,
                 use_gpu: bool = True, n_gpu_layers: int = 0, image_max_tokens: int = -1,
                 verbose: bool = False, moe: MoeParams | None = None, precision=None, capacity=None):
        config = _session_config(config, moe, precision, capacity)
        llm = model_path if isinstance(model_path, llama_cpp.Llama) else None
        if llm is None:
            model_path = check_file(model_path, "model")
        mmproj_path = check_file(mmproj_path, "mmproj")
        from llama_cpp import _logger
        if llm is None:
            _logger.set_verbose(verbose)
        _set_quiet(not verbose)
        self.verbose = verbose
        self._owns_model = llm is None
        if llm is None:
            # the projector shares the --moe-mem budget: planned with the model and context made next, as
            # llama-mtmd-cli does (docs/planning.md#the-vision-encoder); cleared once the context is planned
            try:
                self.encoder = _native.plan_encoder(mmproj_path, image_max_tokens, warmup=False)  # mcp.warmup below
            except _native.VisError as e:
                raise VLMError(str(e)) from e
            mp = L.llama_model_default_params()
            mp.n_gpu_layers = n_gpu_layers
            try:
                # the model's load decides what pages (a --moe-mem budget in the config counts here, as for the
                # context: loaded without it, a model that fits alone is loaded whole and its context refused)
                with applied(config) if config is not None else contextlib.nullcontext():
                    self.model = I.LlamaModel(path_model=model_path, params=mp, verbose=verbose)
            except ValueError as e:
                _native.plan_encoder(None)
                raise VLMError(f"failed to load model {model_path}: {e}") from e
        else:
            self.encoder = None   # the Llama was planned without it (plan_encoder before pyvis.moe.load plans it)
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
        self.n_embd_inp = int(L.llama_model_n_embd_inp(self.model.model))
        if llm is None:
            self.config = config    # None: no expert cache of its own
            try:
                self.main = Ctx(self.model, self._context_params(), config if config is not None else _NO_CACHE,
                                verbose, self.n_batch, self.n_embd_inp)
            finally:
                _native.plan_encoder(None)
        else:
            self.main = Ctx(None, None, None, verbose, self.n_batch, self.n_embd_inp, borrowed=llm._ctx)
            self.config = config if config is not None else (
                MoeConfig() if _native.moe_n_managed(self.main.ptr) else None)
        self.n_ctx = int(L.llama_n_ctx(self.main.ptr))     # llama.cpp may round the requested size up
        self._shadow: Shadow | None = None
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
        if getattr(self, "model", None) is not None:
            if self._owns_model:
                self.model.close()
            self.model = None

    def release_encoder(self) -> bool:
        """Free the vision encoder once the prompt's images are in the KV cache, so that the --moe-mem plan gives its
        bytes to the expert slots, as llama-mtmd-cli does after its single turn (VIS_MOE_ENCODER_RELEASE=on;
        docs/planning.md#freeing-the-encoder-after-the-image): the decode then reads less, and what it computes is
        unchanged.  True if the encoder was freed; False, and the encoder kept, where the plan does not give its
        bytes away (the knob off, no --moe-mem plan, or the reason its plan line names).  After it, ``generate``
        continues the prepared prompt; a new prompt or image needs a new Session."""
        if self.mctx is None or not _native.encoder_releasable(self.main.ptr):
            return False
        M.mtmd_free(self.mctx)
        self.mctx = None
        try:
            _native.encoder_freed(self.main.ptr)
        except _native.VisError as e:
            raise VLMError(str(e)) from e
        return True

    def _need_encoder(self) -> None:
        if self.mctx is None:
            raise VLMError("the vision encoder was freed (Session.release_encoder): a new prompt or image needs a new "
                           "Session")

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def reset(self) -> None:
        """Drop the KV cache (the expert cache and its stats stay)."""
        self.main.memory_clear()
        if self._shadow is not None:
            self._shadow.ctx.memory_clear()

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
        self._need_encoder()
        out = []
        for img in images:
            path = check_file(img, "image")
            bm = M.mtmd_helper_bitmap_init_from_file(self.mctx, path.encode(), False)
            if not bm:
                for b in out:
                    M.mtmd_bitmap_free(b)
                raise VLMError(f"failed to load image {path} (not a readable image file)")
            out.append(bm)
        return out

    def tokenize(self, text: str, bitmaps: list):
        self._need_encoder()
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

    def prompt_chunks(self, prompt: str, images, chat_template: bool = True):
        """``prompt`` with ``images`` (paths), formatted and tokenized: mtmd input chunks (free them)."""
        bms = self.load_bitmaps(images)
        try:
            return self.tokenize(self.format_prompt(prompt, len(bms), chat_template), bms)
        finally:
            for b in bms:
                M.mtmd_bitmap_free(b)

    def shadow(self) -> Shadow:
        """The shadow context of the affinity probe (:mod:`pyvis.vlm.probe`), created on first use."""
        if self._shadow is None:
            self._shadow = Shadow(self.model, self._context_params(), self.verbose, self.n_batch, self.n_embd_inp)
        return self._shadow

    def moe_layers(self) -> list[int]:
        """Model layer indices of the MoE layers (first_moe_layer onwards)."""
        i = self.info
        return list(range(i.first_moe_layer, i.n_layer)) if i.first_moe_layer >= 0 else []

    # ---- evaluation
    def eval_reference(self, prompt: str, images, chat_template: bool = True) -> tuple[np.ndarray, int]:
        """Upstream's path: ``mtmd_helper_eval_chunks`` on a cleared context. Returns (logits, n_past)."""
        chunks = self.prompt_chunks(prompt, images, chat_template)
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
        opts = ImageOptions(method if pruning else "none", keep_ratio if pruning else 1.0, alpha, lam, prefix_layers,
                            saliency, seed, min_keep, use_shadow, keep_scores)
        T: dict[str, float] = {k: 0.0 for k in ("tokenize", "encode", "score", "probe", "select",
                                                 "decode_image", "decode_text")}
        t_all = time.perf_counter()
        t0 = time.perf_counter()
        chunks = self.prompt_chunks(prompt, images, chat_template)
        T["tokenize"] = ms(t0)
        n_need = int(M.mtmd_helper_get_n_tokens(chunks))
        if n_need + 1 > self.n_ctx:      # the probe holds a whole image in the KV cache, so count all tokens
            M.mtmd_input_chunks_free(chunks)
            raise VLMError(f"the prompt has {n_need} tokens (text + unpruned images) but the context holds "
                           f"{self.n_ctx}: raise the context size (-c)")
        self.reset()
        shadow = self.shadow().ctx if use_shadow else None
        if self.config is not None:
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
                    n_past = self.main.decode_text(toks, start, last)
                    T["decode_text"] += ms(t0)
                    if shadow:
                        shadow.decode_text(toks, start, False)
                    n_text += len(toks)
                elif ctype == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    rep = eval_image(self, chunk, len(reports), n_past, opts, T)
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
                    if shadow:
                        sh_past = L.llama_pos(n_past)
                        M.mtmd_helper_eval_chunk_single(self.mctx, shadow.ptr, chunk, n_past, 0, self.n_batch,
                                                        False, ctypes.byref(sh_past))
                    n_past = int(new.value)
            if n_chunks == 0:
                raise VLMError("empty prompt")
            logits = self._last_logits()
        finally:
            M.mtmd_input_chunks_free(chunks)
        T["prefill"] = ms(t_all)
        st = _native.moe_stats(self.main.ptr) if self.config is not None else None
        return Prepared(self, n_past, logits, reports, n_text, method, keep_ratio, T, st)

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
            p.n_past = self.main.decode_text([tok], p.n_past, True)
            logits = self._last_logits()
        p.timings_ms["generate"] = ms(t0)
        return out.decode("utf-8", errors="replace")


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
