"""The graph node capacity the expert passes reserve (vis_moe_extra_nodes, src/core/vis-moe-graph.cpp).

Upstream's scheduler sizes its allocations by the context's node capacity (`sched_reserve: max_nodes`), about
0.85 KiB resident per node (docs/planning.md#the-schedulers-node-capacity).  A ubatch that needs more than
--moe-stream-passes passes in a layer streams it in one pass, so the capacity reserves at most that many per layer; where
nothing streams (VIS_MOE_STREAM_PASSES=0, or a bound at the passes) it reserves every pass, and those runs build graphs
of all of them.  Every run prints the text upstream samples at one seed (its greedy text repeats a token; a capacity too small would
abort in ggml).
"""
from __future__ import annotations

import re

from conftest import run
from pyvis import fixtures as fx

PROMPT = "the expert cache keeps some experts of every layer resident and reads the others from the file"
SPEC = fx.FIXTURES["qwen3moe-varied"]()  # the varied fixture's shape: 3 layers of 32 experts, top-8
# -ub 256 at top-8 and one slot: 2048 pairs route all 32 experts, 32 passes a layer
PASSES = SPEC.n_expert
CLI = ["-p", PROMPT, "-n", "16", "-st", "-t", "2", "--temp", "1", "--seed", "3", "-c", "256", "-ub", "256", "-nr"]


def _max_nodes(out: str) -> int:
    got = re.findall(r"sched_reserve: max_nodes = (\d+)", out)
    assert got, out[-2000:]
    return int(got[-1])  # the context's last reserve: the one its graphs run with


def _generated(stdout: str) -> str:
    """llama-cli's text after the echoed prompt, up to its speed line"""
    m = re.search(r"\n> [^\n]*\n(.*?)\[ Prompt: ", stdout, re.S)
    assert m, stdout[-1500:]
    return m.group(1)


def _cli(bindir, model, *extra, env=None):
    text = run([bindir / "llama-cli", "-m", model, *CLI, *extra], timeout=300, extra_env=env)
    verbose = run([bindir / "llama-cli", "-m", model, *CLI, *extra, "-v"], timeout=300, extra_env=env)
    assert text.returncode == 0 and verbose.returncode == 0, (text.stderr + verbose.stderr)[-2000:]
    return _generated(text.stdout), _max_nodes(verbose.stdout + verbose.stderr)


def test_streamed_layers_reserve_no_more_passes_than_stream(bindir, fixture_dir):
    model = fixture_dir / f"{fx.VARIED_TEXT['qwen3moe']}.gguf"
    want, base = _cli(bindir, model)
    assert len(set(want.split())) >= 4, want  # a text that can differ
    nodes = {}
    for sp in (8, 0, PASSES):
        text, n = _cli(bindir, model, "--moe-slots", "1", env={"VIS_MOE_STREAM_PASSES": str(sp)})
        assert text == want, sp
        nodes[sp] = n - base
    layers = SPEC.n_layer
    # the default (8): the prompt's ubatch streams, a graph never has more than 8 passes in a layer, or one pass and
    # the k miss passes of VIS_MOE_OVERLAP (on by default)
    assert 0 < nodes[8] <= layers * (32 * max(8, 1 + SPEC.n_expert_used) + 16), nodes
    # nothing streams: every one of the 32 passes is reserved (and built: the prompt's ubatch runs them)
    assert layers * 32 * PASSES <= nodes[0] <= layers * (32 * PASSES + 16), nodes
    assert nodes[PASSES] == nodes[0], nodes
