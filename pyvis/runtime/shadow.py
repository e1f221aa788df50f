"""Shadow experts: a GGUF sidecar with a low-bit copy of every routed expert of a model's chosen layers
(``pyvis shadow``, ``--moe-shadow``; docs/shadow.md, issue #14).

Each model tensor ``blk.L.ffn_{gate,up,down,gate_up}_exps.weight`` of a chosen layer is dequantised to f32 and
quantised to the shadow type through our own ggml build (:mod:`pyvis.runtime.ggml_quant`: ``to_float`` and
``ggml_quantize_chunk``; nothing is quantised here), one expert at a time, and stored under the same name with
the same ``ne`` and the new type, so one shadow expert is one contiguous slice of ``nb2`` bytes that a positioned
read fetches (the C loader, src/features/vis-moe-shadow.h).  Keys: the profile header and fingerprint of
:mod:`pyvis.runtime.profile` (``vis.profile.kind = "shadow"``, version 1, ``vis.model.*``; ``vis.profile.k`` = the
model's top-k, ``vis.profile.n_tokens`` = 0, ``vis.profile.source`` = the model's file name), then

    vis.shadow.type                     string  the shadow type (GGUF name, e.g. "Q4_0")
    vis.shadow.layers                   [u32]   the layers written, ascending
    vis.shadow.model_bytes              u64     bytes of those tensors in the model
    vis.shadow.source_type.<tensor>     string  the model tensor's type, one key per tensor

and, after the shadow tensors, one more tensor:

    vis.shadow.sums                     I64 [n_tensors, n_expert]  row j: the checksum (:func:`profile.bytes_sum`,
                                        stored as u64) of each expert's slice of the j-th shadow tensor, in file
                                        order; the runtime checks each expert it reads against it (docs/shadow.md)
"""
from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import ggml_quant as gq
from . import profile as prof

KIND = "shadow"
VERSION = 1
K_TYPE, K_LAYERS, K_MODEL_BYTES = "vis.shadow.type", "vis.shadow.layers", "vis.shadow.model_bytes"
K_SRC = "vis.shadow.source_type."
T_SUMS = "vis.shadow.sums"
PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
_EXPS = re.compile(r"blk\.(\d+)\.(" + "|".join(PARTS) + r")\.weight")
ShadowError = prof.ProfileError


@dataclass
class ShadowFile:
    path: Path
    arch: str
    n_layer: int
    n_expert: int
    router_hash: int
    type: str
    layers: list[int]
    model_bytes: int
    shadow_bytes: int
    tensors: dict            # name -> (source type name, ne tuple, reader tensor)


def expert_tensors(readers: list) -> list:
    """The routed-expert weight tensors of an open model (the readers of its files, :func:`profile.model_readers`),
    by layer then name: ``[(layer, tensor), ...]``."""
    out = [(int(m.group(1)), t) for r in readers for t in r.tensors if (m := _EXPS.fullmatch(t.name))]
    return sorted(out, key=lambda x: (x[0], PARTS.index(x[1].name.split(".")[2])))


def parse_layers(spec: str, moe_layers: list[int], n_layer: int, pinned: int = 0) -> list[int]:
    """``all`` (every layer with routed experts), ``managed`` (those after the first ``pinned`` MoE layers, as
    --moe-pinned-layers) or ``N..M`` (inclusive; every layer in it must have routed experts)."""
    if spec == "all":
        return list(moe_layers)
    if spec == "managed":
        if not 0 <= pinned <= len(moe_layers):
            raise ShadowError(f"--pinned {pinned}: must be in 0..{len(moe_layers)} (the model's MoE layers)")
        return list(moe_layers[pinned:])
    m = re.fullmatch(r"(\d+)\.\.(\d+)", spec)
    if not m:
        raise ShadowError(f"--layers {spec!r}: expected all, managed or N..M (e.g. 4..27)")
    a, b = int(m.group(1)), int(m.group(2))
    if not a <= b < n_layer:
        raise ShadowError(f"--layers {spec}: expected N <= M < {n_layer} (the model's layers)")
    missing = [il for il in range(a, b + 1) if il not in moe_layers]
    if missing:
        raise ShadowError(f"--layers {spec}: layer {missing[0]} has no routed experts "
                          f"(MoE layers: {moe_layers[0]}..{moe_layers[-1]})")
    return list(range(a, b + 1))


