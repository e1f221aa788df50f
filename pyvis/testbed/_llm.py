"""Low-level llama.cpp access shared by the testbed tools: models with kv overrides,
contexts with an eval callback, and reading intermediate tensors (``cb_eval``).

Weight repacking ("extra buffer types") is off by default here: on CPUs with
AMX, this build's AMX matmul crashes on Q4_1 weights (seen on this machine),
and repacking does not matter for the F32 testbed models.  Set
``VIS_REPACK=1`` to turn it back on.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable

import numpy as np

from .. import _paths

_paths.configure_native_env()
_paths.lib_dir()

from llama_cpp import llama_cpp as L  # noqa: E402
from llama_cpp import _internals as I  # noqa: E402


class ggml_tensor(ctypes.Structure):
    """Layout of ``struct ggml_tensor`` (ggml.h at upstream 0c1e570)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


_base = None


def _ggml_base():
    global _base
    if _base is None:
        from ..runtime.ggml_quant import lib   # the one loader of the built libggml-base
        _base = lib()
        _base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        _base.ggml_backend_tensor_get.restype = None
        _base.ggml_nbytes.argtypes = [ctypes.c_void_p]
        _base.ggml_nbytes.restype = ctypes.c_size_t
    return _base


GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26


def tensor_name(t: int) -> str:
    return ctypes.cast(t, ctypes.POINTER(ggml_tensor)).contents.name.decode(errors="replace")


def read_tensor(t: int) -> np.ndarray:
    """Copy a (possibly strided view) 2-D F32 or I32 ggml tensor into a numpy array [ne1, ne0]."""
    tt = ctypes.cast(t, ctypes.POINTER(ggml_tensor)).contents
    if tt.type == GGML_TYPE_F32:
        dt = np.float32
    elif tt.type == GGML_TYPE_I32:
        dt = np.int32
    else:
        raise RuntimeError(f"tensor {tt.name!r}: unsupported ggml type {tt.type}")
    base = _ggml_base()
    n = base.ggml_nbytes(t)
    buf = np.empty((n + 3) // 4, dtype=dt)
    base.ggml_backend_tensor_get(t, buf.ctypes.data, 0, n)
    ne0, ne1 = tt.ne[0], tt.ne[1] * tt.ne[2] * tt.ne[3]
    nb1 = tt.nb[1] if tt.ne[1] > 1 else ne0 * 4
    if tt.nb[0] != 4:
        raise RuntimeError(f"tensor {tt.name!r}: non-contiguous rows are not supported")
    return np.lib.stride_tricks.as_strided(buf, shape=(ne1, ne0), strides=(nb1, 4)).copy()


def repack_enabled() -> bool:
    return os.environ.get("VIS_REPACK", "0") not in ("", "0", "false", "no")


class _Overrides:
    """A llama_model_kv_override array that stays alive as long as this object."""

    def __init__(self, kv: dict | None):
        kv = kv or {}
        self.arr = (L.llama_model_kv_override * (len(kv) + 1))()
        for i, (k, v) in enumerate(kv.items()):
            o = self.arr[i]
            o.key = k.encode()
            if isinstance(v, bool):
                o.tag, o.value.val_bool = L.LLAMA_KV_OVERRIDE_TYPE_BOOL, v
            elif isinstance(v, int):
                o.tag, o.value.val_i64 = L.LLAMA_KV_OVERRIDE_TYPE_INT, v
            elif isinstance(v, float):
                o.tag, o.value.val_f64 = L.LLAMA_KV_OVERRIDE_TYPE_FLOAT, v
            else:
                raise ValueError(f"kv override {k}: unsupported value {v!r}")
        self.arr[len(kv)].key = b"\0"


class Runner:
    """A model + context decoding token chunks, with an optional eval callback.

    ``want(name) -> bool`` selects intermediate tensors by name; ``on_tensor(name, array)``
    receives each one after it is computed (``raw``: the ``ggml_tensor *`` instead, to read its sources with
    :func:`read_tensor` while they are alive).  Every token outputs logits, so the last
    layer computes all rows (llama.cpp drops non-output rows before the last FFN).
    """

    def __init__(self, model_path: str, n_ctx: int = 512, n_threads: int | None = None,
                 kv_overrides: dict | None = None, want: Callable[[str], bool] | None = None,
                 on_tensor: Callable[[str, np.ndarray], None] | None = None, verbose: bool = False,
                 raw: bool = False):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(model_path)
        from llama_cpp import _logger
        _logger.set_verbose(verbose)
        self._ov = _Overrides(kv_overrides)
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repack_enabled()
        if kv_overrides:
            mp.kv_overrides = self._ov.arr
        self.model = I.LlamaModel(path_model=str(model_path), params=mp, verbose=verbose)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        nt = n_threads or max(1, min(os.cpu_count() or 1, 8))
        cp.n_threads = nt
        cp.n_threads_batch = nt
        self._cb = None
        if want is not None:
            def cb(t, ask, _ud):
                name = tensor_name(t)
                if ask:
                    return bool(want(name))
                on_tensor(name, t if raw else read_tensor(t))   # raw: the ggml_tensor pointer (its srcs too)
                return True
            self._cb = L.ggml_backend_sched_eval_callback(cb)
            cp.cb_eval = self._cb
        self.ctx = I.LlamaContext(model=self.model, params=cp, verbose=verbose)
        self.n_ctx = n_ctx
        self.n_vocab = self.model.n_vocab()
        self.batch = I.LlamaBatch(n_tokens=n_ctx, embd=0, n_seq_max=1)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.model.tokenize(text.encode("utf-8"), add_bos, False)

    @property
    def bos(self) -> int:
        return self.model.token_bos()

    def eval_chunk(self, tokens: list[int]) -> np.ndarray:
        """Decode one independent sequence (fresh KV); returns logits [n_tokens, n_vocab]."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"chunk of {len(tokens)} tokens > n_ctx {self.n_ctx}")
        self.ctx.kv_cache_clear()
        self.batch.set_batch(tokens, 0, True)
        self.ctx.decode(self.batch)
        ptr = L.llama_get_logits(self.ctx.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(tokens), self.n_vocab)).copy()

    def close(self) -> None:
        for o in ("batch", "ctx", "model"):
            x = getattr(self, o, None)
            if x is not None:
                x.close()
                setattr(self, o, None)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def chunk_tokens(tokens: list[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    """Split a token stream into ``n_ctx``-token chunks (BOS first, as llama-perplexity does).

    With ``n_chunks``, take that many chunks spread evenly over the whole stream."""
    body = n_ctx - (1 if bos is not None else 0)
    total = len(tokens) // body
    if total == 0:
        return []
    idx = list(range(total))
    if n_chunks is not None and n_chunks < total:
        idx = [int(i * total / n_chunks) for i in range(n_chunks)]
    out = []
    for i in idx:
        c = tokens[i * body:(i + 1) * body]
        out.append(([bos] if bos is not None else []) + c)
    return out
