// vis-owner.h - members that patches add to upstream's internal C++ classes.
//
// The fork's per-context state is owned by the object it belongs to and dies with
// it, as llama_context owns its memory module:
//   llama_context::vis_moe      expert cache        (patch 0002, src/core/vis-moe-context.h)
//   llama_context::vis_capture  routing capture     (patch 0011, src/vlm/vis-moe-capture.cpp)
//   mtmd_context::vis_saliency  encoder saliency    (patch 0010, src/vlm/vis-mtmd-saliency.cpp)
// Upstream's headers see only these incomplete types and their deleter, so they
// need none of our headers.  The public C structs never change.
#pragma once

#include <memory>

struct vis_moe_context;
struct vis_capture_state;
struct vis_saliency_state;

struct vis_deleter {
    void operator()(vis_moe_context * p) const;     // src/core/vis-moe-context.cpp
    void operator()(vis_capture_state * p) const;   // src/vlm/vis-moe-capture.cpp
    void operator()(vis_saliency_state * p) const;  // src/vlm/vis-mtmd-saliency.cpp
};

template <typename T>
using vis_owned = std::unique_ptr<T, vis_deleter>;