def default_out(model: Path, type_name: str) -> Path:
    return model.with_name(f"{model.stem}.shadow-{type_name}.gguf")


def _shadow_expert(src_type, dst_type, raw: np.ndarray, ne0: int) -> np.ndarray:
    return gq.quantize(dst_type, gq.dequantize(src_type, raw, ne0))


def write_shadow(model_path, type_name: str, out=None, layers: str = "all", pinned: int = 0, threads: int = 1,
                 progress=None, force: bool = False) -> dict:
    """Write the shadow sidecar of ``model_path`` (atomically; never over the model or a file that is not a vis
    profile).  Returns ``{path, type, layers, tensors, model_bytes, shadow_bytes, seconds}``."""
    import gguf
    t0 = time.monotonic()
    model = Path(model_path)
    dst = gq.check_target(type_name)
    out = Path(out) if out else default_out(model, dst.name)
    if not 1 <= threads <= 256:
        raise ShadowError(f"-t {threads}: expected 1..256 threads")
    prof.check_output_path(out, model, KIND, force)         # before any work
    readers = prof.model_readers(model)                     # every shard of a split model
    r = readers[0]
    all_exps = expert_tensors(readers)
    moe_layers = sorted({il for il, _ in all_exps})
    if not moe_layers:
        raise ShadowError(f"{model}: no routed-expert tensors (blk.N.ffn_*_exps.weight): not a MoE model")
    n_layer = prof.optional_key(r, f"{prof.optional_key(r, 'general.architecture')}.block_count")
    chosen = set(parse_layers(layers, moe_layers, int(n_layer or moe_layers[-1] + 1), pinned))
    todo = [(il, t) for il, t in all_exps if il in chosen]
    bs = gq.block_size(dst)
    for _, t in todo:
        ne0 = int(t.shape[0])
        if ne0 % bs:
            raise ShadowError(f"{t.name}: rows of {ne0} values do not fit {dst.name} blocks of {bs} "
                              f"({ne0} % {bs} = {ne0 % bs}); choose a type whose blocks divide {ne0} "
                              "(Q4_0, Q5_0, Q8_0, IQ4_NL: blocks of 32)")
        src = gguf.GGMLQuantizationType(int(t.tensor_type))
        if src.name not in gq.FLOAT_TYPES and not gq.traits(src).to_float:
            raise ShadowError(f"{t.name}: ggml cannot dequantise its type {src.name}")
    fp = prof.model_fingerprint(model)                      # the routers' hash: after the cheap checks
    w = prof.start_profile(out, fp, KIND, VERSION, fp["n_expert_used"], 0, model.name, model, force)
    w.add_string(K_TYPE, dst.name)
    w.add_array(K_LAYERS, sorted(chosen))
    model_bytes = sum(int(t.n_bytes) for _, t in todo)
    w.add_uint64(K_MODEL_BYTES, model_bytes)
    plan = []
    for _, t in todo:
        ne0, ne1, n_exp = (int(x) for x in t.shape[:3])
        w.add_string(K_SRC + t.name, gguf.GGMLQuantizationType(int(t.tensor_type)).name)
        rb = gq.row_bytes(dst, ne0)
        w.add_tensor_info(t.name, (n_exp, ne1, rb), np.dtype(np.uint8), n_exp * ne1 * rb, raw_dtype=dst)
        plan.append((t, ne0, ne1, n_exp, rb))
    shadow_bytes = sum(n * ne1 * rb for _, _, ne1, n, rb in plan)
    n_expert = int(fp["n_expert"])
    if any(n != n_expert for _, _, _, n, _ in plan):
        raise ShadowError(f"{model}: an expert tensor does not have the model's {n_expert} experts")
    sums = np.zeros((len(plan), n_expert), np.uint64)
    w.add_tensor_info(T_SUMS, (len(plan), n_expert), np.dtype(np.int64), sums.nbytes,
                      raw_dtype=gguf.GGMLQuantizationType.I64)
    tmp = out.with_name(out.name + ".part")
    done = 0
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for j, (t, ne0, ne1, n_exp, rb) in enumerate(plan):
                src = gguf.GGMLQuantizationType(int(t.tensor_type))
                data = t.data.reshape(n_exp, -1)                # the expert's bytes (or values), row-major
                shadow = np.empty((n_exp, ne1, rb), np.uint8)
                for e, q in enumerate(pool.map(lambda e: _shadow_expert(src, dst, data[e], ne0), range(n_exp))):
                    shadow[e] = q
                    sums[j, e] = prof.bytes_sum(q)
                w.write_tensor_data(shadow)
                done += int(t.n_bytes)
                if progress:
                    progress(done, model_bytes)
        w.write_tensor_data(sums.view(np.int64))
        w.close()
        os.replace(tmp, out)
    finally:
        w.close()
        if tmp.exists():
            tmp.unlink()
    return {"path": out, "type": dst.name, "layers": sorted(chosen), "tensors": len(plan), "model_bytes": model_bytes,
            "shadow_bytes": shadow_bytes, "seconds": time.monotonic() - t0}


