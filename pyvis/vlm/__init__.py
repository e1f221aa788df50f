"""Visual-token pruning for MoE vision-language models served through libmtmd (docs/pruning.md).

    import pyvis.vlm as vlm
    p = vlm.prepare("model.gguf", "Describe the image.", ["cat.png"], mmproj="mmproj.gguf",
                    keep_ratio=0.5, method="affinity")
    print(p.summary()); print(p.generate(32))

    session    Session: model + mmproj + context; prepare() evaluates a pruned prompt chunk by chunk
    image      one image chunk: encode, score, probe, select, decode at the kept positions
    probe      the affinity probe (native prefix probe, shadow context); read_decode_trace
    context    a llama context with its batch: text and embedding decodes at explicit positions; VLMError
    prune      token selection: Algorithm 1 (affinity) and the baselines (pure numpy)
    chat       `pyvis chat`, and the options chat, prune-report and prune-eval share
    report     `pyvis prune-report` and `pyvis prune-sim`
    evaluate   `pyvis prune-eval`: accuracy and latency over image/question/answer items
"""
from ..runtime.config import MoeConfig
from ..runtime.settings import MoeParams
from .context import VLMError
from .image import ImageOptions, ImageReport, kept_positions, mrope_positions, next_position
from .probe import read_decode_trace
from .session import SALIENCY_SOURCES, Prepared, Session, prepare

__all__ = ["MoeConfig", "MoeParams", "SALIENCY_SOURCES", "ImageOptions", "ImageReport", "Prepared", "Session", "VLMError",
           "kept_positions", "mrope_positions", "next_position", "prepare", "read_decode_trace"]
