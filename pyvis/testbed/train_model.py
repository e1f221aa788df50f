"""The torch model that ``pyvis testbed train`` trains: a small Qwen3-MoE (arch ``qwen3moe`` of llama.cpp).

It computes exactly what llama.cpp's ``qwen3moe`` graph computes, so the trained weights can be written to a
GGUF unchanged:

- token embedding, tied with the output (no ``output.weight``), RMSNorm (eps 1e-6) before attention, FFN and
  output;
- attention: q/k/v/o without bias, grouped-query heads (query head ``h`` reads key/value head
  ``h // (n_head / n_head_kv)``), per-head RMSNorm of q and k before NEOX RoPE (pairs ``i, i + head_dim/2``,
  ``theta_i = base^(-2i/head_dim)``), causal softmax with scale ``1/sqrt(head_dim)``;
- MoE FFN: router logits ``x @ W_r^T``, softmax over all experts, top-k, the k weights renormalised to sum 1
  (``norm_w = true`` in ``build_moe_ffn``), each expert a SwiGLU ``down(silu(gate x) * up x)``.

Training reads only the tokens that occur in the training text (``seen``): the output softmax runs over their
rows plus one constant logit ``log(n_vocab - n_seen)``, which is exact for a full-vocabulary model whose
unseen rows are zero (their logits are 0).  :meth:`MoeLM.full_embedding` builds that full matrix.

torch is imported by this module only; nothing else in pyvis needs it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoeConfig:
    n_vocab: int            # the tokenizer's vocabulary (SmolLM2: 49152)
    n_embd: int = 256
    n_layer: int = 6
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 64
    n_expert_used: int = 6
    n_ff_exp: int = 64
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    n_ctx: int = 256

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, c: MoeConfig):
        super().__init__()
        d, hd = c.n_embd, c.head_dim
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.wq = nn.Parameter(torch.empty(c.n_head * hd, d))
        self.wk = nn.Parameter(torch.empty(c.n_head_kv * hd, d))
        self.wv = nn.Parameter(torch.empty(c.n_head_kv * hd, d))
        self.wo = nn.Parameter(torch.empty(d, c.n_head * hd))
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.router = nn.Parameter(torch.empty(c.n_expert, d))
        self.w_gate = nn.Parameter(torch.empty(c.n_expert, c.n_ff_exp, d))
        self.w_up = nn.Parameter(torch.empty(c.n_expert, c.n_ff_exp, d))
        self.w_down = nn.Parameter(torch.empty(c.n_expert, d, c.n_ff_exp))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        h = rms_norm(x, self.attn_norm, c.rms_eps)
        q = (h @ self.wq.T).view(B, T, c.n_head, c.head_dim)
        k = (h @ self.wk.T).view(B, T, c.n_head_kv, c.head_dim)
        v = (h @ self.wv.T).view(B, T, c.n_head_kv, c.head_dim)
        q = rope_neox(rms_norm(q, self.q_norm, c.rms_eps).transpose(1, 2), cos, sin)
        k = rope_neox(rms_norm(k, self.k_norm, c.rms_eps).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        rep = c.n_head // c.n_head_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        return o.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim) @ self.wo.T

    def moe(self, x: torch.Tensor, stats: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (output [N, d], load-balancing loss); ``stats`` collects the top-k weights and ids."""
        c = self.c
        h = rms_norm(x, self.ffn_norm, c.rms_eps)
        probs = torch.softmax(h @ self.router.T, dim=-1)                  # [N, E]
        w, idx = torch.topk(probs, c.n_expert_used, dim=-1)               # sorted, largest first
        w = w / w.sum(-1, keepdim=True)
        if stats is not None:
            stats.setdefault("weights", []).append(w.detach())
            stats.setdefault("ids", []).append(idx.detach())
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // c.n_expert_used
        counts = torch.bincount(flat, minlength=c.n_expert)
        hs = h[tok]
        outs, pos = [], 0
        wg, wu, wd = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)   # one grad copy each
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            xe = hs[pos:pos + n]
            outs.append((F.silu(xe @ wg[e].T) * (xe @ wu[e].T)) @ wd[e].T)
            pos += n
        ys = torch.cat(outs) * w.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(h).index_add_(0, tok, ys)
        frac = counts.to(probs.dtype) / flat.numel()
        aux = c.n_expert * (frac * probs.mean(0)).sum()
        return out, aux

    def forward(self, x, cos, sin, stats=None):
        x = x + self.attention(x, cos, sin)
        B, T, d = x.shape
        y, aux = self.moe(x.reshape(B * T, d), stats)
        return x + y.view(B, T, d), aux


class MoeLM(nn.Module):
    def __init__(self, c: MoeConfig, seen: torch.Tensor):
        """``seen``: sorted token ids of the training text; the model's rows are these tokens only."""
        super().__init__()
        self.c = c
        self.register_buffer("seen", seen.clone().long(), persistent=True)
        self.embed = nn.Parameter(torch.empty(len(seen), c.n_embd))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.out_norm = nn.Parameter(torch.ones(c.n_embd))
        hd = c.head_dim
        inv = c.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(c.n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        self.n_unseen = c.n_vocab - len(seen)

    def init_weights(self, gen: torch.Generator) -> None:
        std = 0.02
        resid = std / math.sqrt(2 * self.c.n_layer)
        with torch.no_grad():
            self.embed.normal_(0.0, std, generator=gen)
            for b in self.blocks:
                for p in (b.wq, b.wk, b.wv, b.router, b.w_gate, b.w_up):
                    p.normal_(0.0, std, generator=gen)
                for p in (b.wo, b.w_down):
                    p.normal_(0.0, resid, generator=gen)

    def hidden(self, ids: torch.Tensor, stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] in compact (seen-row) numbering, ``len(seen)`` for any other token (its embedding is zero,
        as in the file) -> final normed hidden [B, T, d], mean aux loss."""
        T = ids.shape[1]
        x = torch.cat([self.embed, self.embed.new_zeros(1, self.c.n_embd)])[ids]
        aux = x.new_zeros(())
        for b in self.blocks:
            x, a = b(x, self.cos[:T], self.sin[:T], stats)
            aux = aux + a
        return rms_norm(x, self.out_norm, self.c.rms_eps), aux / self.c.n_layer

    def compact_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the seen rows plus the last column: all unseen tokens together (logit 0 each)."""
        lg = h @ self.embed.T
        extra = torch.full(lg.shape[:-1] + (1,), math.log(max(self.n_unseen, 1)) if self.n_unseen else -1e30,
                           dtype=lg.dtype)
        return torch.cat([lg, extra], dim=-1)

    def full_embedding(self) -> torch.Tensor:
        """The [n_vocab, d] matrix the GGUF stores: trained rows at the seen ids, zeros elsewhere."""
        E = torch.zeros(self.c.n_vocab, self.c.n_embd)
        E[self.seen] = self.embed.detach()
        return E
