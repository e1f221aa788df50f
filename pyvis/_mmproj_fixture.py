"""Tiny random-weight Qwen3-VL ("qwen3vl_merger") mmproj GGUF fixture + test image writer.

Everything below was checked against the pinned upstream tree in
``vendor/llama.cpp`` (llama.cpp 0c1e570, via llama-cpp-python 0.3.36).  Line
numbers refer to that tree.

What the unmodified libmtmd needs
=================================

Projector selection
-------------------
* ``clip.has_vision_encoder`` (BOOL) -- ``clip.cpp:1221`` reads it optionally
  (default false), but ``clip_init`` (``clip.cpp:4011``) only builds a vision
  context when it is true and ``load_hparams`` asserts it (``clip.cpp:1257``).
* ``clip.projector_type`` (STRING) = ``"qwen3vl_merger"`` -- ``clip.cpp:1270``,
  name table ``clip-impl.h:521`` (``PROJECTOR_TYPE_QWEN3VL``).

Generic hparams, ``load_hparams`` ``clip.cpp:1305-1325``
--------------------------------------------------------
``get_u32``/``get_f32``/``get_bool`` go through ``gguf_get_val_u32`` etc.,
which abort on a type mismatch, so the GGUF value types matter:

* ``clip.vision.embedding_length``          UINT32  required  (n_embd)
* ``clip.vision.attention.head_count``      UINT32  required
* ``clip.vision.feed_forward_length``       UINT32  required
* ``clip.vision.block_count``               UINT32  required
* ``clip.vision.projection_dim``            UINT32  required (only logged; the
  converter writes the text hidden size, ``conversion/base.py:2693``)
* ``clip.vision.attention.layer_norm_epsilon`` FLOAT32 required
* ``clip.vision.image_size``                UINT32  required (``clip.cpp:1319``;
  only sanity-checked, must be 0..8192, ``clip.cpp:2047``)
* ``clip.vision.patch_size``                UINT32  required (``clip.cpp:1320``)
* ``clip.vision.image_mean`` / ``clip.vision.image_std``  ARRAY[FLOAT32] of
  >= 3 -- optional in ``get_arr_f32`` but ``clip.cpp:1408`` throws if < 3.
* ``clip.use_gelu`` BOOL (optional, ``clip.cpp:1378``): true -> FFN_GELU for
  the ViT MLP (the converter sets it, ``conversion/qwen3vl.py:48``); absent ->
  gelu_quick.
* optional and not written: ``clip.vision.attention.head_dim`` (default
  n_embd/n_head), ``clip.vision.attention.head_count_kv``,
  ``clip.vision.feature_layer``.

Qwen3-VL specific, ``clip.cpp:1668-1684``
----------------------------------------
* ``clip.vision.spatial_merge_size`` UINT32, optional, default 2.  It MUST be 2:
  the graph hard-codes a 2x2 merge (``models/qwen3vl.cpp:20-30, 40-50, 170``:
  ``n_embd * 2``, ``n_patches_x / 2``, ``n_embd * 4``) and the m-rope position
  fill hard-codes ``dy,dx < 2`` (``clip.cpp:4846``).
* ``clip.vision.n_wa_pattern`` is read optionally (only 2.5-VL requires it).
* ``set_limit_image_tokens(8, 4096)`` (``clip.cpp:1678``) OVERRIDES any
  ``clip.vision.image_{min,max}_pixels``; those keys are not read for this
  projector.  min/max pixels = {8, 4096} * (patch*2)^2 unless the user passes
  ``--image-min-tokens/--image-max-tokens``.
* warmup (graph reservation only, no compute) uses a square image of
  46 * patch * 2 pixels (``clip.cpp:1679``, ``clip-model.h:210``), i.e. 92x92
  patches whatever patch_size is.
* ``clip.vision.is_deepstack_layers`` (ARRAY[BOOL]) is written by the
  converter (``conversion/qwen3vl.py:60``) but the C++ loader never reads it:
  deepstack layers are detected from the presence of ``v.deepstack.{il}.fc1.weight``
  (``clip.cpp:2323-2331``, ``clip-model.h:354-356``).  We write it anyway for
  fidelity with real files.
* ``general.architecture`` = "clip" (GGUFWriter always writes it),
  ``general.type`` = "mmproj", ``general.file_type`` (0 = all F32, 1 = F16
  patch conv) and ``general.name`` are informational only.

Tensors (``load_tensors`` ``clip.cpp:2253-2331, 2505-2511``)
----------------------------------------------------------
Shapes below are GGML ``ne`` order (innermost first); numpy arrays are written
with the reversed shape.  n = n_embd_v, f = n_ff, m = 4*n (merger hidden),
t = n_embd_text, p = patch_size, P = number of position embeddings (a perfect
square, ``clip.cpp:317``).

  v.patch_embd.weight        [p, p, 3, n]   conv kernel [KW,KH,IC,OC], temporal slice 0
  v.patch_embd.weight.1      [p, p, 3, n]   temporal slice 1 (both used for a still
                                            image: ``models/qwen2vl.cpp:13-16``)
  v.patch_embd.bias          [n]            REQUIRED by GGML_ASSERT ``models/qwen3vl.cpp:4``
  v.position_embd.weight     [n, P]         REQUIRED by GGML_ASSERT ``models/qwen3vl.cpp:5``,
                                            bilinearly resized to the patch grid
  v.blk.{i}.ln1.weight/.bias [n]
  v.blk.{i}.attn_qkv.weight  [n, 3n]        fused Q|K|V (``models/qwen3vl.cpp:81-98``)
  v.blk.{i}.attn_qkv.bias    [3n]           (used unconditionally, ggml_add)
  v.blk.{i}.attn_out.weight  [n, n]         required (``clip.cpp:2283``)
  v.blk.{i}.attn_out.bias    [n]
  v.blk.{i}.ln2.weight/.bias [n]
  v.blk.{i}.ffn_up.weight    [n, f]         required; no ffn_gate -> plain MLP
  v.blk.{i}.ffn_up.bias      [f]
  v.blk.{i}.ffn_down.weight  [f, n]         required
  v.blk.{i}.ffn_down.bias    [n]
  v.deepstack.{i}.norm.weight/.bias [m]     per deepstack layer i (absolute ViT layer
  v.deepstack.{i}.fc1.weight [m, m]         index); LayerNorm over the 2x2-merged
  v.deepstack.{i}.fc1.bias   [m]            features, fc1 -> GELU -> fc2
  v.deepstack.{i}.fc2.weight [m, t]         (``models/qwen3vl.cpp:143-158``)
  v.deepstack.{i}.fc2.bias   [t]
  v.post_ln.weight/.bias     [n]            optional; HF merger.norm (LayerNorm over n,
                                            applied before the 2x2 merge)
  mm.0.weight                [m, m]         required (merger linear_fc1)
  mm.0.bias                  [m]            required
  mm.2.weight                [m, t]         required (merger linear_fc2)
  mm.2.bias                  [t]            required; ``clip_n_mmproj_embd`` =
                                            mm.2.bias ne[0] * (1 + n_deepstack)
                                            (``clip.cpp:5998-6000``)

Not present (would trip asserts): ``v.class_embd`` (``models/qwen3vl.cpp:6``).
``v.pre_ln.*`` is optional and not written (real Qwen3-VL has none).
All tensors are F32 by default; the converter writes the patch conv as F16 only
for an F16 file (``conversion/base.py:2743``), F32 im2col is supported, so F16
is not required (``patch_dtype="f16"`` is offered as an option).

Width checks on the text side
-----------------------------
mtmd compares ``clip_n_mmproj_embd`` with ``llama_model_n_embd_inp(text)``
(``mtmd.cpp:537, 603-608``); for qwen3vlmoe that is
``n_embd * (1 + qwen3vlmoe.n_deepstack_layers)`` (``src/llama-hparams.cpp:118-130``,
key read optionally in ``src/models/qwen3vlmoe.cpp:4``).  The text graph adds
slice il+1 of the input embedding to the output of text layer il for
il < n_deepstack_layers (``src/models/qwen3vlmoe.cpp:164-168``).  The text
model needs block_count > n_deepstack_layers (strictly): on the last layer the
hidden state is first reduced to the output rows (``qwen3vlmoe.cpp:130``), so a
deepstack add there fails ``GGML_ASSERT(ggml_can_repeat(b, a))`` during the
context warmup (observed with 3 layers / 3 deepstack; real models: 48 / 3).

Verified end to end (llama-mtmd-cli of this tree, CPU, with a throwaway tiny
qwen3vlmoe text model): 64x64 -> 9 tokens, [256, 9] embeddings for
n_embd_text=64, n_deepstack=3; also 32x48 / ds=0, 48x32 / ds=1 on layer 2,
100x30 / F16 patch conv without post_ln, patch 14 with n_embd_v=64, 200x150;
token grids matched ``expected_image_tokens`` and embeddings were finite.

Image preprocessing (``mtmd-image.cpp:772-792``, ``122-157``)
------------------------------------------------------------
``mtmd_image_preprocessor_dyn_size``: align = patch*2; round each side to a
multiple of align (at least align); if the area exceeds max_pixels scale down,
else if below min_pixels (8 tokens * (2p)^2) scale up with ceil.  With p = 16:
64x64 -> 96x96 (3x3 = 9 tokens), 32x48 -> 96x128 (3x4 = 12 tokens).
``expected_image_tokens`` reproduces this.
"""
from __future__ import annotations

