"""Routing of a model on text through llama.cpp's eval callback (``pyvis report -m MODEL``).

:func:`collect` returns a :class:`pyvis.runtime.trace.Trace` (the one trace model; save it with
``Trace.save``, read it with ``pyvis.runtime.trace.load``).  It needs no cache flags and works on any
GGUF with experts, including testbed models run with another top-k (``n_expert_used``); with the
fork's runtime the same routing is also written by ``--moe-trace``.  It gets the routing from our build
through llama.cpp's eval callback: every MoE layer names its selected experts
``ffn_moe_topk-<il>`` (``build_moe_ffn``), and the callback copies that tensor after it is
computed.  Text is evaluated as llama-perplexity does: independent chunks of ``n_ctx`` tokens,
each starting with BOS (the BOS rows are dropped from the trace unless ``keep_bos``).
"""
from __future__ import annotations

import os
import re
import time

import numpy as np

from ..runtime.trace import Trace, TraceError


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
    return Trace.from_routes(ids.astype(np.int32), n_expert, np.array(layers), meta)
