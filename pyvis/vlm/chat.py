"""`pyvis chat`: a multimodal prompt with visual-token pruning through libmtmd, then generation; and the
options chat, prune-report and prune-eval share (pruning, context, and the --moe-* flags of the C tools,
named and explained by the C settings table)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from ..runtime import settings
from ..runtime.config import MoeConfig
from ..runtime.native import VisError
from ..runtime.plan import image_max_tokens
from ..runtime.settings import CapacityParams, MoeParams, PrecisionParams
from . import prune


def add_common_args(s, moe_trace: bool = False, many_alphas: bool = False, lossy: bool = False) -> None:
    """Options shared by `pyvis chat`, `pyvis prune-report` and `pyvis prune-eval`; ``lossy``: also the shadow /
    precision / capacity flags (chat and prune-eval, which run the model with them)."""
    s.add_argument("-m", "--model", required=True, help="language model GGUF")
    s.add_argument("--mmproj", required=True, help="multimodal projector GGUF")
    g = s.add_argument_group("pruning")
    if many_alphas:
        g.add_argument("--alpha", type=float, nargs="+", default=[prune.DEFAULT_ALPHA],
                       help=f"affinity: salient core ratio(s) alpha; several values = one affinity run each "
                       f"(default: {prune.DEFAULT_ALPHA})")
    else:
        g.add_argument("--alpha", type=float, default=prune.DEFAULT_ALPHA,
                       help=f"affinity: salient core ratio alpha (default: {prune.DEFAULT_ALPHA})")
    g.add_argument("--lambda", dest="lam", type=float, default=prune.DEFAULT_LAMBDA,
                   help=f"affinity: trade-off weight lambda (default: {prune.DEFAULT_LAMBDA:g})")
    g.add_argument("--prefix-layers", type=int, default=1,
                   help="affinity: MoE layers whose routing defines a token's expert set (default: 1)")
    g.add_argument("--saliency", default="auto", choices=["auto", "attention", "entropy"],
                   help="saliency source: auto = encoder attention when the projector supports it, else entropy")
    g.add_argument("--seed", type=int, default=0, help="seed of the random method and of sampling (default: 0)")
    g.add_argument("--no-chat-template", action="store_true", help="use the prompt as is (default: apply the "
                   "model's chat template, as llama-mtmd-cli does)")
    g = s.add_argument_group("context")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (default: 4096)")
    g.add_argument("-b", "--batch-size", type=int, default=512, help="decode slice size (default: 512)")
    g.add_argument("-ub", "--ubatch-size", type=int, default=None, help="physical batch size (default: -b)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: auto)")
    g.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's and libmtmd's log")
    g = s.add_argument_group("expert cache (docs/residency.md; the C tools' flags)")
    names = ["slots", "cache_mib", "pinned_layers"] + (["stats", "trace"] if moe_trace else [])
    settings.add_arguments(g, MoeParams, names)
    if lossy:
        g = s.add_argument_group("shadow experts, precision and capacity (lossy; docs/precision.md; the C tools' flags)")
        for cls in (PrecisionParams, CapacityParams):
            settings.add_arguments(g, cls, [f.name for f in dataclasses.fields(cls)])


def moe_params(args) -> MoeParams | None:
    """The expert-cache settings of the --moe-* options add_common_args added; None when none is given."""
    moe = settings.from_args(MoeParams, args)
    return None if moe == MoeParams() else moe


def lossy_params(args) -> tuple[PrecisionParams | None, CapacityParams | None]:
    """The --moe-shadow / --moe-precision / --moe-prec-* / --moe-shadow-slots and --moe-capacity / --moe-cap-* options
    (None where all are defaults)."""
    prec, cap = settings.from_args(PrecisionParams, args), settings.from_args(CapacityParams, args)
    return (None if prec == PrecisionParams() else prec), (None if cap == CapacityParams() else cap)


def session_config(args) -> MoeConfig | None:
    """The session's MoeConfig of the --moe-* options add_common_args added (and chat's --moe-mem / --moe-mode, those
    given other than their defaults); None when none is given (the environment's VIS_MOE_* then apply)."""
    moe, (prec, cap) = moe_params(args), lossy_params(args)
    switches = settings.user_switches(args)
    if moe is None and prec is None and cap is None:
        return MoeConfig(**switches) if switches else None
    return MoeConfig.of(moe or MoeParams(), prec, cap).replace(**switches)


def _cmd_chat(args: argparse.Namespace) -> int:
    from .. import vlm
    config = session_config(args)
    if not args.image:
        print("error: give at least one --image (for text-only prompts use `pyvis generate`)", file=sys.stderr)
        return 1
    try:
        t0 = time.monotonic()
        s = vlm.Session(args.model, args.mmproj, config, n_ctx=args.ctx_size, n_batch=args.batch_size,
                        n_ubatch=args.ubatch_size, n_threads=args.threads, verbose=args.verbose,
                        image_max_tokens=args.image_max_tokens)
        t_load = time.monotonic() - t0
    except (vlm.VLMError, VisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with s:
        info = s.info
        print(f"[vis-moe] {Path(args.model).name} + {Path(args.mmproj).name}: {info.n_moe_layers} MoE layers x "
              f"{info.n_expert} experts, top-{info.n_expert_used}, {'M-RoPE' if s.mrope else 'RoPE'}, "
              f"loaded in {t_load:.2f} s", file=sys.stderr)

        def on_image(im):
            print(f"[image {im.index}] {im.nx}x{im.ny} grid: kept {im.n_kept}/{im.n_tokens} tokens "
                  f"(encode {im.timings_ms['encode']:.1f} ms, score {im.timings_ms['score']:.2f} ms, "
                  f"probe {im.timings_ms['probe']:.1f} ms, decode {im.timings_ms['decode_image']:.1f} ms)",
                  file=sys.stderr)
        try:
            p = s.prepare(args.prompt, args.image, keep_ratio=args.keep_ratio, method=args.prune_method,
                          alpha=args.alpha, lam=args.lam, prefix_layers=args.prefix_layers, saliency=args.saliency,
                          seed=args.seed, chat_template=not args.no_chat_template, progress=on_image)
        except (vlm.VLMError, prune.PruneError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(p.summary(), file=sys.stderr)
        s.release_encoder()   # one turn: the images are in the KV cache (VIS_MOE_ENCODER_RELEASE=on; the fork logs it)
        t0 = time.monotonic()
        p.generate(args.n_predict, temp=args.temp, seed=args.seed,
                   on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        dt = time.monotonic() - t0
        print()
        n = len(p.generated)
        print(f"[prefill {p.timings_ms['prefill']:.1f} ms; {n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tok/s]",
              file=sys.stderr)
    return 0   # --moe-stats: the fork prints the table when the context is freed


def register(sub) -> None:
    s = sub.add_parser("chat", help="multimodal prompt with visual-token pruning (libmtmd), then generate",
                       description="Evaluate a prompt with one or more images through libmtmd, keeping only "
                       "part of each image's tokens (at their original M-RoPE positions), then generate. "
                       "Prints how many image tokens were kept and per-stage timings (stderr). "
                       "Methods: none, random, saliency (VisionZip-style), entropy (MACS), affinity (VisMMOE "
                       "Algorithm 1). See docs/pruning.md. Example: pyvis chat -m models/fixtures/qwen3vlmoe.gguf "
                       "--mmproj models/fixtures/qwen3vlmoe-mmproj.gguf --image models/fixtures/test-image.png "
                       "-p 'Describe the image.' --keep-ratio 0.5 --prune-method affinity")
    s.add_argument("--image", action="append", default=[], help="image file (repeatable, in prompt order)")
    s.add_argument("-p", "--prompt", default="Describe the image.", help="prompt; put the media marker "
                   "<__media__> where each image goes (default: images first)")
    s.add_argument("--keep-ratio", type=float, default=1.0, help="fraction of each image's tokens kept, "
                   "in (0, 1] (default: 1.0 = no pruning)")
    s.add_argument("--prune-method", default="affinity", choices=list(prune.METHODS),
                   help="token selection (default: affinity; ignored at --keep-ratio 1)")
    s.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default: 32)")
    s.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    s.add_argument("--image-max-tokens", type=image_max_tokens, default=-1, help="largest image in tokens, as in llama-mtmd-cli "
                   "(default: the projector's limit); under --moe-mem / VIS_MOE_MEM the encoder is planned at it "
                   "(docs/planning.md#the-vision-encoder)")
    add_common_args(s, moe_trace=True, lossy=True)
    settings.add_user_switches(s)
    s.set_defaults(fn=_cmd_chat)
