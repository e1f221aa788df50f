"""``pyvis testbed train``: train a small Qwen3-MoE language model on CPU and write it as a ``qwen3moe`` GGUF.

MoEfication (``pyvis moefy``) cannot give informative gate weights: its experts are disjoint slices of one
dense FFN, so every selected expert must get the same weight.  Here routers and experts are trained together
from scratch, so the top-k gate weights mean something (docs/testbed.md, "A testbed with learned gating").

- text: the rest of the Vim user manual (usr_09 and up, :func:`corpus.vim_training`) and the calibration
  docstrings (:func:`corpus.calibration`); the held-out text (usr_01..usr_08) is never read;
- tokens: SmolLM2's tokenizer, 255-token windows after a BOS (as ``llama-perplexity -c 256`` reads them),
  shuffled by the seed every epoch;
- model: :mod:`.train_model` (torch), AdamW, warm-up then cosine, a load-balancing loss;
- output: ``NAME.gguf`` (+ ``.sha256``, ``.json``) through :mod:`.train_export`, then the torch model on the
  stored weights is checked against llama.cpp's logits on held-out chunks.

Seeded: the same seed, steps, thread count and torch version give the same file.  torch is needed by this
command only (``pip install torch --index-url https://download.pytorch.org/whl/cpu``).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

TORCH_HINT = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
DEFAULT_OUT = "models/trained/qwen3moe-trained.gguf"


class TrainError(RuntimeError):
    pass


def _progress(msg: str) -> None:
    sys.stderr.write(f"[train] {msg}\n")
    sys.stderr.flush()


def _torch():
    try:
        import torch
    except ImportError as e:
        raise TrainError(f"`pyvis testbed train` needs torch, which is not installed ({e}).\n"
                         f"  Fix: {TORCH_HINT}") from e
    return torch


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------
def tokenizer():
    """SmolLM2's tokenizer (vocab only) through our llama.cpp build."""
    from . import _llm  # noqa: F401  (configures the native library)
    from llama_cpp import _internals as I
    from llama_cpp import llama_cpp as L
    from ..fixtures.tokenizer import smollm2_gguf_path
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    return I.LlamaModel(path_model=str(smollm2_gguf_path()), params=mp, verbose=False)


def training_tokens(tok) -> tuple[list[np.ndarray], list[dict]]:
    from .corpus import calibration, vim_training
    texts = [vim_training(), calibration()]
    return ([np.array(tok.tokenize(t.text.encode("utf-8"), False, False), dtype=np.int64) for t in texts],
            [t.describe() | {"files": len(t.files)} for t in texts])


