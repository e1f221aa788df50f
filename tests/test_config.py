"""pyvis.moe.MoeConfig (issue #23 item 7): one typed field per row of the C settings table, held to the table (rows,
value types, built-in defaults); applied per thread in one C call and read back through C's getter
(llama_vis_moe_get_value), never from a copy kept in Python; strict about names, types and values; the old keyword
form of pyvis.moe.load still works for one release, with a DeprecationWarning."""
from __future__ import annotations

import dataclasses
import typing
import warnings

import numpy as np
import pytest

from pyvis import moe
from pyvis.runtime import capi, native
from pyvis.runtime.config import MoeConfig, VisTypeError, applied, field_of, flag_of

KW = dict(n_ctx=64, n_threads=2, verbose=False)
PROMPT = b"The expert cache reads what the router asks for"

# the Python type of each value type of the C table (llama-vis.h, enum llama_vis_moe_value_type)
TYPES = {capi.LLAMA_VIS_MOE_VALUE_SWITCH: bool, capi.LLAMA_VIS_MOE_VALUE_INT: int, capi.LLAMA_VIS_MOE_VALUE_REAL: float,
         capi.LLAMA_VIS_MOE_VALUE_WORD: str, capi.LLAMA_VIS_MOE_VALUE_INT_OR_WORD: int | str,
         capi.LLAMA_VIS_MOE_VALUE_REAL_OR_WORD: float | str, capi.LLAMA_VIS_MOE_VALUE_TEXT: str,
         capi.LLAMA_VIS_MOE_VALUE_FILE: str}


def _builtin(flag: str) -> str:
    return capi.llama_vis_moe_get_value(flag.encode(), 1).decode()


def test_the_config_mirrors_the_c_table():
    """A row added to or taken from the table, or a row whose value type or built-in default changes, fails here
    until MoeConfig says the same."""
    rows = {f.name: f for f in native.flags()}
    hints = typing.get_type_hints(MoeConfig)
    assert {flag_of(f.name) for f in dataclasses.fields(MoeConfig)} == set(rows)
    for flag, row in rows.items():
        want = TYPES[row.value_type]
        if _builtin(flag) == "":                    # unset by default: no file, --moe-substitute not given
            want = want | None
        assert hints[field_of(flag)] == want, (flag, hints[field_of(flag)], want)
    assert MoeConfig.builtin() == MoeConfig()       # every default, as C spells and parses it
    for f in dataclasses.fields(MoeConfig):         # and spelled as C spells it
        from pyvis.runtime.config import spell
        c = _builtin(flag_of(f.name))
        mine = spell(f.default)
        assert mine == (c or None) or float(mine) == float(c), (f.name, mine, c)


def _other_value(row, default):
    """A value of the row's type that is not its default (and that the C parser takes)."""
    t = row.value_type
    if t == capi.LLAMA_VIS_MOE_VALUE_SWITCH:
        return not default
    if t == capi.LLAMA_VIS_MOE_VALUE_INT:
        return default + 1
    if t == capi.LLAMA_VIS_MOE_VALUE_REAL:
        return default / 2
    if t == capi.LLAMA_VIS_MOE_VALUE_WORD:
        return next(w for w in row.value_hint.split("|") if w not in (default, "off"))
    if t == capi.LLAMA_VIS_MOE_VALUE_INT_OR_WORD:
        return 3
    if t == capi.LLAMA_VIS_MOE_VALUE_REAL_OR_WORD:
        return 0.25
    if t == capi.LLAMA_VIS_MOE_VALUE_TEXT:
        return "p50"
    assert t == capi.LLAMA_VIS_MOE_VALUE_FILE
    return "/nonexistent/only-read-at-load.bin"


def test_every_field_reaches_c_and_reads_back():
    """Each field, set alone: C's getter gives it back; after the block the thread has nothing of it."""
    before = MoeConfig.current()
    for row in native.flags():
        name = field_of(row.name)
        value = _other_value(row, getattr(MoeConfig(), name))
        assert value != getattr(before, name), name
        with applied(MoeConfig(**{name: value})):
            now = MoeConfig.current()
            assert getattr(now, name) == value, (name, getattr(now, name), value)
            # the fields not given keep what was in force
            assert {f for f in now.given if getattr(now, f) != getattr(before, f)} == {name}
        assert MoeConfig.current() == before and not capi.llama_vis_moe_thread_params_active()


def test_unset_values_round_trip():
    """A file back to none and --moe-substitute back to 'not given' (what --moe-mode fast looks at)."""
    with applied(MoeConfig(trace="/tmp/a.trace", substitute="router")):
        with applied(MoeConfig(trace=None, substitute=None)):
            now = MoeConfig.current()
            assert now.trace is None and now.substitute is None
            assert capi.llama_vis_moe_get_value(b"--moe-substitute", 0) == b""
        assert MoeConfig.current().trace == "/tmp/a.trace" and MoeConfig.current().substitute == "router"