import math
import struct
import zlib
from typing import Any, Sequence

import numpy as np

__all__ = ["write_qwen3vl_mmproj", "write_test_image", "expected_image_tokens", "PROJECTOR_TYPE"]

PROJECTOR_TYPE = "qwen3vl_merger"

# token limits applied by clip.cpp for qwen3vl (set_limit_image_tokens(8, 4096))
_MIN_TOKENS = 8
_MAX_TOKENS = 4096

_DEFAULT_SIZES: dict[str, Any] = {
    "n_embd_v": 32,          # vision hidden size (n)
    "n_head": 2,             # d_head = 16 -> m-rope sections 4,4,4,4
    "n_ff": 64,              # ViT MLP hidden
    "n_layer": None,         # default: max(2, last deepstack layer + 1)
    "patch_size": 16,
    "pos_side": 4,           # position embeddings = pos_side**2; image_size = pos_side*patch
    "spatial_merge_size": 2, # must be 2 (hard-coded in the graph)
    "deepstack_layers": None,  # default: layers 0..n_deepstack-1
    "eps": 1e-6,
    "patch_dtype": "f32",    # "f32" or "f16" for v.patch_embd.weight(.1)
    "post_ln": True,         # write v.post_ln.{weight,bias}
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "name": "tiny-qwen3vl-mmproj",
}


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def write_qwen3vl_mmproj(path: str, *, n_embd_text: int, n_deepstack: int, seed: int = 0, **sizes: Any) -> dict:
    """Write a tiny random-weight qwen3vl_merger mmproj GGUF to ``path``.

    The produced embeddings have width ``n_embd_text * (1 + n_deepstack)``,
    matching ``llama_model_n_embd_inp`` of a qwen3vlmoe text model with
    ``embedding_length = n_embd_text`` and ``qwen3vlmoe.n_deepstack_layers = n_deepstack``.

    Optional ``sizes`` (see ``_DEFAULT_SIZES``): n_embd_v, n_head, n_ff, n_layer,
    patch_size, pos_side, spatial_merge_size, deepstack_layers, eps,
    patch_dtype, post_ln, image_mean, image_std, name.

    Returns a dict describing the written model.
    """
    import gguf  # imported lazily so write_test_image works without gguf

    unknown = set(sizes) - set(_DEFAULT_SIZES)
    if unknown:
        raise TypeError(f"unknown size argument(s): {sorted(unknown)}")
    cfg = dict(_DEFAULT_SIZES)
    cfg.update(sizes)

    n_embd_text = int(n_embd_text)
    n_deepstack = int(n_deepstack)
    n = int(cfg["n_embd_v"])
    n_head = int(cfg["n_head"])
    n_ff = int(cfg["n_ff"])
    p = int(cfg["patch_size"])
    pos_side = int(cfg["pos_side"])
    merge = int(cfg["spatial_merge_size"])
    eps = float(cfg["eps"])

    if n_embd_text <= 0:
        raise ValueError("n_embd_text must be > 0")
    if n_deepstack < 0:
        raise ValueError("n_deepstack must be >= 0")
    if merge != 2:
        raise ValueError("spatial_merge_size must be 2: clip_graph_qwen3vl hard-codes a 2x2 merge")
    if n <= 0 or n_head <= 0 or n % n_head != 0:
        raise ValueError("n_embd_v must be a positive multiple of n_head")
    d_head = n // n_head
    if d_head % 4 != 0:
        # mrope_sections = {d_head/4 x4}, rope n_dims = d_head/2 (models/qwen3vl.cpp:14, 101-106)
        raise ValueError("n_embd_v / n_head must be a multiple of 4 (m-rope sections)")
    if p <= 0 or pos_side <= 0 or n_ff <= 0:
        raise ValueError("patch_size, pos_side and n_ff must be > 0")

    ds_layers = cfg["deepstack_layers"]
    if ds_layers is None:
        ds_layers = list(range(n_deepstack))
    ds_layers = sorted(int(i) for i in ds_layers)
    if len(ds_layers) != n_deepstack or len(set(ds_layers)) != n_deepstack:
        raise ValueError(f"deepstack_layers {ds_layers} must list {n_deepstack} distinct layers")
    n_layer = cfg["n_layer"]
    if n_layer is None:
        n_layer = max(2, (ds_layers[-1] + 1) if ds_layers else 0)
    n_layer = int(n_layer)
    if any(i < 0 or i >= n_layer for i in ds_layers):
        raise ValueError(f"deepstack_layers {ds_layers} out of range for n_layer={n_layer}")

    image_size = pos_side * p
    if image_size > 8192:
        raise ValueError("image_size (pos_side * patch_size) must be <= 8192")
    m = n * merge * merge  # merger hidden = n_embd * 4
    patch_dtype = str(cfg["patch_dtype"]).lower()
    if patch_dtype not in ("f32", "f16"):
        raise ValueError("patch_dtype must be 'f32' or 'f16'")

    rng = np.random.default_rng(seed)

    def lin(n_out: int, n_in: int) -> np.ndarray:
        # numpy shape (out, in) -> ggml ne [in, out]
        return _f32(rng.standard_normal((n_out, n_in)) / math.sqrt(n_in))

    def bias(k: int) -> np.ndarray:
        return _f32(rng.standard_normal(k) * 0.02)

    def norm_w(k: int) -> np.ndarray:
        return _f32(1.0 + rng.standard_normal(k) * 0.1)

    tensors: list[tuple[str, np.ndarray]] = []

    def add(name: str, arr: np.ndarray) -> None:
        tensors.append((name, arr))

    # patch embedding: numpy (n, 3, p, p) -> ne [p, p, 3, n]
    fan_in = 3 * p * p
    for suffix in ("", ".1"):
        w = rng.standard_normal((n, 3, p, p)) / math.sqrt(2 * fan_in)
        add("v.patch_embd.weight" + suffix,
            np.ascontiguousarray(w, dtype=np.float16 if patch_dtype == "f16" else np.float32))
    add("v.patch_embd.bias", bias(n))
    add("v.position_embd.weight", _f32(rng.standard_normal((pos_side * pos_side, n)) * 0.1))

    for il in range(n_layer):
        pre = f"v.blk.{il}"
        add(f"{pre}.ln1.weight", norm_w(n))
        add(f"{pre}.ln1.bias", bias(n))
        add(f"{pre}.attn_qkv.weight", lin(3 * n, n))
        add(f"{pre}.attn_qkv.bias", bias(3 * n))
        add(f"{pre}.attn_out.weight", lin(n, n))
        add(f"{pre}.attn_out.bias", bias(n))
        add(f"{pre}.ln2.weight", norm_w(n))
        add(f"{pre}.ln2.bias", bias(n))
        add(f"{pre}.ffn_up.weight", lin(n_ff, n))
        add(f"{pre}.ffn_up.bias", bias(n_ff))
        add(f"{pre}.ffn_down.weight", lin(n, n_ff))
        add(f"{pre}.ffn_down.bias", bias(n))

    for il in ds_layers:
        pre = f"v.deepstack.{il}"
        add(f"{pre}.norm.weight", norm_w(m))
        add(f"{pre}.norm.bias", bias(m))
        add(f"{pre}.fc1.weight", lin(m, m))
        add(f"{pre}.fc1.bias", bias(m))
        add(f"{pre}.fc2.weight", lin(n_embd_text, m))
        add(f"{pre}.fc2.bias", bias(n_embd_text))

    if cfg["post_ln"]:
        add("v.post_ln.weight", norm_w(n))
        add("v.post_ln.bias", bias(n))

    add("mm.0.weight", lin(m, m))
    add("mm.0.bias", bias(m))
    add("mm.2.weight", lin(n_embd_text, m))
    add("mm.2.bias", bias(n_embd_text))

    image_mean = [float(x) for x in cfg["image_mean"]]
    image_std = [float(x) for x in cfg["image_std"]]
    if len(image_mean) < 3 or len(image_std) < 3:
        raise ValueError("image_mean/image_std need 3 values")

    writer = gguf.GGUFWriter(path, "clip")  # writes general.architecture = "clip"
    writer.add_string("general.type", "mmproj")
    writer.add_string("general.name", str(cfg["name"]))
    writer.add_uint32("general.file_type", 1 if patch_dtype == "f16" else 0)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", PROJECTOR_TYPE)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", p)
    writer.add_uint32("clip.vision.embedding_length", n)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.block_count", n_layer)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    writer.add_array("clip.vision.image_mean", image_mean)  # python floats -> FLOAT32 array
    writer.add_array("clip.vision.image_std", image_std)
    writer.add_uint32("clip.vision.spatial_merge_size", merge)
    # informational only (the loader detects deepstack layers from tensors)
    writer.add_array("clip.vision.is_deepstack_layers", [bool(i in ds_layers) for i in range(n_layer)])

    for name, arr in tensors:
        writer.add_tensor(name, arr)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    return {
        "path": str(path),
        "projector_type": PROJECTOR_TYPE,
        "n_embd_v": n,
        "n_head": n_head,
        "d_head": d_head,
        "n_ff": n_ff,
        "n_layer": n_layer,
        "patch_size": p,
        "image_size": image_size,
        "n_pos_embd": pos_side * pos_side,
        "spatial_merge_size": merge,
        "merger_hidden": m,
        "deepstack_layers": list(ds_layers),
        "n_deepstack": n_deepstack,
        "n_embd_text": n_embd_text,
        "n_mmproj_embd": n_embd_text * (1 + n_deepstack),
        "min_image_tokens": _MIN_TOKENS,
        "max_image_tokens": _MAX_TOKENS,
        "eps": eps,
        "patch_dtype": patch_dtype,
        "n_tensors": len(tensors),
        "tensors": {name: tuple(int(d) for d in reversed(arr.shape)) for name, arr in tensors},  # ggml ne order
        "seed": seed,
    }


