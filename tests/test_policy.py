"""The runtime's eviction policies (VIS_MOE_POLICY=lru|lfu|lfu-adapt, src/core/vis-moe-policy.cpp; docs/policies.md).

- runtime = simulator: the runtime's misses per layer under lru, lfu and lfu-adapt equal pyvis.runtime.cachesim's
  replay of its own routing trace with the same policy of pyvis.runtime.policies (and differ from the other
  policies', so the knob is seen to act);
- exact: logits under lfu and lfu-adapt are byte-identical to upstream's on every fixture architecture at small
  slot counts;
- strict: a bad VIS_MOE_POLICY is an error naming the variable.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from pyvis.runtime import policies
from pyvis.runtime.cachesim import belady_misses, layer_requests, policy_misses
from pyvis.runtime.trace import read

from conftest import LOGITS_KW, TEXT_FIXTURES, greedy_logits, run

PROMPT = "An eviction policy decides which expert leaves the cache; the output must not change."
N_DECODE = 5


@pytest.fixture(scope="module")
def reference(fixture_dir):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = greedy_logits(fixture_dir / f"{name}.gguf", PROMPT, N_DECODE)[0]
        return cache[name]
    return get


def run_workload(llm) -> None:
    """A prefill in passes, 12 greedy steps, then random tokens with repeats, so that some experts come back often
    (frequency matters)."""
    llm.eval(llm.tokenize(b"a prefill that routes more experts than slots, in passes", add_bos=True))
    for _ in range(12):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    rng = np.random.default_rng(7)
    pool = rng.integers(100, 20000, size=12)
    for tok in rng.choice(pool, size=60).tolist():
        llm.eval([int(tok)])


@pytest.mark.parametrize("policy", policies.RUNTIME)
def test_runtime_policy_matches_the_simulation(fixture_dir, tmp_path, monkeypatch, policy):
    """A prefill in passes, greedy steps and random tokens (varied routing, evictions often choosing between experts
    last used in the same step): per layer, the runtime's misses under VIS_MOE_POLICY equal the simulator's replay
    of its own trace with the same policy, and differ from the replay with the other policies somewhere (so the
    knob is seen to act); Belady's optimum never misses more."""
    monkeypatch.setenv("VIS_MOE_POLICY", policy)
    spec = fx.FIXTURES["qwen3moe"]()
    path = tmp_path / f"{policy}.trace"
    slots = 12
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=slots, trace=str(path)),
                   n_ctx=160, n_threads=2, verbose=False)
    run_workload(llm)
    per_layer = {il: moe.layer_stats(llm, il).n_misses for il in range(spec.n_layer)}
    del llm
    t = read(path)
    differs = {other: False for other in policies.RUNTIME if other != policy}
    for il in range(spec.n_layer):
        req = layer_requests(t, il)
        assert policy_misses(req, slots, policies.make(policy, slots)) == per_layer[il], il
        assert belady_misses(req, slots) <= per_layer[il]
        for other in differs:
            differs[other] |= policy_misses(req, slots, policies.make(other, slots)) != per_layer[il]
    assert all(differs.values()), (per_layer, differs)


@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_policies_are_byte_identical(fixture_dir, reference, monkeypatch, name):
    """Logits under lfu at the top-k and under lfu-adapt at one slot fewer (passes) equal upstream's bit for bit."""
    spec = fx.FIXTURES[name]()
    ref = reference(name)
    for policy, slots in (("lfu", spec.n_expert_used), ("lfu-adapt", spec.n_expert_used - 1)):
        monkeypatch.setenv("VIS_MOE_POLICY", policy)
        logits, llm = greedy_logits(fixture_dir / f"{name}.gguf", PROMPT, N_DECODE, slots=slots)
        misses = sum(moe.layer_stats(llm, il).n_misses for il in range(spec.n_layer))
        del llm
        assert misses > 0
        assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32)), (name, policy, slots)


def test_bad_policy_is_a_clear_error(bindir, fixture_dir, monkeypatch):
    monkeypatch.setenv("VIS_MOE_POLICY", "mru")
    with pytest.raises(moe.VisError, match=r"VIS_MOE_POLICY: expected lru, lfu or lfu-adapt, got 'mru'"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=8), **LOGITS_KW)
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "-p", "Hi", "-n", "2", "-st", "-c", "64",
             "-t", "2", "--moe-slots", "8", "--moe-policy", "lfu-2"], timeout=120)
    assert r.returncode != 0 and "--moe-policy: expected lru, lfu or lfu-adapt, got 'lfu-2'" in r.stdout + r.stderr


def test_default_policy_is_the_runtimes():
    """`pyvis cachesim --policy default` replays what the runtime runs when VIS_MOE_POLICY is unset."""
    from pyvis.runtime import native
    row = next(f for f in native.flags() if f.name == "--moe-policy")
    assert row.env == "VIS_MOE_POLICY" and f"(default: {policies.DEFAULT})" in row.help
    assert row.value_hint == "|".join(policies.RUNTIME)
