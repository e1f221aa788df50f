"""Quantisation through our own ggml build: ctypes on the built ``libggml-base`` (found as pyvis finds every other
library, :mod:`pyvis._paths`).  Used by ``pyvis shadow`` (:mod:`pyvis.runtime.shadow`) so that a shadow expert holds
exactly the bytes ggml's own quantiser gives; nothing here quantises by itself.

    dequantize(type, raw_rows, n_per_row)   ggml_get_type_traits(type)->to_float over whole rows
    quantize(type, f32_rows)                ggml_quantize_chunk(type, ..., imatrix = NULL)
    requires_imatrix(type)                  ggml_quantize_requires_imatrix
"""
from __future__ import annotations

import ctypes
import sys
from functools import lru_cache

import numpy as np

# the types ggml_quantize_chunk quantises (its switch, ggml/src/ggml.c at the pinned commit), by GGUF name
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS",
               "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
               "Q1_0")
# types a source tensor may have: float types converted with numpy, the rest through to_float
FLOAT_TYPES = ("F32", "F16", "BF16")


class QuantError(ValueError):
    """A type ggml cannot quantise to (here), or rows that do not fit its blocks."""


_to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _TypeTraits(ctypes.Structure):     # struct ggml_type_traits (ggml/include/ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """The built libggml-base (the one libllama links), from :func:`pyvis._paths.lib_dir`."""
    from .. import _paths
    name = "libggml-base.dylib" if sys.platform == "darwin" else "libggml-base.so"
    path = _paths.lib_dir() / name
    if not path.is_file():
        raise _paths.BuildNotFound(f"{name} is not in {path.parent}; rebuild with `cmake --build --preset cpu`.")
    g = ctypes.CDLL(str(path))
    g.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    g.ggml_get_type_traits.argtypes = [ctypes.c_int]
    g.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    g.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    g.ggml_quantize_chunk.restype = ctypes.c_size_t
    g.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    g.ggml_row_size.restype = ctypes.c_size_t
    g.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return g


def type_of(name: str):
    """The gguf package's GGMLQuantizationType called ``name`` (any case)."""
    import gguf
    try:
        return gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        raise QuantError(f"unknown ggml type {name!r}; one of {', '.join(QUANT_TYPES)}") from None


def traits(t) -> _TypeTraits:
    return lib().ggml_get_type_traits(int(t)).contents


def block_size(t) -> int:
    return int(traits(t).blck_size)


def row_bytes(t, n_per_row: int) -> int:
    return int(lib().ggml_row_size(int(t), int(n_per_row)))


def requires_imatrix(t) -> bool:
    return bool(lib().ggml_quantize_requires_imatrix(int(t)))


def check_target(name: str):
    """The shadow type ``name`` as a GGMLQuantizationType, or QuantError saying why it cannot be one."""
    t = type_of(name)
    if t.name not in QUANT_TYPES:
        raise QuantError(f"--type {t.name}: not a type ggml quantises to (the shadow must be a quantized type); "
                         f"one of {', '.join(n for n in QUANT_TYPES)}")
    if requires_imatrix(t):
        raise QuantError(f"--type {t.name}: ggml needs an importance matrix (imatrix) to quantise to {t.name}, and "
                         "pyvis shadow has none; choose a type without one, e.g. Q2_K, Q3_K or Q4_0")
    return t


def dequantize(t, raw: np.ndarray, n_per_row: int) -> np.ndarray:
    """Rows stored as type ``t`` (``raw``: uint8 [..., row_bytes], or the float array the gguf reader gives) as
    float32 [n_rows, n_per_row], through ggml's ``to_float``."""
    name = t.name
    if name == "F32":
        return np.ascontiguousarray(raw, np.float32).reshape(-1, n_per_row)
    if name == "F16":
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(-1, n_per_row)
    tr = traits(t)
    if not tr.to_float:
        raise QuantError(f"ggml cannot convert {name} to float (no to_float)")
    src = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    n = src.size // row_bytes(t, n_per_row) * n_per_row
    out = np.empty(n, np.float32)
    _to_float_t(tr.to_float)(src.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
    return out.reshape(-1, n_per_row)


def quantize(t, rows: np.ndarray) -> np.ndarray:
    """float32 rows [n_rows, n_per_row] quantised to ``t`` by ggml_quantize_chunk: uint8 [n_rows, row_bytes]."""
    rows = np.ascontiguousarray(rows, np.float32)
    n_rows, n_per_row = rows.shape
    if n_per_row % block_size(t):
        raise QuantError(f"rows of {n_per_row} values do not fit {t.name} blocks of {block_size(t)}")
    rb = row_bytes(t, n_per_row)
    out = np.empty((n_rows, rb), np.uint8)
    got = lib().ggml_quantize_chunk(int(t), rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data,
                                    0, n_rows, n_per_row, None)
    if got != out.nbytes:
        raise QuantError(f"ggml_quantize_chunk({t.name}) wrote {got} bytes, expected {out.nbytes}")
    return out