def test_fields_not_given_keep_the_value_in_force(monkeypatch):
    """As a tool's flags do: a VIS_MOE_* knob counts unless the config gives its field."""
    monkeypatch.setenv("VIS_MOE_IO_THREADS", "7")
    with applied(MoeConfig(slots=4)):
        assert MoeConfig.current().io_threads == 7
    with applied(MoeConfig(slots=4, io_threads=2)):
        assert MoeConfig.current().io_threads == 2
    cfg = MoeConfig(slots=4).replace(io_threads=2)
    assert cfg.given == {"slots", "io_threads"} and MoeConfig.current().given == set(MoeConfig().__dataclass_fields__)


def test_restore_reads_c_not_a_python_copy():
    """An override made in C (not through pyvis) is what the thread gets back after a block."""
    assert capi.llama_vis_moe_thread_apply(b"--moe-sub-budget", b"3") == 0
    try:
        with applied(MoeConfig(sub_budget=5, slots=2)):
            assert (MoeConfig.current().sub_budget, MoeConfig.current().slots) == (5, 2)
        assert MoeConfig.current().sub_budget == 3 and capi.llama_vis_moe_thread_params_active()
    finally:
        capi.llama_vis_moe_set_thread_params(None, None)


def test_strict_names_types_and_values():
    with pytest.raises(TypeError, match=r"MoeConfig has no field 'slotz'"):
        MoeConfig(slotz=3)
    with pytest.raises(VisTypeError, match=r"prefetch_tune \(--moe-prefetch-tune\) must be True or False, got 'on'"):
        MoeConfig(prefetch_tune="on")
    with pytest.raises(VisTypeError, match=r"cap_rho \(--moe-cap-rho\) must be a number, got True"):
        MoeConfig(cap_rho=True)
    assert MoeConfig(slots=np.int64(4), sub_beta=np.float32(0.5)).slots == 4        # numpy numbers are numbers
    for cfg, needle in [(MoeConfig(policy="mru"), r"MoeConfig policy: --moe-policy: expected lru, lfu or lfu-adapt"),
                        (MoeConfig(lookahead=9), r"MoeConfig lookahead: --moe-lookahead: expected an integer in 1..4"),
                        (MoeConfig(sub_tae="q3"), r"MoeConfig sub_tae: --moe-sub-tae: expected a number"),
                        (MoeConfig(trace=""), r"MoeConfig trace: --moe-trace: expected a file path")]:
        with pytest.raises(native.VisError, match=needle):
            with applied(cfg):
                pass
        assert not capi.llama_vis_moe_thread_params_active()
    with pytest.raises(VisTypeError, match="expected a pyvis.moe.MoeConfig, got dict"):
        with applied({"slots": 4}):
            pass


def _greedy(path, config, n=4):
    llm = moe.load(path, config, n_ctx=128, n_threads=2, verbose=False, logits_all=True)
    llm.eval(llm.tokenize(PROMPT, add_bos=True))
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return np.array(llm.scores[: llm.n_tokens], copy=True), llm


def test_the_config_is_what_c_runs(fixture_dir):
    """slots and pinned_layers show in the cache's own stats, topk in the logits (against the same load without it)."""
    path = fixture_dir / "qwen3moe.gguf"
    ref, llm = _greedy(path, MoeConfig(slots=6))
    assert moe.stats(llm).n_slots == 6 and moe.stats(llm).n_misses > 0
    del llm
    _, llm = _greedy(path, MoeConfig(slots=4, pinned_layers=1))
    assert moe.layer_stats(llm, 0).managed == 0 and moe.layer_stats(llm, 1).n_slots == 4
    del llm
    fewer, llm = _greedy(path, MoeConfig(slots=6, topk=1))
    assert not np.array_equal(fewer, ref)
    del llm
    assert not capi.llama_vis_moe_thread_params_active()


def test_the_old_keyword_form_still_works_with_a_deprecation_warning(fixture_dir):
    path = fixture_dir / "qwen3moe.gguf"
    with pytest.warns(DeprecationWarning, match=r"write pyvis.moe.load\(path, pyvis.moe.MoeConfig\(slots=4, "
                                                r"stats=False\)\)"):
        llm = moe.load(path, slots=4, moe_stats=False, **KW)
    assert moe.stats(llm).n_slots == 4
    del llm
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the new form warns nothing
        llm = moe.load(path, MoeConfig(slots=4), **KW)
    del llm
    with pytest.raises(TypeError, match="not also as keywords"):
        moe.load(path, MoeConfig(slots=4), mem=100, **KW)
    with pytest.raises(VisTypeError, match="config must be a pyvis.moe.MoeConfig, got int"):
        moe.load(path, 4, **KW)
