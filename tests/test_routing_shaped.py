"""The routing-shaped benchmark generator (``pyvis fixtures --large --routing shaped``).

A small qwen3moe (4 layers, 256 wide, 64 experts top-8) is written in both modes and run through our
llama-perplexity on random tokens with ``--moe-trace``: the default model routes like chance, the shaped
one keeps part of its experts from one token to the next without collapsing onto a few.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis.fixtures import routing as rt
from pyvis.runtime.trace import load
from pyvis.testbed import routing_report as rr

from conftest import run

SMALL = dict(name="shaped-small", arch="qwen3moe", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
             n_ff=256, n_ff_exp=64, n_expert=64, n_expert_used=8, expert_type="Q8_0", weight_type="Q8_0",
             embd_type="Q8_0")


def test_default_large_spec_is_unchanged():
    """Fixture files are keyed by their spec: the default must hash as before the mode existed."""
    assert fx.large_preset().extra == {} and fx.large_preset(routing="random") == fx.large_preset()
    assert fx.large_preset().key() == "0dfec44d682636d3"
    assert fx.large_preset(routing="shaped").key() != fx.large_preset().key()
    with pytest.raises(fx.FixtureError):
        fx.large_preset(routing="nope")


@pytest.fixture(scope="module")
def shaped_small(tmp_path_factory):
    return fx.write_model(fx.ModelSpec(**SMALL, extra=rt.shaped_extra()),
                          tmp_path_factory.mktemp("shaped") / "shaped.gguf", fast_quant=True)


def _routing_stats(bindir, model, tmp_path) -> dict:
    text = tmp_path / "random.txt"
    text.write_text(rt.random_token_text(1500, seed=5))
    trace = tmp_path / (model.stem + ".trace")
    r = run([bindir / "llama-perplexity", "-m", model, "-f", text, "-c", "256", "-b", "256", "--chunks", "2",
             "-t", "2", "--moe-trace", trace], timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]
    tr = load(trace)
    return {"reuse": float(np.mean(rr.reuse(tr))), "top25": float(np.mean(rr.usage_skew(tr)["top_quarter_share"])),
            "chance": tr.k / tr.n_expert}


def test_shaped_routing_is_local_but_not_degenerate(bindir, tmp_path, shaped_small):
    plain = fx.write_model(fx.ModelSpec(**SMALL), tmp_path / "plain.gguf", fast_quant=True)
    p = _routing_stats(bindir, plain, tmp_path)
    s = _routing_stats(bindir, shaped_small, tmp_path)
    # random weights on random tokens: every token picks unrelated experts (chance = k/E = 0.125)
    assert p["reuse"] < p["chance"] + 0.08, p
    # shaped: adjacent tokens share a good part of their experts (the 48-layer model: ~0.5) ...
    assert s["reuse"] > p["reuse"] + 0.12, (p, s)
    # ... without collapsing onto a few experts
    assert s["reuse"] < 0.75 and s["top25"] < 0.7, s


def test_shaped_tensors(shaped_small):
    r = gguf.GGUFReader(shaped_small)
    t = {x.name: x for x in r.tensors}

    def deq(name, rows=None):
        x = t[name]
        raw = np.asarray(x.data)
        shape = tuple(reversed(x.shape.tolist()))
        if rows is not None:
            raw, shape = raw[:rows], (rows,) + shape[1:]
        return gguf.quants.dequantize(raw, x.tensor_type).reshape(shape)

    emb = deq("token_embd.weight", rows=2000)                         # [vocab, n_embd]
    assert np.allclose(emb[:, :rt.ANCHOR], 1.0, atol=1e-3) and emb[:, rt.ANCHOR:].std() > 0.5
    assert np.all(deq("blk.1.attn_output.weight")[:rt.ANCHOR] == 0)   # nothing writes the anchor
    assert np.all(deq("blk.1.attn_v.weight")[:, :rt.ANCHOR] == 0)     # values do not read it
    q = deq("blk.1.attn_q.weight")
    assert np.all(q[:, rt.ANCHOR:] == 0) and np.allclose(q[:, :rt.ANCHOR], 1.0, atol=1e-2)
    assert np.all(deq("blk.2.ffn_down_exps.weight")[:, :rt.ANCHOR] == 0)
    # adjacent routers are correlated (rho) up to a permutation of the experts
    a, b = (np.asarray(t[f"blk.{i}.ffn_gate_inp.weight"].data)[:, rt.ANCHOR:] for i in (1, 2))
    c = np.corrcoef(a, b)[:64, 64:]
    assert np.all(c.max(1) > 0.9) and np.all(np.sort(c, 1)[:, -2] < 0.5)
