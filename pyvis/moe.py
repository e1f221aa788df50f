"""``pyvis.moe.load(path, slots=...)`` (README, docs/residency.md): a llama_cpp.Llama with the expert cache.

The module is :mod:`pyvis.runtime.moe` under its documented name (the same module object, not a copy).
"""
import sys

from .runtime import moe as _module

sys.modules[__name__] = _module
