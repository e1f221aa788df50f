// llama-vis.h - public C API of the vis-moe fork of llama.cpp.
//
// Everything the fork adds to libllama is declared here, as new functions
// (never new fields in upstream structs, so that the ctypes mirrors in
// llama-cpp-python stay valid).  Python: pyvis/runtime/capi.py (the mirror), native.py (the friendly layer).
//
// The declarations live in one file per concern, in this order (each includes the one before it; each is
// mirrored 1:1 by a section of pyvis/runtime/capi.py): llama-vis-moe.h (the build, residency, settings, stats,
// substitution, precision, capacity, prefetch), llama-vis-paging.h (paging tiers, memory probe, planner,
// configurator), llama-vis-vlm.h (visual-token pruning support).  Include this header.
#pragma once

#include "llama-vis-moe.h"
#include "llama-vis-paging.h"
#include "llama-vis-vlm.h"
