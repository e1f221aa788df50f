"""The simulator's whole-model experiments (docs/policies-limits.md):
one slot pool for every layer (pyvis.runtime.cachesim_global) and the lookahead bound (policy_bounds.NextSteps).
Pure Python, no model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyvis.runtime import cachesim, cachesim_global as cg, policies, policy_bounds
from pyvis.runtime.trace import Trace

ROOT = Path(__file__).resolve().parents[1]


def _trace(ids) -> Trace:
    return Trace.from_routes(np.asarray(ids, dtype=np.int32), n_expert=16)


def _random_ids(layers: int, tokens: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hot = rng.choice(16, 6, replace=False)   # some experts come back often
    out = np.zeros((layers, tokens, k), np.int32)
    for il in range(layers):
        for t in range(tokens):
            pool = hot if rng.random() < 0.7 else np.arange(16)
            out[il, t] = rng.choice(pool, k, replace=False)
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-adapt"])
def test_a_pool_of_one_layer_is_that_layers_cache(policy):
    """With one layer the pool is the layer's own cache: the same loads, request by request."""
    ids = _random_ids(1, 80, 3, seed=1)
    got = cg.global_misses(_trace(ids), 5, policy)[0]
    want: list[int] = []
    cachesim.policy_misses(cachesim.token_requests(ids[0]), 5, policies.make(policy, 5), want)
    assert got == want
    opt: list[int] = []
    cachesim.belady_misses(cachesim.token_requests(ids[0]), 5, opt)
    assert cg.global_belady(_trace(ids), 5)[0] == opt


def test_the_pool_gives_slots_to_the_layer_that_needs_them():
    """Layer 0 cycles over 3 experts, layer 1 repeats one: with 2 slots each, layer 0 misses every token; one pool
    of 4 holds layer 0's 3 and layer 1's 1, and misses only the first uses."""
    T = 30
    ids = np.array([[[t % 3] for t in range(T)], [[7] for _ in range(T)]], np.int32)
    t = _trace(ids)
    per_layer = sum(cachesim.policy_misses(cachesim.token_requests(ids[il]), 2, policies.make("lru", 2))
                    for il in range(2))
    assert per_layer == T + 1
    pooled = cg.global_misses(t, 2, "lru")
    assert sum(map(sum, pooled.values())) == 4
    assert pooled[0][:3] == [1, 1, 1] and sum(pooled[0][3:]) == 0
    assert sum(map(sum, cg.global_belady(t, 2).values())) == 4


def test_next_steps_knows_what_lfu_cannot():
    """LFU keeps the expert used most (1) and evicts 2, which comes back next; told the next request, the bound
    evicts 1 instead.  Never below Belady's optimum, and with no window it is LFU."""
    seq = [[1], [1], [1], [2], [3], [2], [3], [2], [3]]
    lfu = cachesim.policy_misses(seq, 2, policies.make("lfu", 2))
    told = cachesim.policy_misses(seq, 2, policy_bounds.NextSteps(seq, 1))
    assert (lfu, told) == (7, 3)
    assert cachesim.belady_misses(seq, 2) <= told
    req = [list(r) for r in _random_ids(1, 120, 3, seed=3)[0]]
    assert cachesim.policy_misses(req, 5, policy_bounds.NextSteps(req, 0)) == \
        cachesim.policy_misses(req, 5, policies.make("lfu", 5))
    for w in (1, 4):
        assert cachesim.belady_misses(req, 5) <= cachesim.policy_misses(req, 5, policy_bounds.NextSteps(req, w))


