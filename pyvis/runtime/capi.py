"""1:1 ctypes mirror of src/api/llama-vis.h, the fork's public C API, in the header's order.

Each struct has its ``_fields_`` in the header's order and each function its C declaration above it,
as llama-cpp-python's ``llama_cpp/llama_cpp.py`` does.  Nothing here converts or checks values: the
friendly layer is :mod:`pyvis.runtime.native` (dataclasses, VisError, range checks) and
:mod:`pyvis.runtime.settings`.  tests/test_settings.py holds these files to the header.

The functions come from the very library handle llama-cpp-python loaded, so pointers from ``llama_cpp``
(models, contexts) and ``llama_cpp.mtmd_cpp`` (mtmd contexts) can be passed straight in.  A libllama that is
not a vis-moe build fails at import; a function an older vis-moe build lacks raises :class:`MissingSymbol`
when called, not at import.

This module is the whole API in one namespace; the header's sections live in files of their own, each in the
header's order and each importing only :mod:`.capi_lib` (the library handle, :func:`ctypes_function`, the opaque
pointer types) and the sections before it: :mod:`.capi_moe` (the build, residency, settings, stats, substitution
and prefetch), :mod:`.capi_paging` (paging tiers, memory probe and planner) and :mod:`.capi_vlm` (visual-token
pruning support).
"""
from __future__ import annotations

from .capi_lib import *  # noqa: F401,F403
from .capi_lib import llama_cpp  # noqa: F401  (re-exported: the llama_cpp bound to our build)
# the header's sections, in its order
from .capi_moe import *  # noqa: F401,F403
from .capi_paging import *  # noqa: F401,F403
from .capi_vlm import *  # noqa: F401,F403
