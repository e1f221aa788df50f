"""Visual-token pruning for MoE vision-language models served through libmtmd (docs/pruning.md).

    import pyvis.vlm as vlm
    p = vlm.prepare("model.gguf", "Describe the image.", ["cat.png"], mmproj="mmproj.gguf",
                    keep_ratio=0.5, method="affinity")
    print(p.summary()); print(p.generate(32))

    session    Session: model + mmproj + context; prepare() evaluates a pruned prompt
    prune      token selection: Algorithm 1 (affinity) and the baselines (pure numpy)
    report     `pyvis prune-report` and `pyvis prune-sim`
    evaluate   `pyvis prune-eval`: accuracy and latency over image/question/answer items
"""
from ..runtime.settings import MoeParams
from .session import (SALIENCY_SOURCES, ImageReport, Prepared, Session, VLMError, kept_positions, mrope_positions,
                      next_position, prepare, read_decode_trace)

__all__ = ["MoeParams", "SALIENCY_SOURCES", "ImageReport", "Prepared", "Session", "VLMError", "kept_positions",
           "mrope_positions", "next_position", "prepare", "read_decode_trace"]
