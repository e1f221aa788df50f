"""`pyvis` command line.

    pyvis info      [-m MODEL]             build, libraries and a model's MoE shape
    pyvis fixtures  [--out DIR] [--only NAME ...] [--large [--arch qwen3moe|qwen3vlmoe]] ...
    pyvis generate  [-m MODEL] [-p PROMPT] [-n N] ...
    pyvis chat      -m MODEL --mmproj F --image IMG [--image IMG2] -p PROMPT --keep-ratio 0.5 ...

and the commands each part registers: plan (pyvis.runtime.plan), chat, prune-report, prune-sim, prune-eval
(pyvis.vlm), moefy, report, quality, substitute-sweep, report-prefetch (pyvis.testbed), calibrate WHAT, report-buddies (pyvis.calibrate), shadow (pyvis.runtime.shadow), trace import, cachesim (pyvis.runtime.trace_cli).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .progress import Progress

DEFAULT_PROMPT = "The mixture of experts model routes each token to"


def _cmd_info(args: argparse.Namespace) -> int:
    from . import _paths
    from .runtime import native as _native
    print(f"pyvis {_native.version()} on llama.cpp {_native.upstream_commit()}")
    print(f"libraries: {_paths.lib_dir()}")
    print(f"system_info: {_native.llama_cpp.llama_print_system_info().decode()}")
    if args.model:
        llm = _load(args.model, n_ctx=64, verbose=False)
        info = _native.moe_info(llm)
        print(f"model: {args.model}")
        for k, v in info.__dict__.items():
            print(f"  {k:16s} {v}")
    return 0


def _cmd_fixtures(args: argparse.Namespace) -> int:
    from . import fixtures as fx
    out = Path(args.out) if args.out else fx.default_dir()
    large_only = {"--arch": ("arch", "qwen3moe"), "--layers": ("layers", 48), "--expert-type": ("expert_type", "Q4_0"),
                  "--routing": ("routing", "random")}
    given = [flag for flag, (attr, _) in large_only.items() if getattr(args, attr) is not None]
    for attr, default in large_only.values():
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    if not args.large and given:
        raise SystemExit(f"error: {', '.join(given)} only applies to --large; add --large or drop it")
    if args.large:
        from .fixtures import large
        if args.only:
            raise SystemExit("error: --only picks small fixtures; --large writes one model (pick it with --arch)")
        if args.layers < 1:
            raise SystemExit(f"error: --layers {args.layers}: need at least 1 layer")
        spec = fx.large_preset(n_layer=args.layers, expert_type=args.expert_type, seed=args.seed,
                               routing=args.routing, arch=args.arch)
        if args.arch == "qwen3vlmoe" and args.layers <= spec.extra["n_deepstack"]:
            raise SystemExit(f"error: --layers {args.layers}: a qwen3vlmoe model needs more layers than its "
                             f"{spec.extra['n_deepstack']} deepstack layers")
        for p in large.write_large(out, spec, log=lambda m: print(m, file=sys.stderr),
                                   progress=lambda total: Progress("gguf", total)):
            print(p)
        return 0
    names = args.only or list(fx.FIXTURES)
    for n in names:
        t0 = time.monotonic()
        p = fx.ensure(n, out, seed=args.seed)
        print(f"{n:12s} {p}  ({p.stat().st_size / (1 << 20):.1f} MiB, {time.monotonic() - t0:.1f} s)")
    return 0


def _load(model: str, n_ctx: int, verbose: bool, switches: dict | None = None, **kw):
    from .runtime.native import VisError, llama_cpp
    if not Path(model).is_file():
        raise SystemExit(f"error: model file not found: {model}")
    try:
        if switches:      # --moe-mem / --moe-mode: the model's load and its context under them
            from . import moe
            return moe.load(model, moe.MoeConfig(**switches), n_ctx=n_ctx, verbose=verbose, **kw)
        return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, verbose=verbose, **kw)
    except VisError as e:
        raise SystemExit(f"error: {e}") from e
    except ValueError as e:
        from .runtime.gguf_model import what_it_is
        why = what_it_is(model)         # a later shard, an mmproj, a sidecar: say so, not "re-download"
        if why:
            raise SystemExit(f"error: failed to load {model}: {why}") from e
        raise SystemExit(f"error: failed to load {model}: {e}\n"
                         "  The file may be truncated or not a GGUF model; re-download or regenerate it.") from e


def _cmd_generate(args: argparse.Namespace) -> int:
    from .runtime import native as _native
    from .runtime import settings
    model = args.model
    if model is None:
        from . import fixtures as fx
        model = str(fx.ensure("qwen3moe"))
        print(f"(no -m given: using the default MoE model {model})", file=sys.stderr)
    llm = _load(model, n_ctx=args.ctx_size, verbose=args.verbose, seed=args.seed, n_threads=args.threads,
                switches=settings.user_switches(args))
    info = _native.moe_info(llm)
    props = _native.props() or {}
    mode = "exact" if props.get("exact", True) else (f"LOSSY ({', '.join(props.get('lossy', []))}): outputs differ "
                                                     "from the model's")
    print(f"[vis-moe {_native.version()}] {Path(model).name}: {info.n_moe_layers} MoE layers x "
          f"{info.n_expert} experts, top-{info.n_expert_used}; mode {mode}", file=sys.stderr)
    t0 = time.monotonic()
    out = llm.create_completion(args.prompt, max_tokens=args.n_predict, temperature=0.0 if args.greedy else 0.8,
                                top_k=1 if args.greedy else 40, seed=args.seed)
    dt = time.monotonic() - t0
    text = out["choices"][0]["text"]
    print(args.prompt + text)
    n = out["usage"]["completion_tokens"]
    print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="pyvis", description="vis-moe: MoE and MoE-VLM inference on edge devices "
                                "(llama.cpp fork). Run `pyvis COMMAND --help` for a command's options.")
    p.add_argument("--version", action="version", version=f"pyvis {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    s = sub.add_parser("info", help="show the native build and, with -m, a model's MoE shape")
    s.add_argument("-m", "--model", help="GGUF model to inspect")
    s.set_defaults(fn=_cmd_info)

    s = sub.add_parser("fixtures", help="generate the synthetic MoE test models (GGUF)",
                       description="Generate tiny random-weight MoE GGUFs (qwen3moe, deepseek2, gpt-oss, "
                       "mixtral, qwen3vlmoe + mmproj) that stock llama.cpp runs; or, with --large, a model "
                       "with Qwen3-30B-A3B dimensions for benchmarks.")
    s.add_argument("--out", help="output directory (default: models/fixtures or $VIS_FIXTURE_DIR)")
    s.add_argument("--only", nargs="+", metavar="NAME", help="only these fixtures")
    s.add_argument("--seed", type=int, default=42, help="RNG seed (default: 42)")
    s.add_argument("--large", action="store_true", help="write a Qwen3-30B-A3B-sized random model instead")
    s.add_argument("--arch", choices=["qwen3moe", "qwen3vlmoe"],
                   help="architecture of the --large model: qwen3moe (Qwen3-30B-A3B, text only) or qwen3vlmoe "
                   "(Qwen3-VL-30B-A3B's text model with M-RoPE and 3 deepstack layers, written with its full-size "
                   "vision encoder, NAME-mmproj-f16.gguf, and a 256x256 test image; pyvis/fixtures/large.py). "
                   "Default: qwen3moe")
    s.add_argument("--layers", type=int, help="layers of the --large model (default: 48)")
    s.add_argument("--expert-type", choices=["Q4_0", "Q8_0"],
                   help="expert tensor type of the --large model (default: Q4_0)")
    s.add_argument("--routing", choices=["random", "shaped"],
                   help="routing of the --large model: random (plain random weights; sampled text repeats a "
                   "token, so routing is degenerate) or shaped (routers, attention and norms shaped so that "
                   "turnover, LRU hit rate and cross-layer recall look like Qwen3-30B-A3B's; "
                   "pyvis/fixtures/routing.py). Default: random")
    s.set_defaults(fn=_cmd_fixtures)

    s = sub.add_parser("generate", help="generate text with a model through the fork (Python bindings)")
    s.add_argument("-m", "--model", help="GGUF model (default: the qwen3moe fixture)")
    s.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text")
    s.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default: 32)")
    s.add_argument("-c", "--ctx-size", type=int, default=512, help="context size (default: 512)")
    s.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: auto)")
    s.add_argument("-s", "--seed", type=int, default=42, help="sampling seed (default: 42)")
    s.add_argument("--greedy", action="store_true", default=True, help="greedy decoding (default)")
    s.add_argument("--sample", dest="greedy", action="store_false", help="sample instead of greedy decoding")
    s.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    from .runtime import settings
    settings.add_user_switches(s)
    s.set_defaults(fn=_cmd_generate)

    from . import calibrate
    from .calibrate import graph as buddy_graph
    from .runtime import plan_cli, shadow, trace_cli
    from .testbed import moefy, prefetch_report, quality, routing_report, substitute_sweep, train_moe
    from .vlm import chat, evaluate, report
    chat.register(sub)
    for m in (moefy, routing_report, quality, substitute_sweep, prefetch_report, report, evaluate, plan_cli, calibrate,
              buddy_graph, shadow, trace_cli, train_moe):
        m.register(sub)
    report.register_sim(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not getattr(args, "fn", None):
        p.print_help()
        return 0
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - user-facing errors
        from ._paths import BuildNotFound
        from .fixtures import FixtureError
        if isinstance(e, (BuildNotFound, FixtureError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
