"""Reader for the routing trace written by `--moe-trace FILE` (src/vis-moe-cache.cpp).

Format (little endian), documented in docs/residency.md:

    header   char[8] "VISTRACE", u32 version (1), u32 n_layer, u32 n_expert, u32 n_expert_used
    record*  i32 tag 0x31434552 ("REC1"), i32 ubatch, i32 layer, i32 n_tokens, i32 k,
             i32 seq[n_tokens], i32 pos[n_tokens], u8 modality[n_tokens] (0 text, 1 embeddings/image),
             i32 ids[n_tokens*k], f32 weights[n_tokens*k]

One record per MoE layer per ubatch, in compute order.  `read()` flattens the
records into per-(token, layer) rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"VISTRACE"
REC_TAG = 0x31434552


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    n_layer: int
    n_expert: int
    n_expert_used: int
    ubatch: np.ndarray    # [N] int32, ubatch index of each row
    layer: np.ndarray     # [N] int32
    seq: np.ndarray       # [N] int32
    pos: np.ndarray       # [N] int32
    modality: np.ndarray  # [N] uint8 (0 text, 1 image/embeddings)
    ids: np.ndarray       # [N, k] int32, routed experts in top-k order
    weights: np.ndarray   # [N, k] float32, their gating weights

    def __len__(self) -> int:
        return len(self.layer)

    def layers(self) -> np.ndarray:
        return np.unique(self.layer)

    def for_layer(self, il: int) -> "Trace":
        m = self.layer == il
        return Trace(self.n_layer, self.n_expert, self.n_expert_used, self.ubatch[m], self.layer[m], self.seq[m],
                     self.pos[m], self.modality[m], self.ids[m], self.weights[m])

    def matrix(self, seq: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """ids as [n_layers_traced, n_tokens, k] in token order (one sequence), plus the layer list."""
        t = self if seq is None else self.for_mask(self.seq == seq)
        layers = t.layers()
        per = [t.for_layer(il) for il in layers]
        n = min(len(p) for p in per) if per else 0
        return np.stack([p.ids[:n] for p in per]) if per else np.zeros((0, 0, self.n_expert_used), np.int32), layers

    def for_mask(self, m: np.ndarray) -> "Trace":
        return Trace(self.n_layer, self.n_expert, self.n_expert_used, self.ubatch[m], self.layer[m], self.seq[m],
                     self.pos[m], self.modality[m], self.ids[m], self.weights[m])


def read(path: str | Path) -> Trace:
    data = Path(path).read_bytes()
    if len(data) < 24 or data[:8] != MAGIC:
        raise TraceError(f"{path}: not a vis-moe routing trace (bad magic)")
    version, n_layer, n_expert, k_model = np.frombuffer(data, np.uint32, 4, 8)
    if version != 1:
        raise TraceError(f"{path}: trace version {version} is not supported (expected 1)")
    off = 24
    cols: dict[str, list] = {c: [] for c in ("ubatch", "layer", "seq", "pos", "modality", "ids", "weights")}
    while off < len(data):
        if off + 20 > len(data):
            raise TraceError(f"{path}: truncated record header at byte {off}")
        tag, ub, il, n, k = np.frombuffer(data, np.int32, 5, off)
        if tag != REC_TAG:
            raise TraceError(f"{path}: bad record tag at byte {off}")
        off += 20
        need = n * 4 * 2 + n + n * k * 8
        if off + need > len(data):
            raise TraceError(f"{path}: truncated record at byte {off - 20} (the writer may still be running)")
        seq = np.frombuffer(data, np.int32, n, off); off += 4 * n
        pos = np.frombuffer(data, np.int32, n, off); off += 4 * n
        mod = np.frombuffer(data, np.uint8, n, off); off += n
        ids = np.frombuffer(data, np.int32, n * k, off).reshape(n, k); off += 4 * n * k
        w = np.frombuffer(data, np.float32, n * k, off).reshape(n, k); off += 4 * n * k
        cols["ubatch"].append(np.full(n, ub, np.int32))
        cols["layer"].append(np.full(n, il, np.int32))
        cols["seq"].append(seq)
        cols["pos"].append(pos)
        cols["modality"].append(mod)
        cols["ids"].append(ids)
        cols["weights"].append(w)
    k = int(k_model)
    cat = {c: (np.concatenate(v) if v else None) for c, v in cols.items()}
    if cat["ids"] is None:
        cat = dict(ubatch=np.zeros(0, np.int32), layer=np.zeros(0, np.int32), seq=np.zeros(0, np.int32),
                   pos=np.zeros(0, np.int32), modality=np.zeros(0, np.uint8), ids=np.zeros((0, k), np.int32),
                   weights=np.zeros((0, k), np.float32))
    return Trace(int(n_layer), int(n_expert), k, **cat)
