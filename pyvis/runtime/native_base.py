"""The helpers of :mod:`pyvis.runtime.native` that its parts share (:mod:`pyvis.runtime.native_plan` too): VisError,
the last error of a C call, integers checked against their C type, structs to and from dicts, raw pointers."""
from __future__ import annotations

import ctypes
import operator

from . import capi


class VisError(RuntimeError):
    """A configuration or runtime error reported by the fork (llama_vis_last_error), or an argument out of range."""


def last_error() -> str:
    """Message of the last failed llama_vis_* call on this thread ("" if the last fallible call succeeded)."""
    return (capi.llama_vis_last_error() or b"").decode()


def _check(rc: int, what: str) -> int:
    """rc of a fallible call: raise VisError with that call's message when it is negative."""
    if rc < 0:
        raise VisError(last_error() or f"{what} failed")
    return rc


_C_RANGES = {t: (-(1 << (8 * ctypes.sizeof(t) - 1)), (1 << (8 * ctypes.sizeof(t) - 1)) - 1)
             for t in (ctypes.c_int32, ctypes.c_int64, ctypes.c_int)}


def c_int(name: str, value, ctype=ctypes.c_int32) -> int:
    """``value`` as an integer that fits ``ctype``, else VisError naming ``name`` and the range."""
    try:
        v = operator.index(value)
    except TypeError:
        raise VisError(f"{name} must be an integer, got {value!r}") from None
    lo, hi = _C_RANGES[ctype]
    if not lo <= v <= hi:
        raise VisError(f"{name} = {v} is out of range: the C argument is an int{8 * ctypes.sizeof(ctype)}_t "
                       f"({lo}..{hi})")
    return v


def fill_struct(struct: ctypes.Structure, values: dict, label=lambda field: field) -> ctypes.Structure:
    """Set integer fields of a C struct, each checked against its C type; ``label(field)`` names it in errors."""
    types = dict(struct._fields_)
    for k, v in values.items():
        if k not in types:
            raise VisError(f"{type(struct).__name__} has no field {k!r}")
        setattr(struct, k, c_int(label(k), v, types[k]))
    return struct


def _struct_dict(s: ctypes.Structure) -> dict:
    return {name: int(getattr(s, name)) for name, _ in s._fields_}


def _ptr(obj, attr: str):
    """The raw pointer inside a llama_cpp wrapper (``obj.attr``, twice for Llama -> _internals -> pointer)."""
    p = getattr(obj, attr, obj)
    return getattr(p, attr, p)


def _ctx_ptr(ctx):
    """A llama_context pointer from a llama_cpp.Llama, an _internals.LlamaContext or a pointer."""
    return _ptr(ctx, "ctx")


def _mtmd_ptr(mctx):
    """An mtmd_context pointer (c_void_p / int) or an object holding one in .ctx; None stays None."""
    return None if mctx is None else getattr(mctx, "ctx", mctx)