def windows(streams: list[np.ndarray], body: int) -> np.ndarray:
    """Non-overlapping ``body``-token windows of each stream, [n, body]."""
    out = [s[:len(s) // body * body].reshape(-1, body) for s in streams if len(s) >= body]
    return np.concatenate(out)


# --------------------------------------------------------------------------
# torch <-> GGUF names
# --------------------------------------------------------------------------
def _block_tensors(model):
    """(GGUF name, parameter) of every per-layer tensor."""
    for il, b in enumerate(model.blocks):
        p = f"blk.{il}."
        for n, t in (("attn_norm", b.attn_norm), ("attn_q", b.wq), ("attn_k", b.wk), ("attn_v", b.wv),
                     ("attn_output", b.wo), ("attn_q_norm", b.q_norm), ("attn_k_norm", b.k_norm),
                     ("ffn_norm", b.ffn_norm), ("ffn_gate_inp", b.router), ("ffn_gate_exps", b.w_gate),
                     ("ffn_up_exps", b.w_up), ("ffn_down_exps", b.w_down)):
            yield p + n + ".weight", t


def gguf_weights(model) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names, numpy order (the full [n_vocab, d] embedding)."""
    def a(t):
        return t.detach().float().numpy().copy()
    out = {"token_embd.weight": a(model.full_embedding()), "output_norm.weight": a(model.out_norm)}
    out.update((name, a(t)) for name, t in _block_tensors(model))
    return out


def load_stored(model, stored: dict[str, np.ndarray]) -> None:
    """Put the file's values back into the model (compact embedding rows from the full matrix)."""
    torch = _torch()
    with torch.no_grad():
        model.embed.copy_(torch.from_numpy(stored["token_embd.weight"])[model.seen])
        model.out_norm.copy_(torch.from_numpy(stored["output_norm.weight"]))
        for name, t in _block_tensors(model):
            t.copy_(torch.from_numpy(stored[name]))


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------
def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args) -> dict:
    torch = _torch()
    from .train_export import stored_weights, write_gguf
    from .train_model import MoeConfig, MoeLM
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.monotonic()
    tok = tokenizer()
    bos, n_vocab = tok.token_bos(), tok.n_vocab()
    streams, text_info = training_tokens(tok)
    counts = np.bincount(np.concatenate(streams), minlength=n_vocab)
    counts[bos] += args.min_count
    seen = np.flatnonzero(counts >= args.min_count)
    remap = np.full(n_vocab, len(seen), dtype=np.int64)       # unseen -> the "all other tokens" column
    remap[seen] = np.arange(len(seen))
    data = windows(streams, args.ctx - 1)
    _progress(f"{sum(len(s) for s in streams)} training tokens, {len(data)} windows of {args.ctx - 1}, "
              f"{len(seen)} token rows trained (count >= {args.min_count}) of {n_vocab}")
    cfg = MoeConfig(n_vocab=n_vocab, n_embd=args.embd, n_layer=args.layers, n_head=args.heads,
                    n_head_kv=args.heads_kv, head_dim=args.embd // args.heads, n_expert=args.experts,
                    n_expert_used=args.k, n_ff_exp=args.expert_ff, n_ctx=args.ctx)
    gen = torch.Generator().manual_seed(args.seed)
    model = MoeLM(cfg, torch.from_numpy(seen))
    model.init_weights(gen)
    router = [b.router for b in model.blocks]
    ids = {id(p) for p in router}
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in ids]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    # routers: no weight decay and a higher rate, so the gate logits can grow apart.  Trials (docs/testbed.md):
    # the shared rate with decay flattened the top-k weights towards 1/k over 50 steps; 5x without decay and an
    # aux weight of 0.02 overshot (top-1 median 0.42) and crowded the tokens onto few experts (aux loss 5.7)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "mult": 1.0},
                             {"params": no_decay, "weight_decay": 0.0, "mult": 1.0},
                             {"params": router, "weight_decay": 0.0, "mult": args.router_lr}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    order = torch.randperm(len(data), generator=gen)
    pos, epoch, log = 0, 0, []
    cols = torch.from_numpy(remap)
    bos_col = torch.full((args.batch, 1), int(remap[bos]), dtype=torch.long)
    t0 = time.monotonic()
    for step in range(args.steps):
        if pos + args.batch > len(order):
            order, pos, epoch = torch.randperm(len(data), generator=gen), 0, epoch + 1
        idx = order[pos:pos + args.batch]
        pos += args.batch
        x = torch.cat([bos_col, cols[torch.from_numpy(data[idx.numpy()])]], dim=1)   # [B, ctx]
        for g in opt.param_groups:
            g["lr"] = g["mult"] * lr_at(step, args.steps, args.lr, args.warmup)
        stats = {} if step % args.log_every == 0 or step == args.steps - 1 else None
        h, aux = model.hidden(x[:, :-1], stats)
        lg = model.compact_logits(h)
        ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1))
        loss = ce + args.aux * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if stats is not None:
            w = torch.cat(stats["weights"])
            med = [round(float(v), 3) for v in w.median(0).values]
            el = time.monotonic() - t0
            log.append({"step": step, "ce": round(ce.item(), 4), "aux": round(aux.item(), 4),
                        "median_w": med, "epoch": epoch, "s": round(el, 1)})
            _progress(f"step {step + 1}/{args.steps} epoch {epoch} ce {ce.item():.3f} aux {aux.item():.3f} "
                      f"median w {med[0]:.3f}..{med[-1]:.3f}  {el:.0f} s")
    train_s = time.monotonic() - t0
    if args.checkpoint:
        torch.save({"state": model.state_dict(), "cfg": cfg.to_dict()}, args.checkpoint)
    weights = gguf_weights(model)
    provenance = {"config": cfg.to_dict(), "seed": args.seed, "steps": args.steps, "batch": args.batch,
                  "lr": args.lr, "router_lr": args.router_lr, "warmup": args.warmup, "aux": args.aux,
                  "min_count": args.min_count,
                  "threads": args.threads, "torch": torch.__version__, "texts": text_info,
                  "rows_trained": int(len(seen)),
                  "final": {k: v for k, v in log[-1].items() if k != "s"}}   # no times: the file is reproducible
    out = write_gguf(args.out, cfg.to_dict(), weights, provenance, _progress)
    stored = stored_weights(weights, cfg.n_layer)
    load_stored(model, stored)
    check = verify(model, out, tok, bos, args)
    info = provenance | {"log": log, "verify": check, "train_seconds": round(train_s, 1),
                         "wall_seconds": round(time.monotonic() - t_start, 1), "bytes": out.stat().st_size}
    Path(str(out) + ".json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


# --------------------------------------------------------------------------
# llama.cpp == torch
# --------------------------------------------------------------------------
def torch_logits(model, tokens: list[int]) -> np.ndarray:
    """Full-vocabulary logits of one sequence (unseen tokens: logit 0, as in the file)."""
    torch = _torch()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        rows = torch.from_numpy(np.searchsorted(model.seen.numpy(), np.array(tokens)))
        inside = model.seen[rows.clamp(max=len(model.seen) - 1)] == ids[0]
        rows = torch.where(inside, rows, len(model.seen))          # untrained tokens: the zero row
        h, _ = model.hidden(rows[None, :])
        return (h[0] @ model.full_embedding().T).numpy()


def verify(model, gguf_path: Path, tok, bos: int, args, n_chunks: int = 2) -> dict:
    """llama.cpp's logits on held-out chunks against the torch model."""
    from ._llm import Runner
    from .corpus import heldout
    toks = np.array(tok.tokenize(heldout("vim").text.encode("utf-8"), False, False))
    n = 63
    ok = list(range(0, len(toks) - n, len(toks) // n_chunks))
    res = {"chunks": [], "tokens": n + 1}
    with Runner(str(gguf_path), n_ctx=n + 1, n_threads=args.threads) as r:
        for i in ok[:n_chunks]:
            seq = [bos] + toks[i:i + n].tolist()
            a, b = r.eval_chunk(seq), torch_logits(model, seq)
            d = np.abs(a - b)
            res["chunks"].append({"start": int(i), "max_abs": float(d.max()), "max_logit": float(np.abs(b).max()),
                                  "argmax_same": float((a.argmax(1) == b.argmax(1)).mean())})
    worst = max(c["max_abs"] for c in res["chunks"])
    _progress(f"llama.cpp vs torch on {n_chunks} held-out chunks of {n + 1}: max |dlogit| {worst:.4f}, "
              f"argmax agreement {min(c['argmax_same'] for c in res['chunks']):.3f}")
    if worst > args.verify_tol:
        raise TrainError(f"llama.cpp logits differ from torch by {worst:.4f} > {args.verify_tol}: "
                         "the GGUF does not compute the trained model")
    return res


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def check_out(out: Path, force: bool) -> None:
    """Never overwrite the tokenizer's source model, nor (without ``force``) a file this command did not write."""
    if out.suffix != ".gguf":
        raise TrainError(f"--out {out}: must end in .gguf")
    if not out.exists():
        return
    from ..fixtures.tokenizer import smollm2_gguf_path
    if os.path.samefile(out, smollm2_gguf_path()):
        raise TrainError(f"--out {out} is the tokenizer's source model (SmolLM2); give another path")
    if force:
        return
    import gguf
    try:
        ours = "vis.trained.provenance" in gguf.GGUFReader(str(out)).fields
    except Exception:  # noqa: BLE001  (not a GGUF at all)
        ours = False
    if not ours:
        raise TrainError(f"--out {out} exists and was not written by `pyvis testbed train`; give another path, "
                         "or --force to replace it")


def _cmd_train(args) -> int:
    try:
        out = Path(args.out)
        check_out(out, args.force)
        if args.experts < args.k or args.k < 1:
            raise TrainError(f"--k {args.k} must be in [1, --experts {args.experts}]")
        if args.embd % args.heads or args.heads % args.heads_kv:
            raise TrainError("--embd must be a multiple of --heads, and --heads of --heads-kv")
        info = train(args)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.out}: {info['bytes'] / 2**20:.1f} MiB, trained {info['train_seconds']:.0f} s, "
          f"final ce {info['final']['ce']}, gate medians {info['final']['median_w']}")
    return 0


def register(sub) -> None:
    tb = sub.add_parser("testbed", help="testbed models with trained gating (docs/testbed.md)")
    tsub = tb.add_subparsers(dest="testbed_cmd", required=True)
    s = tsub.add_parser("train", help="train a small Qwen3-MoE on CPU (needs torch) and write it as a qwen3moe "
                        "GGUF")
    s.add_argument("-o", "--out", default=DEFAULT_OUT, help=f"output GGUF (default {DEFAULT_OUT})")
    s.add_argument("--steps", type=int, default=270, help="optimizer steps (default 270)")
    s.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    s.add_argument("--ctx", type=int, default=256, help="sequence length incl. BOS (default 256)")
    s.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    s.add_argument("--router-lr", type=float, default=2.0, help="the routers' rate as a multiple of --lr, "
                   "without weight decay (default 2)")
    s.add_argument("--warmup", type=int, default=30, help="warm-up steps (default 30)")
    s.add_argument("--aux", type=float, default=0.1, help="load-balancing loss weight (default 0.1)")
    s.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    s.add_argument("--embd", type=int, default=256, help="hidden size (default 256)")
    s.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    s.add_argument("--heads-kv", type=int, default=2, help="key/value heads (default 2)")
    s.add_argument("--experts", type=int, default=64, help="routed experts per layer (default 64)")
    s.add_argument("--expert-ff", type=int, default=64, help="FFN width of one expert (default 64)")
    s.add_argument("-k", "--k", type=int, default=6, help="experts used per token (default 6)")
    s.add_argument("--min-count", type=int, default=3, help="train the embedding rows of tokens seen at least "
                   "this often; the others stay zero (default 3)")
    s.add_argument("-s", "--seed", type=int, default=0, help="seed (default 0)")
    s.add_argument("-t", "--threads", type=int, default=1, help="torch and llama.cpp threads (default 1)")
    s.add_argument("--log-every", type=int, default=25, help="progress every N steps (default 25)")
    s.add_argument("--checkpoint", help="also save the torch state here (.pt)")
    s.add_argument("--force", action="store_true", help="replace an existing --out that this command did not write")
    s.add_argument("--verify-tol", type=float, default=0.05,
                   help="largest |logit| difference llama.cpp vs torch accepted (default 0.05)")
    s.set_defaults(fn=_cmd_train)
    from . import gate_stats
    gate_stats.register(tsub)
