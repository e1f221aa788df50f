"""The result of pyvis.vlm.Session.prepare: a context holding the evaluated prompt (image and text tokens,
what pruning kept, timings, the expert cache's prefill stats), ready to generate."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .image import ImageReport


@dataclass
class Prepared:
    """A context holding the evaluated prompt, ready to generate."""
    session: object                  # the pyvis.vlm.Session that evaluated it (generate() goes through it)
    n_past: int
    logits: np.ndarray               # [n_vocab] logits of the last prompt token
    images: list[ImageReport]
    n_text_tokens: int
    method: str
    keep_ratio: float
    timings_ms: dict
    moe_stats: object = None         # pyvis.moe.MoeStats of the prefill (expert cache on), else None
    generated: list[int] = field(default_factory=list)

    @property
    def n_image_tokens(self) -> int:
        return sum(im.n_tokens for im in self.images)

    @property
    def n_image_kept(self) -> int:
        return sum(im.n_kept for im in self.images)

    def generate(self, n_predict: int = 32, temp: float = 0.0, seed: int = 0, top_k: int = 40,
                 on_text=None) -> str:
        return self.session.generate(self, n_predict, temp=temp, seed=seed, top_k=top_k, on_text=on_text)

    def summary(self) -> str:
        t = self.timings_ms
        out = [f"image tokens: kept {self.n_image_kept} of {self.n_image_tokens} "
               f"({self.method}, keep ratio {self.keep_ratio:g}); text tokens: {self.n_text_tokens}"]
        for im in self.images:
            src = f", saliency from {im.saliency_source}" if im.saliency_source else ""
            if im.core_coverage is not None:
                src += f", {im.probe} probe, core covers {100 * im.core_coverage:.0f}% of the prefix experts"
            out.append(f"  image {im.index}: {im.nx}x{im.ny} grid, kept {im.n_kept}/{im.n_tokens}{src}")
        keys = ["tokenize", "encode", "score", "probe", "select", "decode_image", "decode_text", "prefill"]
        out.append("timings: " + ", ".join(f"{k} {t.get(k, 0.0):.1f} ms" for k in keys if k in t))
        if self.moe_stats is not None:
            s = self.moe_stats
            out.append(f"expert cache (prefill): hit rate {s.hit_rate:.3f} ({s.n_hits}/{s.n_routed}), "
                       f"{s.bytes_loaded / (1 << 20):.2f} MiB loaded, {s.n_passes} passes")
        return "\n".join(out)