def read_shadow(path, model_path=None) -> ShadowFile:
    """Open and check a shadow sidecar (kind, version, keys, every tensor's type and shape); with ``model_path``,
    also that it was made from that model and its tensors have the model's shapes."""
    import gguf
    p = Path(path)
    fix = prof.fix_for(KIND, p)
    r, meta = prof.open_profile(p, KIND, VERSION, ((K_TYPE, str), (K_MODEL_BYTES, int)))
    typ = meta[K_TYPE]
    if typ not in gq.QUANT_TYPES:
        raise ShadowError(f"{p}: {K_TYPE} = {typ!r} is not a quantized type; {fix}")
    layers = prof.optional_key(r, K_LAYERS)
    if not isinstance(layers, list) or not layers:
        raise ShadowError(f"{p}: key {K_LAYERS} is missing or empty; {fix}")
    tensors = {}
    for t in r.tensors:
        if t.name == T_SUMS:
            continue
        m = _EXPS.fullmatch(t.name)
        tt = gguf.GGMLQuantizationType(int(t.tensor_type))
        if not m or tt.name != typ:
            raise ShadowError(f"{p}: tensor {t.name} ({tt.name}) is not a {typ} expert tensor; {fix}")
        src = prof.optional_key(r, K_SRC + t.name)
        if not isinstance(src, str):
            raise ShadowError(f"{p}: key {K_SRC + t.name} is missing; {fix}")
        tensors[t.name] = (src, tuple(int(x) for x in t.shape), t)
    sf = ShadowFile(p, meta[prof.K_ARCH], meta[prof.K_NLAYER], meta[prof.K_NEXPERT], int(meta[prof.K_HASH], 16), typ,
                    [int(x) for x in layers], meta[K_MODEL_BYTES], sum(int(t.n_bytes) for *_, t in tensors.values()),
                    tensors)
    if model_path is not None:
        prof.check_model(sf, model_path, KIND)
        for il, t in expert_tensors(prof.model_readers(Path(model_path))):
            if il in sf.layers:
                got = sf.tensors.get(t.name)
                if got is None or got[1] != tuple(int(x) for x in t.shape):
                    raise ShadowError(f"{p}: tensor {t.name} is missing or has another shape than the model's; {fix}")
    return sf


def dequantized(sf: ShadowFile, name: str) -> np.ndarray:
    """A shadow tensor as float32 [n_expert, ne1, ne0] (through ggml's to_float)."""
    _, ne, t = sf.tensors[name]
    return gq.dequantize(gq.type_of(sf.type), np.asarray(t.data), ne[0]).reshape(ne[2], ne[1], ne[0])


