"""``from pyvis import _native`` (README, docs/vlm-native-api.md): the friendly bindings of the fork's C API.

The module is :mod:`pyvis.runtime.native` under its documented name (the same module object, not a copy).
"""
import sys

from .runtime import native as _module

sys.modules[__name__] = _module
