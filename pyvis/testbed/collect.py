"""Routing traces: which experts each token selected at each MoE layer.

A trace is ``ids [n_layers, n_tokens, k]`` (expert ids, int16/int32), ``layers [n_layers]`` (the
model's layer index of each row) and ``n_expert``; saved as ``.npz``.

Until the C routing trace (``--moe-trace``) lands, :func:`collect` gets the routing from our build
through llama.cpp's eval callback: every MoE layer names its selected experts
``ffn_moe_topk-<il>`` (``build_moe_ffn``), and the callback copies that tensor after it is
computed.  Text is evaluated as llama-perplexity does: independent chunks of ``n_ctx`` tokens,
each starting with BOS (the BOS rows are dropped from the trace unless ``keep_bos``).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class TraceError(RuntimeError):
    pass


@dataclass
class Trace:
    ids: np.ndarray                       # [n_layers, n_tokens, k]
    n_expert: int
    layers: np.ndarray | None = None      # [n_layers]
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.ids = np.asarray(self.ids)
        if self.ids.ndim != 3:
            raise TraceError(f"a trace is [layers, tokens, k]; got shape {self.ids.shape}")
        if self.layers is None:
            self.layers = np.arange(self.ids.shape[0])
        self.layers = np.asarray(self.layers)
        if len(self.layers) != self.ids.shape[0]:
            raise TraceError("layers must name every row of ids")
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.n_expert):
            raise TraceError(f"expert ids must be in [0, {self.n_expert})")
        if self.ids.shape[2] > self.n_expert:
            raise TraceError("k > n_expert")
        if self.ids.size:
            srt = np.sort(self.ids, axis=2)
            if (srt[..., 1:] == srt[..., :-1]).any():
                raise TraceError("a token selects the same expert twice in one layer")

    @property
    def n_layers(self) -> int:
        return self.ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[1]

    @property
    def k(self) -> int:
        return self.ids.shape[2]

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        dt = np.int16 if self.n_expert < 32768 else np.int32
        with open(p, "wb") as f:
            np.savez_compressed(f, ids=self.ids.astype(dt), layers=self.layers, n_expert=np.int64(self.n_expert),
                                meta=np.array(json.dumps(self.meta)))
        return p


def from_vis_trace(path: str | os.PathLike, seq: int | None = None) -> Trace:
    """A trace written by the fork's `--moe-trace FILE` (pyvis.runtime.trace) as [layers, tokens, k].

    Layers that saw fewer rows than the others (upstream computes the last layer
    for output rows only) are left out, and so are rows of other sequences when
    `seq` is given.
    """
    from ..runtime import trace as vis_trace
    t = vis_trace.read(path)
    if seq is not None:
        t = t.for_mask(t.seq == seq)
    per = {int(il): t.for_layer(int(il)) for il in t.layers()}
    if not per:
        raise TraceError(f"{path}: the trace holds no routing records")
    n = max(len(x) for x in per.values())
    keep = [il for il, x in per.items() if len(x) == n]
    return Trace(ids=np.stack([per[il].ids for il in keep]), n_expert=t.n_expert, layers=np.array(keep),
                 meta={"source": str(path), "format": "vis-moe trace v1"})


def load(path: str | os.PathLike) -> Trace:
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace not found: {p}")
    with open(p, "rb") as f:
        if f.read(8) == b"VISTRACE":
            return from_vis_trace(p)
    try:
        z = np.load(p, allow_pickle=False)
        return Trace(ids=z["ids"], n_expert=int(z["n_expert"]), layers=z["layers"],
                     meta=json.loads(str(z["meta"])) if "meta" in z else {})
    except (KeyError, ValueError, OSError) as e:
        raise TraceError(f"{p}: not a routing trace (.npz with ids, layers, n_expert): {e}") from e


_TOPK = re.compile(r"^ffn_moe_topk-(\d+)$")


def collect(model_path: str | os.PathLike, text: str, n_ctx: int = 256, n_expert_used: int | None = None,
            n_chunks: int | None = None, n_threads: int | None = None, keep_bos: bool = False,
            arch_key: str | None = None, progress=None) -> Trace:
    """Run ``text`` through the model and record every MoE layer's selected experts."""
    from . import _llm
    import gguf
    if not text or not text.strip():
        raise TraceError("the text is empty")
    r = gguf.GGUFReader(str(model_path))
    arch = r.fields["general.architecture"].contents()
    n_expert = int(r.fields[f"{arch}.expert_count"].contents()) if f"{arch}.expert_count" in r.fields else 0
    if n_expert == 0:
        raise TraceError(f"{model_path}: not a MoE model ({arch}.expert_count missing or 0)")
    k_file = int(r.fields[f"{arch}.expert_used_count"].contents())
    del r
    kv = {f"{arch_key or arch}.expert_used_count": int(n_expert_used)} if n_expert_used else None
    per_layer: dict[int, list[np.ndarray]] = {}

    def on_tensor(name, arr):
        per_layer.setdefault(int(_TOPK.match(name).group(1)), []).append(arr)

    with _llm.Runner(str(model_path), n_ctx=n_ctx, n_threads=n_threads, kv_overrides=kv,
                     want=lambda n: _TOPK.match(n) is not None, on_tensor=on_tensor) as run:
        toks = run.tokenize(text, add_bos=False)
        chunks = _llm.chunk_tokens(toks, n_ctx, n_chunks, run.bos)
        if not chunks:
            raise TraceError(f"the text is too short ({len(toks)} tokens) for one chunk of {n_ctx}")
        t0 = time.monotonic()
        for i, c in enumerate(chunks):
            run.eval_chunk(c)
            if progress and (i + 1 == len(chunks) or (i + 1) % max(1, len(chunks) // 10) == 0):
                progress(f"routing trace: chunk {i + 1}/{len(chunks)} "
                         f"({(i + 1) * n_ctx / max(time.monotonic() - t0, 1e-9):.0f} tok/s)")
    layers = sorted(per_layer)
    ids = []
    for il in layers:
        parts = per_layer[il]
        if len(parts) != len(chunks):
            raise TraceError(f"layer {il}: got {len(parts)} routing tensors for {len(chunks)} chunks")
        parts = [p if keep_bos else p[1:] for p in parts]
        ids.append(np.concatenate(parts, axis=0))
    ids = np.stack(ids)
    meta = {"model": str(model_path), "n_ctx": n_ctx, "n_chunks": len(chunks), "keep_bos": keep_bos,
            "k": int(ids.shape[2]), "k_file": k_file}
    return Trace(ids=ids.astype(np.int32), n_expert=n_expert, layers=np.array(layers), meta=meta)


def _progress(msg: str) -> None:
    sys.stderr.write(f"[trace] {msg}\n")
    sys.stderr.flush()
