"""Weight layouts and the trust contract (issue #12 item 3).

On CPUs where upstream repacks expert weights (Q4_0 here: CPU_REPACK), the repacked kernels round differently
from the plain ones, so upstream's own output depends on the layout.  Managed layers compute on the plain layout
(slabs hold the file's bytes; repacking each miss costs ~1.7 ms per expert against ~0.05 ms saved per use,
docs/paging.md), while everything resident - the backbone and the pinned prefix - keeps upstream's repacking.
The contract is therefore stated and tested against upstream with the *same* layout: with no pinned layer that
is upstream with `--no-repack`; with a pinned prefix the layout is mixed and the reference is the same layout at
another cache size (upstream's `-ot ...=CPU` still maps to CPU_REPACK in this version).
"""
from __future__ import annotations

import numpy as np
import pytest

import pyvis  # noqa: F401
from pyvis import fixtures as fx
from pyvis.runtime.config import MoeConfig, applied
from conftest import lowlevel_greedy

SPEC = fx.ModelSpec(name="repack", arch="qwen3moe", n_layer=3, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                    n_ff=256, n_ff_exp=256, n_expert=16, n_expert_used=4, expert_type="Q4_0", weight_type="F32",
                    embd_type="F16")
PROMPT = b"Repacked experts and slabs of memory in a longer prompt to route more"


@pytest.fixture(scope="module")
def repack_model(fixture_dir):
    path = fixture_dir / f"repack-{SPEC.key()}.gguf"
    if not path.exists():
        fx.write_model(SPEC, path, fast_quant=True)
    return path


def _logits(path, extra_bufts=True, **moe_kw):
    """Logits of every prompt token (conftest.lowlevel_greedy: llama_cpp.Llama takes no use_extra_bufts)."""
    return lowlevel_greedy(path, PROMPT, 0, extra_bufts, applied(MoeConfig(**moe_kw)) if moe_kw else None)[0]


def _same(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_layouts_differ_upstream_and_managed_layers_match_the_plain_one(repack_model):
    repacked, plain = _logits(repack_model), _logits(repack_model, extra_bufts=False)
    # the layout changes upstream's own output on this model: the comparison below is not vacuous
    assert not _same(repacked, plain)
    for slots in (4, 1):
        assert _same(_logits(repack_model, slots=slots), plain), slots


def test_pinned_prefix_stays_repacked_and_the_cache_size_changes_nothing(repack_model):
    """With a pinned prefix the layout is mixed (prefix repacked, managed layers plain).  This upstream cannot
    express (its `-ot ...=CPU` maps to CPU_REPACK), so the reference is the same mixed layout at another cache size."""
    ours = _logits(repack_model, slots=4, pinned_layers=1)
    assert _same(ours, _logits(repack_model, slots=1, pinned_layers=1))
    assert _same(ours, _logits(repack_model, slots=15, pinned_layers=1))
    assert not _same(ours, _logits(repack_model, extra_bufts=False))  # layer 0 really is repacked