def write_hybrid(model_path, shadow_path, out, layers=None) -> Path:
    """The model as it would be if the expert tensors of ``layers`` (default: every layer of the shadow) were the
    shadow's: every key and every other tensor copied, those tensors replaced by the shadow's bytes and type.  Upstream
    llama.cpp runs it as any model: the reference of ``--moe-precision all`` (a shadow pass computes exactly what
    upstream's mul_mat_id computes on the shadow tensor) and the worst case of the precision policy's quality.
    Written to OUT.part and renamed; never over the model or the shadow."""
    import gguf
    model_path, out = Path(model_path), Path(out)
    sf = read_shadow(shadow_path, model_path)
    for p in (model_path, Path(shadow_path)):
        if out.exists() and out.resolve() == p.resolve():
            raise ShadowError(f"refusing to write the hybrid model over its input {p}")
    keep = set(sf.layers if layers is None else layers)
    if not keep <= set(sf.layers):
        raise ShadowError(f"{shadow_path}: no shadow of layers {sorted(keep - set(sf.layers))}")
    readers = prof.model_readers(model_path)
    r = readers[0]
    arch = r.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, f in r.fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":   # one file, even from shards
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    for t in (t for rd in readers for t in rd.tensors):
        m = _EXPS.fullmatch(t.name)
        src = sf.tensors[t.name][2] if m and int(m.group(1)) in keep else t
        w.add_tensor(t.name, np.asarray(src.data), raw_dtype=gguf.GGMLQuantizationType(int(src.tensor_type)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------
# pyvis shadow MODEL --type T
# ---------------------------------------------------------------------------
def _threads(s: str) -> int:
    v = int(s)
    if not 1 <= v <= 256:
        raise ValueError(s)
    return v


def _pinned(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 1 << 16:
        raise ValueError(s)
    return v


def _cmd_shadow(args) -> int:
    import sys
    from ..progress import Progress
    model = Path(args.model)
    try:
        if not model.is_file():
            raise ShadowError(f"model not found: {model}")
        res = write_shadow(model, args.type, args.out, args.layers, args.pinned, args.threads,
                           progress=Progress("shadow", 1), force=args.force)
    except (prof.ProfileError, gq.QuantError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    mib = 1 << 20
    print(f"shadow: {res['path']}: {res['type']}, {len(res['layers'])} layers ({res['layers'][0]}..{res['layers'][-1]}), "
          f"{res['tensors']} tensors, {res['seconds']:.1f} s")
    print(f"bytes: model experts {res['model_bytes'] / mib:.2f} MiB, shadow {res['shadow_bytes'] / mib:.2f} MiB, "
          f"ratio {res['shadow_bytes'] / max(res['model_bytes'], 1):.3f}")
    return 0


def register(sub) -> None:
    s = sub.add_parser("shadow", help="write a low-bit copy of a model's routed experts (GGUF sidecar for --moe-shadow)",
                       description="Quantise every routed expert of the chosen layers to TYPE through our ggml build "
                       "and write them to a GGUF sidecar tied to MODEL by its fingerprint (docs/shadow.md). "
                       "--moe-shadow loads and validates it; --moe-precision says which misses run from it.")
    s.add_argument("model", help="GGUF model")
    s.add_argument("--type", required=True, metavar="T", help="shadow type, e.g. Q2_K, Q3_K, Q4_0 (no imatrix types)")
    s.add_argument("--layers", default="all", metavar="all|managed|N..M",
                   help="layers: all MoE layers (default), managed (those after --pinned), or N..M inclusive")
    s.add_argument("--pinned", type=_pinned, default=0, metavar="N",
                   help="with --layers managed: MoE layers kept resident, as --moe-pinned-layers (default: 0)")
    s.add_argument("--out", default=None, help="sidecar path (default: MODEL's name with .shadow-TYPE.gguf, beside it)")
    s.add_argument("--force", action="store_true", help="replace an existing vis sidecar of another kind at --out")
    s.add_argument("-t", "--threads", type=_threads, default=os.cpu_count() or 1, metavar="N",
                   help="quantisation threads, 1..256 (default: the CPU count)")
    s.set_defaults(fn=_cmd_shadow)
