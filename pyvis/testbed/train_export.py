"""Writing the trained MoE (``pyvis testbed train``) as a ``qwen3moe`` GGUF, and the weights as llama.cpp sees them.

numpy only (no torch): :func:`stored_weights` rounds each tensor the way the file stores it (routed experts
F16, token embedding Q8_0, the rest F32), so the torch model can be checked against llama.cpp on the very
weights the file holds.  The tokenizer is SmolLM2's (:func:`pyvis.fixtures.tokenizer.tokenizer_fields`), the
tensors go through the testbed's streaming writer (:class:`pyvis.testbed.writer._Out`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import numpy as np

import gguf

from ..fixtures.tokenizer import tokenizer_fields
from .writer import _Out

ARCH = "qwen3moe"
EXPERT_TYPE = "F16"     # the routed experts: most of the file
EMBED_TYPE = "Q8_0"     # token embedding, tied with the output
V = gguf.GGUFValueType


def tensor_types(n_layer: int) -> dict[str, str]:
    """GGUF tensor name -> stored type for every tensor of the file."""
    out = {"token_embd.weight": EMBED_TYPE, "output_norm.weight": "F32"}
    for il in range(n_layer):
        p = f"blk.{il}."
        for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                  "ffn_norm", "ffn_gate_inp"):
            out[p + n + ".weight"] = "F32"
        for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            out[p + n + ".weight"] = EXPERT_TYPE
    return out


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "F32":
        return a
    if dtype == "F16":
        return a.astype(np.float16).astype(np.float32)
    qt = gguf.GGMLQuantizationType[dtype]
    return gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt).reshape(a.shape).astype(np.float32)


def stored_weights(weights: dict[str, np.ndarray], n_layer: int) -> dict[str, np.ndarray]:
    """The float32 values llama.cpp reads back from the file for each tensor."""
    types = tensor_types(n_layer)
    return {k: _round(v, types[k]) for k, v in weights.items()}


def write_gguf(path: str | Path, cfg: dict, weights: dict[str, np.ndarray], provenance: dict,
               progress: Callable[[str], None] | None = None) -> Path:
    """Write ``weights`` (GGUF names, numpy order) with ``cfg`` (:class:`train_model.MoeConfig` as a dict)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    types = tensor_types(cfg["n_layer"])
    missing = sorted(set(types) - set(weights))
    if missing:
        raise ValueError(f"weights lack {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    out = _Out(path, ARCH)
    w, a = out.w, ARCH
    w.add_name("vis-moe trained qwen3moe testbed")
    w.add_uint32(f"{a}.context_length", cfg["n_ctx"])
    w.add_uint32(f"{a}.embedding_length", cfg["n_embd"])
    w.add_uint32(f"{a}.block_count", cfg["n_layer"])
    w.add_uint32(f"{a}.feed_forward_length", cfg["n_ff_exp"] * cfg["n_expert_used"])
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg["n_ff_exp"])
    w.add_uint32(f"{a}.attention.head_count", cfg["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", cfg["n_head_kv"])
    w.add_uint32(f"{a}.attention.key_length", cfg["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", cfg["head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_eps"])
    w.add_float32(f"{a}.rope.freq_base", cfg["rope_base"])
    w.add_uint32(f"{a}.expert_count", cfg["n_expert"])
    w.add_uint32(f"{a}.expert_used_count", cfg["n_expert_used"])
    w.add_uint32(f"{a}.vocab_size", cfg["n_vocab"])
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for k, v, vt, sub in tokenizer_fields():
        if vt == V.ARRAY:
            w.add_key_value(k, v, vt, sub_type=sub)
        else:
            w.add_key_value(k, v, vt)
    w.add_key_value("vis.trained.provenance", json.dumps(provenance, sort_keys=True), V.STRING)
    for name, t in types.items():
        arr = weights[name]
        out.add(name, tuple(arr.shape), t, lambda arr=arr: arr)
    out.finish(progress)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return path
