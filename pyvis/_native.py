"""ctypes bindings for the fork's own C API (src/llama-vis.h), in one place.

They use the very library handle llama-cpp-python loaded, so pointers from
`llama_cpp` (models, contexts) can be passed straight in.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from . import _paths

_paths.configure_native_env()
_paths.lib_dir()  # clear error if the build is missing

import llama_cpp  # noqa: E402  (after the env is set)
from llama_cpp import llama_cpp as _ll  # noqa: E402

_lib = _ll._lib


class llama_vis_moe_info(ctypes.Structure):
    _fields_ = [
        ("n_layer", ctypes.c_int32),
        ("n_moe_layers", ctypes.c_int32),
        ("first_moe_layer", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("n_expert_shared", ctypes.c_int32),
        ("has_shared_exp", ctypes.c_int32),
        ("has_exp_bias", ctypes.c_int32),
        ("has_gate_up_exp", ctypes.c_int32),
        ("expert_bytes", ctypes.c_int64),
        ("routed_bytes", ctypes.c_int64),
    ]


def _bind(name: str, argtypes: list, restype):
    try:
        fn = getattr(_lib, name)
    except AttributeError as e:
        raise RuntimeError(
            f"{name} is missing from {_paths.lib_dir()}: this libllama is not a vis-moe build "
            "(or an old one). Rebuild with scripts/setup.sh.") from e
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_version = _bind("llama_vis_version", [], ctypes.c_char_p)
_upstream = _bind("llama_vis_upstream_commit", [], ctypes.c_char_p)
_sysinfo = _bind("llama_vis_system_info", [], ctypes.c_char_p)
_moe_info = _bind("llama_vis_model_moe_info", [ctypes.c_void_p, ctypes.POINTER(llama_vis_moe_info)], ctypes.c_int32)


def version() -> str:
    return _version().decode()


def upstream_commit() -> str:
    return _upstream().decode()


def system_info_fragment() -> str:
    return _sysinfo().decode()


@dataclass(frozen=True)
class MoeInfo:
    n_layer: int
    n_moe_layers: int
    first_moe_layer: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    has_shared_exp: bool
    has_exp_bias: bool
    has_gate_up_exp: bool
    expert_bytes: int
    routed_bytes: int


def moe_info(model) -> MoeInfo:
    """MoE shape of a loaded model (a `llama_cpp.Llama`, or a raw llama_model pointer)."""
    ptr = getattr(model, "model", model)          # llama_cpp.Llama -> pointer
    ptr = getattr(ptr, "model", ptr)              # _internals.LlamaModel -> pointer
    info = llama_vis_moe_info()
    if _moe_info(ptr, ctypes.byref(info)) != 0:
        raise ValueError("llama_vis_model_moe_info: NULL model")
    return MoeInfo(**{name: (bool(getattr(info, name)) if name.startswith("has_") else int(getattr(info, name)))
                      for name, _ in llama_vis_moe_info._fields_})


__all__ = ["llama_cpp", "version", "upstream_commit", "system_info_fragment", "moe_info", "MoeInfo"]
