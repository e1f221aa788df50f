"""A llama context with its batch, and the decodes :mod:`pyvis.vlm` needs: text tokens and embedding rows at
explicit positions, in ``n_batch`` slices, as libmtmd's helpers do.  Also the package's error type."""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from ..runtime import native
from ..runtime.native import llama_cpp  # noqa: F401  (llama_cpp after pyvis set the library paths)
from ..runtime.config import MoeConfig, applied

from llama_cpp import llama_cpp as L  # noqa: E402
from llama_cpp import _internals as I  # noqa: E402


class VLMError(RuntimeError):
    """A user-facing error of the multimodal path (bad image, no vision support, decode failure)."""


def check_file(path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise VLMError(f"{what} not found: {p}")
    if p.stat().st_size == 0:
        raise VLMError(f"{what} is empty (0 bytes): {p}")
    return str(p)


def ms(t0: float) -> float:
    """Milliseconds since perf_counter() gave t0."""
    return (time.perf_counter() - t0) * 1000.0


class Ctx:
    """A llama context on a model, with its own llama_batch_ext.  ``config``: the expert cache's settings for this
    context (None: those in force); ``n_batch``: rows per decode call; ``n_embd_inp``: floats per embedding row."""

    def __init__(self, model, params, config: MoeConfig | None, verbose: bool, n_batch: int, n_embd_inp: int,
                 borrowed=None):
        self.n_batch, self.n_embd_inp = int(n_batch), int(n_embd_inp)
        if borrowed is not None:          # a context owned by someone else (a llama_cpp.Llama)
            self.ctx, self.owned = borrowed, False
        else:
            self.owned = True
            # this context only; the caller's settings stay
            with applied(config if config is not None else MoeConfig()):
                try:
                    self.ctx = I.LlamaContext(model=model, params=params, verbose=verbose)
                except ValueError as e:
                    err = native.last_error()     # cleared by applied(): this creation's own error
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

    def forget_from(self, pos: int) -> None:
        """Drop the KV of sequence 0 from position ``pos`` on (llama_memory_seq_rm)."""
        L.llama_memory_seq_rm(L.llama_get_memory(self.ptr), 0, pos, -1)

    def _process(self, what: str) -> None:
        r = L.llama_process(self.ptr, L.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if r != 0:
            err = native.moe_failures(self.ptr)[1]     # this decode's failure in the expert cache, if it was one
            raise VLMError(f"decoding {what} failed (llama_process returned {r})" + (f": {err}" if err else ""))

    def decode_text(self, tokens, n_past: int, logits_last: bool) -> int:
        """Text tokens at positions n_past, n_past+1, ... (mtmd_helper_eval_chunk_single). Returns the new n_past."""
        n = len(tokens)
        i = 0
        pos = L.llama_pos(0)
        while i < n:
            L.llama_batch_ext_clear(self.batch)
            idx = -1
            n_added = 0
            while i < n and n_added < self.n_batch:
                idx = L.llama_batch_ext_add_token(self.batch, 0, int(tokens[i]))
                if idx < 0:
                    raise VLMError(f"llama_batch_ext_add_token failed ({idx})")
                pos.value = n_past
                L.llama_batch_ext_set_pos(self.batch, idx, ctypes.byref(pos))
                n_past += 1
                n_added += 1
                i += 1
            if logits_last and i == n:
                L.llama_batch_ext_set_output_logits(self.batch, idx, True)
            self._process("text")
        return n_past

    def decode_embd(self, rows: np.ndarray, pos: np.ndarray, non_causal: bool = False) -> None:
        """Embedding rows [n, n_embd_inp] at positions [n_pos_per_embd, n]
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
            L.llama_set_causal_attn(self.ptr, False)
        try:
            for off in range(0, n, self.n_batch):
                L.llama_batch_ext_clear(self.batch)
                for i in range(off, min(n, off + self.n_batch)):
                    e = L.llama_embd(ctypes.cast(base + i * stride, fptr), 1, self.n_embd_inp)
                    idx = L.llama_batch_ext_add_embd(self.batch, 0, e)
                    if idx < 0:
                        raise VLMError(f"llama_batch_ext_add_embd failed ({idx})")
                    for j in range(4):
                        p4[j] = int(pos[j, i]) if j < pos.shape[0] else 0
                    L.llama_batch_ext_set_pos(self.batch, idx, p4)
                self._process("image")
        finally:
            if non_causal:
                L.llama_set_causal_attn(self.ptr, True)