def expected_image_tokens(width: int, height: int, *, patch_size: int = 16, n_merge: int = 2,
                          min_tokens: int = _MIN_TOKENS, max_tokens: int = _MAX_TOKENS) -> tuple[int, int]:
    """Merged-token grid (nx, ny) mtmd produces for a width x height image.

    Mirrors img_tool::calc_size_preserved_ratio (mtmd-image.cpp:122-157) with
    float32 arithmetic; the image is resized to (nx*align, ny*align) with
    align = patch_size * n_merge.  Total tokens = nx * ny.
    """
    f32 = np.float32
    align = patch_size * n_merge
    area = align * align
    min_px, max_px = min_tokens * area, max_tokens * area

    def round_f(x: Any) -> int:
        # std::round: half away from zero (x is positive here)
        q = f32(x) / f32(align)
        return int(math.floor(float(q) + 0.5)) * align

    def ceil_f(x: Any) -> int:
        return int(math.ceil(float(f32(x) / f32(align)))) * align

    def floor_f(x: Any) -> int:
        return int(math.floor(float(f32(x) / f32(align)))) * align

    w_bar = max(align, round_f(width))
    h_bar = max(align, round_f(height))
    if max_px > 0 and h_bar * w_bar > max_px:
        beta = np.sqrt(f32(f32(height) * width / f32(max_px)), dtype=f32)
        h_bar = max(align, floor_f(f32(height) / beta))
        w_bar = max(align, floor_f(f32(width) / beta))
    elif min_px > 0 and h_bar * w_bar < min_px:
        beta = np.sqrt(f32(f32(min_px) / f32(f32(height) * width)), dtype=f32)
        h_bar = ceil_f(f32(height) * beta)
        w_bar = ceil_f(f32(width) * beta)
    return w_bar // align, h_bar // align


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def write_test_image(path: str, width: int, height: int, seed: int = 0) -> str:
    """Write a deterministic 8-bit RGB PNG (numpy + zlib only) that stb_image decodes."""
    width, height = int(width), int(height)
    if width <= 0 or height <= 0:
        raise ValueError("width and height must be > 0")
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([
        255.0 * xx / max(1, width - 1),
        255.0 * yy / max(1, height - 1),
        127.5 + 127.5 * np.sin((xx + yy) * 0.3),
    ], axis=-1)
    noise = rng.integers(-32, 33, size=(height, width, 3))
    img = np.clip(base + noise, 0, 255).astype(np.uint8)

    # each scanline: filter type 0 (None) + RGB bytes
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), img.reshape(height, width * 3)], axis=1)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, color type 2 (RGB)
    data = (b"\x89PNG\r\n\x1a\n"
            + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
            + _png_chunk(b"IEND", b""))
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n-embd-text", type=int, required=True)
    ap.add_argument("--n-deepstack", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", nargs=3, metavar=("PATH", "W", "H"))
    a = ap.parse_args(argv)
    info = write_qwen3vl_mmproj(a.out, n_embd_text=a.n_embd_text, n_deepstack=a.n_deepstack, seed=a.seed)
    info.pop("tensors")
    print(json.dumps(info, indent=1))
    if a.image:
        write_test_image(a.image[0], int(a.image[1]), int(a.image[2]), a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
