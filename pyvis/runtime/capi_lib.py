"""The library handle of the ctypes mirror of src/api/llama-vis.h (:mod:`pyvis.runtime.capi`): libllama as
llama-cpp-python loaded it, :func:`ctypes_function` that binds one of its functions, and the opaque pointer types
every section of the mirror uses.  The sections (:mod:`.capi_moe`, :mod:`.capi_paging`, :mod:`.capi_vlm`) import
this module; :mod:`.capi` imports them all."""
from __future__ import annotations

import ctypes
from typing import Callable

from .. import _paths

_paths.configure_native_env()
_paths.lib_dir()  # clear error if the build is missing

import llama_cpp  # noqa: E402  (after the env is set)
from llama_cpp import llama_cpp as _ll  # noqa: E402

_lib = _ll._lib

if getattr(_lib, "llama_vis_version", None) is None:
    raise RuntimeError(f"llama_vis_version is missing from {_lib._name}: this libllama is not a vis-moe build. "
                       "Rebuild with scripts/setup.sh, or point VIS_LIB_DIR at our build/bin.")


class MissingSymbol(RuntimeError):
    """The loaded libllama predates a function of src/api/llama-vis.h."""


def ctypes_function(name: str, argtypes: list, restype) -> Callable:
    """Bind ``name`` from libllama with these types (the decorated function is only its documentation)."""
    def decorator(f: Callable) -> Callable:
        fn = getattr(_lib, name, None)
        if fn is None:
            def missing(*args, **kwargs):
                raise MissingSymbol(f"{name} is missing from {_lib._name}: this libllama is older than "
                                    "src/api/llama-vis.h. Rebuild it (scripts/setup.sh).")
            missing.__name__, missing.__doc__ = name, f.__doc__
            return missing
        fn.argtypes, fn.restype = argtypes, restype
        fn.__doc__ = f.__doc__
        return fn
    return decorator


# opaque pointers
llama_model_p = ctypes.c_void_p         # const struct llama_model *
llama_context_p = ctypes.c_void_p       # struct llama_context *
mtmd_context_p = ctypes.c_void_p        # const struct mtmd_context *
vis_saliency_state_p = ctypes.c_void_p  # struct vis_saliency_state *
ggml_context_p = ctypes.c_void_p        # struct ggml_context *
ggml_cgraph_p = ctypes.c_void_p         # struct ggml_cgraph *
ggml_tensor_p = ctypes.c_void_p         # struct ggml_tensor *
