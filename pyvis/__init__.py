"""pyvis: the Python side of vis-moe, a llama.cpp fork for MoE models on edge devices.

Importing pyvis points llama-cpp-python (`import llama_cpp`) at the fork's
native libraries (LLAMA_CPP_LIB_PATH / MTMD_CPP_LIB), so import pyvis first.
The fork's own C functions are bound in :mod:`pyvis.runtime` (``from pyvis import _native``
is its friendly layer, ``pyvis.moe`` loads models with the expert cache, ``pyvis.vlm`` prunes image tokens).
"""
from ._paths import configure_native_env as _configure_native_env

__version__ = "0.1.0"

_configure_native_env()
