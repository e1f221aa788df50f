"""The dense source of the MoE builder (pyvis.testbed.moefy): the GGUF it reads, its errors and progress."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gguf

Q = gguf.GGMLQuantizationType


class MoefyError(RuntimeError):
    """A user-facing error of the MoE builder (bad input model, bad preset, no text)."""


# --------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------
def _stderr_progress(msg: str) -> None:
    sys.stderr.write(f"[moefy] {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------
# the dense source
# --------------------------------------------------------------------------
@dataclass
class DenseModel:
    path: Path
    reader: gguf.GGUFReader
    n_layer: int
    n_embd: int
    n_ff: int
    tensors: dict = field(default_factory=dict)

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def ffn(self, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dequantised (Wg [n_ff, n_embd], Wu [n_ff, n_embd], Wd [n_embd, n_ff]) of layer il, float32."""
        out = []
        for n in ("ffn_gate", "ffn_up", "ffn_down"):
            t = self.tensors[f"blk.{il}.{n}.weight"]
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            out.append(w.reshape(int(t.shape[1]), int(t.shape[0])))
        return out[0], out[1], out[2]


def open_dense(path: str | os.PathLike) -> DenseModel:
    """Open and check a dense llama-architecture GGUF."""
    p = Path(path)
    if not p.is_file():
        raise MoefyError(f"model not found: {p}")
    try:
        r = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001
        raise MoefyError(f"{p}: not a readable GGUF file ({e})") from e
    arch_f = r.fields.get("general.architecture")
    arch = arch_f.contents() if arch_f else None
    tensors = {t.name: t for t in r.tensors}
    if arch != "llama":
        hint = " (it is already a MoE)" if arch and any(".ffn_gate_inp." in n for n in tensors) else ""
        raise MoefyError(f"{p}: architecture is {arch!r}{hint}; moefy needs a dense 'llama'-architecture GGUF")
    n_exp = r.fields.get("llama.expert_count")
    if (n_exp is not None and int(n_exp.contents()) > 0) or any("_exps." in n or ".ffn_gate_inp." in n
                                                                 for n in tensors):
        raise MoefyError(f"{p}: this llama-architecture GGUF is already a MoE (expert tensors / "
                         "llama.expert_count); moefy needs a dense model")

    def u(k):
        f = r.fields.get(k)
        if f is None:
            raise MoefyError(f"{p}: missing key {k}")
        return int(f.contents())
    m = DenseModel(p, r, u("llama.block_count"), u("llama.embedding_length"), u("llama.feed_forward_length"),
                   tensors)
    for il in range(m.n_layer):
        for n in ("ffn_gate", "ffn_up", "ffn_down", "ffn_norm"):
            if f"blk.{il}.{n}.weight" not in tensors:
                raise MoefyError(f"{p}: missing tensor blk.{il}.{n}.weight (not a SwiGLU llama model?)")
    return m

