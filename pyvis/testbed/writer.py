"""Writing the builder's GGUFs (pyvis.testbed.moefy): the dense F32 reference and the MoE, tensor by tensor."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

import gguf

from .dense import DenseModel, MoefyError, Q, _stderr_progress, open_dense
from .partition import LayerPlan
from .spec import MoefySpec


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------
_SKIP_KEYS = {"general.architecture", "general.file_type"}


def _copy_metadata(w: gguf.GGUFWriter, src: DenseModel, arch: str, n_layers: int, extra: dict) -> None:
    for k, f in src.reader.fields.items():
        if k.startswith("GGUF.") or k in _SKIP_KEYS:
            continue
        vt = f.types[0]
        v = f.contents()
        if k.startswith("llama."):
            k = arch + k[len("llama"):]
        if k == f"{arch}.block_count":
            v = n_layers
        if k in extra:
            continue
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, vt, sub_type=f.types[1] if len(f.types) > 1 else None)
        else:
            w.add_key_value(k, v, vt)
    for k, (v, vt) in extra.items():
        w.add_key_value(k, v, vt)


class _Out:
    """Streaming GGUF writer: declare every tensor first, then produce data in the same order."""

    def __init__(self, path: Path, arch: str):
        self.path = path
        self.tmp = path.with_name(path.name + ".part")
        self.w = gguf.GGUFWriter(str(self.tmp), arch)
        self.plan: list[tuple[str, Callable[[], np.ndarray]]] = []

    def add_src(self, t, outtype: str | None) -> None:
        """Copy a source tensor; quantised ones are dequantised to ``outtype`` unless it is None."""
        if outtype is None or t.tensor_type in (Q.F32,) or len(t.shape) < 2 or t.tensor_type == Q[outtype]:
            return self.add_raw(t)
        shape = tuple(int(x) for x in reversed(t.shape))
        self.add(t.name, shape, outtype,
                 lambda t=t: gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))

    def add_raw(self, t) -> None:
        qt = t.tensor_type
        nbytes = int(t.n_bytes)
        if qt in (Q.F32, Q.F16):
            shape = tuple(int(x) for x in reversed(t.shape))
            self.w.add_tensor_info(t.name, shape, np.dtype(np.float32 if qt == Q.F32 else np.float16), nbytes)
        else:
            self.w.add_tensor_info(t.name, tuple(int(x) for x in t.data.shape), np.dtype(np.uint8), nbytes,
                                   raw_dtype=qt)
        self.plan.append((t.name, lambda t=t: np.asarray(t.data)))

    def add(self, name: str, shape: tuple[int, ...], dtype: str, fn: Callable[[], np.ndarray]) -> None:
        """shape in numpy order (slowest first); dtype F32, F16 or a quantised type (e.g. Q8_0)."""
        if dtype not in ("F32", "F16"):
            qt = Q[dtype]
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            nbytes = int(np.prod(shape[:-1])) * shape[-1] // bs * ts
            self.w.add_tensor_info(name, tuple(shape[:-1]) + (shape[-1] // bs * ts,), np.dtype(np.uint8), nbytes,
                                   raw_dtype=qt)
            self.plan.append((name, lambda: gguf.quants.quantize(fn().astype(np.float32, copy=False), qt)))
            return
        npdt = np.dtype(np.float32 if dtype == "F32" else np.float16)
        self.w.add_tensor_info(name, shape, npdt, int(np.prod(shape)) * npdt.itemsize)
        self.plan.append((name, lambda: fn().astype(npdt, copy=False)))

    def finish(self, progress: Callable[[str], None] | None = None) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_ti_data_to_file()
        t0 = time.monotonic()
        last = t0
        for i, (name, fn) in enumerate(self.plan):
            self.w.write_tensor_data(np.ascontiguousarray(fn()))
            if progress and (time.monotonic() - last > 10 or i + 1 == len(self.plan)):
                last = time.monotonic()
                progress(f"writing {self.path.name}: tensor {i + 1}/{len(self.plan)} ({name})")
        self.w.close()
        os.replace(self.tmp, self.path)
        return self.path


def _common_tensors(out: _Out, src: DenseModel, il: int, outtype: str | None) -> None:
    for t in src.reader.tensors:
        if t.name.startswith(f"blk.{il}.") and ".ffn_" not in t.name:
            out.add_src(t, outtype)
    out.add_raw(src.tensors[f"blk.{il}.ffn_norm.weight"])


class _FFNCache:
    """Dequantise each layer's FFN once while writing (tensors of a layer are written together)."""

    def __init__(self, src: DenseModel):
        self.src, self.il, self.w = src, None, None

    def get(self, il: int):
        if self.il != il:
            self.il, self.w = il, self.src.ffn(il)
        return self.w