def test_policy_table_rows(tmp_path):
    """scripts/policy_table.py prints the pool's rows, its optimum below 1 x the per-layer optimum, and the
    lookahead rows."""
    ids = _random_ids(3, 60, 3, seed=2)
    path = _trace(ids).save(tmp_path / "t.npz")
    r = subprocess.run([sys.executable, ROOT / "scripts" / "policy_table.py", path, "--slots", "5",
                        "--policies", "lru", "--global", "lfu", "--lookahead", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {ln.split("|")[1].strip(): float(ln.split("|")[2].split()[0]) for ln in r.stdout.splitlines()
            if ln.startswith("| ") and not ln.startswith("| policy")}
    assert set(rows) == {"lru", "global lfu", "global belady", "next-1", "global next-1"}
    assert rows["global belady"] <= 1.0 <= rows["lru"] and rows["global belady"] <= rows["global next-1"]


def test_split_by_utility_gives_slots_where_they_cut_misses():
    """Layer 0's misses fall fast with slots, layer 1's not at all: 2 x 4 slots go 6 to layer 0, 2 to layer 1
    (its floor)."""
    from pyvis.runtime.cachesim_split import split_by_utility
    curves = {0: {2: 50, 3: 30, 4: 20, 5: 12, 6: 10, 7: 10}, 1: {2: 9, 3: 9, 4: 9, 5: 9, 6: 9, 7: 9}}
    assert split_by_utility(curves, 4) == {0: 6, 1: 2}


def test_cachesim_split_runs_the_default_policy():
    """`pyvis cachesim --split` with the default policy (lfu-adapt) splits the slots (it raised before): the layer
    that cycles over every expert gives slots to the others."""
    from pyvis.runtime.cachesim_split import replay_split
    ids = _random_ids(3, 60, 3, seed=5)
    ids[0] = np.arange(60 * 3).reshape(60, 3) % 16     # layer 0 cycles over all 16: a few more slots do not help it
    res, caps = replay_split(_trace(ids), 5, policies.DEFAULT)
    assert sum(caps.values()) == 15 and caps[0] < 5, caps
    assert len(res) == 3


def test_global_next_steps_keeps_what_the_running_step_still_needs():
    """One slot per layer (a pool of 2): at step 2 layer 0 loads C; LFU evicts layer 1's B (the lower score), which
    layer 1 needs in the same step; told the rest of the step (window 0) the bound evicts A instead.  With one
    layer it is policy_bounds.NextSteps."""
    ids = np.array([[[0], [0], [2]], [[3], [1], [1]]], np.int32)     # layer 0: A A C; layer 1: D B B
    t = _trace(ids)
    assert sum(map(sum, cg.global_misses(t, 1, "lfu").values())) == 5
    assert sum(map(sum, cg.global_misses(t, 1, cg.GlobalNextSteps(t, 0)).values())) == 4
    one = _random_ids(1, 80, 3, seed=6)
    req = cachesim.token_requests(one[0])
    want: list[int] = []
    cachesim.policy_misses(req, 5, policy_bounds.NextSteps(req, 1), want)
    assert cg.global_misses(_trace(one), 5, cg.GlobalNextSteps(_trace(one), 1))[0] == want


def test_split_by_exchange_moves_only_what_pays():
    """From the even split (4 each): layer 0 gains 8 from a 5th slot, layer 1 loses 1 by giving its 4th up: one
    slot moves; the next would gain 2.1 against a loss of 2, not 10 % more: it stays (without the margin it
    moves)."""
    from pyvis.runtime.cachesim_split import split_by_exchange
    curves = {0: {2: 50, 3: 30, 4: 20, 5: 12, 6: 9.9, 7: 9.9}, 1: {2: 11, 3: 9, 4: 8, 5: 8, 6: 8, 7: 8}}
    assert split_by_exchange(curves, 4) == {0: 5, 1: 3}
    assert split_by_exchange(curves, 4, hysteresis=0.0) == {0: 6, 1: 2}
    with pytest.raises(ValueError, match="cover 8 slots"):
        split_by_exchange(curves, 8)


def test_profile_split_of_a_trace():
    """Layer 0 cycles over 5 experts, layer 1 repeats one: from 4 slots each the profile moves one slot to layer 0
    (5 hold its cycle) and no more; the split's replay then misses only the first uses."""
    from pyvis.runtime.cachesim_split import profile_split
    T = 60
    ids = np.array([[[t % 5] for t in range(T)], [[7] for _ in range(T)]], np.int32)
    t = _trace(ids)
    caps = profile_split(t, 4)
    assert caps == {0: 5, 1: 3}

    def misses(c: dict[int, int]) -> int:
        return sum(cachesim.policy_misses(cachesim.token_requests(ids[il]), c[il],
                                          policies.make(policies.DEFAULT, c[il])) for il in range(2))
    got, even = misses(caps), misses({0: 4, 1: 4})
    assert got == 6 < even
    with pytest.raises(ValueError, match="outside 1..16"):
        profile_split(t, 20)