def write_dense(src: DenseModel | str | os.PathLike, path: str | os.PathLike, n_layers: int | None = None,
                outtype: str = "F32", keep_quant: bool = False, progress: Callable[[str], None] | None = _stderr_progress) -> Path:
    """The dense reference: ``llama`` arch, weights dequantised to ``outtype`` (with ``keep_quant``: the
    FFN only), first ``n_layers`` layers."""
    if not isinstance(src, DenseModel):
        src = open_dense(src)
    nl = n_layers or src.n_layer
    if not 1 <= nl <= src.n_layer:
        raise MoefyError(f"n_layers must be in [1, {src.n_layer}] (got {n_layers})")
    outtype = outtype.upper()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = _Out(path, "llama")
    _copy_metadata(out.w, src, "llama", nl, {
        "general.description": (f"vis-moe dense reference of {src.path.name}: "
                                f"{'FFN' if keep_quant else 'weights'} dequantised to {outtype}, "
                                f"{nl} layers", gguf.GGUFValueType.STRING)})
    other = None if keep_quant else outtype
    for t in src.reader.tensors:
        if not t.name.startswith("blk."):
            out.add_src(t, other)
    cache = _FFNCache(src)
    d, F = src.n_embd, src.n_ff
    for il in range(nl):
        _common_tensors(out, src, il, other)
        out.add(f"blk.{il}.ffn_gate.weight", (F, d), outtype, lambda il=il: cache.get(il)[0])
        out.add(f"blk.{il}.ffn_up.weight", (F, d), outtype, lambda il=il: cache.get(il)[1])
        out.add(f"blk.{il}.ffn_down.weight", (d, F), outtype, lambda il=il: cache.get(il)[2])
    return out.finish(progress)


def write_moe(src: DenseModel, spec: MoefySpec, plans: dict[int, LayerPlan], path: str | os.PathLike,
              provenance: dict, progress: Callable[[str], None] | None = _stderr_progress) -> Path:
    nl = spec.n_layers or src.n_layer
    E, d, F = spec.n_expert, src.n_embd, src.n_ff
    m = (F - spec.n_shared) // E
    # stock llama.cpp's deepseek loader requires the shared-expert tensors and rejects zero-size ones
    # (GGML_ASSERT in weight_buft_supported), so "no shared neurons" is one all-zero shared expert of
    # m neurons: silu(0) * 0 = 0, it adds exactly nothing (and costs m neurons of compute).
    n_sh_exp = max(1, spec.n_shared // m)
    ot = spec.outtype.upper()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = _Out(path, "deepseek")
    V = gguf.GGUFValueType
    extra = {
        "deepseek.block_count": (nl, V.UINT32),
        "deepseek.leading_dense_block_count": (spec.dense_layers, V.UINT32),
        "deepseek.expert_count": (E, V.UINT32),
        "deepseek.expert_used_count": (spec.n_expert_used, V.UINT32),
        "deepseek.expert_shared_count": (n_sh_exp, V.UINT32),
        "deepseek.expert_feed_forward_length": (m, V.UINT32),
        "deepseek.expert_weights_scale": (float(E), V.FLOAT32),
        "general.description": (f"vis-moe MoEfied {src.path.name}: {spec.n_shared} shared neurons + {E} experts x "
                                f"{m}, top-{spec.n_expert_used} by default", V.STRING),
        "vis.moefy.spec": (json.dumps(asdict(spec), sort_keys=True), V.STRING),
        "vis.moefy.key": (spec.key(), V.STRING),
        "vis.moefy.provenance": (json.dumps(provenance, sort_keys=True), V.STRING),
    }
    _copy_metadata(out.w, src, "deepseek", nl, extra)
    other = None if spec.keep_quant else ot
    for t in src.reader.tensors:
        if not t.name.startswith("blk."):
            out.add_src(t, other)
    cache = _FFNCache(src)
    for il in range(nl):
        _common_tensors(out, src, il, other)
        p = f"blk.{il}."
        if il < spec.dense_layers:
            out.add(p + "ffn_gate.weight", (F, d), ot, lambda il=il: cache.get(il)[0])
            out.add(p + "ffn_up.weight", (F, d), ot, lambda il=il: cache.get(il)[1])
            out.add(p + "ffn_down.weight", (d, F), ot, lambda il=il: cache.get(il)[2])
            continue
        pl = plans[il]
        G = np.stack(pl.groups)                                             # [E, m]
        out.add(p + "ffn_gate_inp.weight", (E, d), "F32", lambda pl=pl: pl.router.T)
        out.add(p + "ffn_gate_exps.weight", (E, m, d), ot, lambda il=il, G=G: cache.get(il)[0][G])
        out.add(p + "ffn_up_exps.weight", (E, m, d), ot, lambda il=il, G=G: cache.get(il)[1][G])
        out.add(p + "ffn_down_exps.weight", (E, d, m), ot,
                lambda il=il, G=G: np.stack([cache.get(il)[2][:, g] for g in G]))
        sh = pl.shared
        if len(sh) == 0:
            z = np.zeros((m, d), np.float32)
            out.add(p + "ffn_gate_shexp.weight", (m, d), ot, lambda z=z: z)
            out.add(p + "ffn_up_shexp.weight", (m, d), ot, lambda z=z: z)
            out.add(p + "ffn_down_shexp.weight", (d, m), ot, lambda z=z: z.T)
            continue
        out.add(p + "ffn_gate_shexp.weight", (len(sh), d), ot, lambda il=il, sh=sh: cache.get(il)[0][sh])
        out.add(p + "ffn_up_shexp.weight", (len(sh), d), ot, lambda il=il, sh=sh: cache.get(il)[1][sh])
        out.add(p + "ffn_down_shexp.weight", (d, len(sh)), ot, lambda il=il, sh=sh: cache.get(il)[2][:, sh])
    return out.finish(progress)

