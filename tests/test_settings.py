"""pyvis.runtime from Python: the ctypes mirror against src/api/llama-vis.h, settings applied per call and thread
(the caller's own settings survive, threads do not see each other's), errors of the failing call only, and
integers checked before they reach C (issue #12: items 2, 3, 4)."""
from __future__ import annotations

import ctypes
import dataclasses
import re
import threading
from pathlib import Path

import pytest

import pyvis.moe as moe
from pyvis.runtime import capi, native, settings
from pyvis.runtime.config import MoeConfig, applied
from pyvis.runtime.settings import CapacityParams, MoeParams, PrecisionParams, TierParams

from conftest import vis_header_text

CTYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "double": ctypes.c_double,
          "const char *": ctypes.c_char_p, "const float *": ctypes.POINTER(ctypes.c_float),
          "int32_t *": ctypes.POINTER(ctypes.c_int32), "char": ctypes.c_char}


def _ctype(t: str):
    """A field's ctypes type: a scalar or pointer of CTYPES, or a nested struct of the mirror (struct NAME)."""
    if t.startswith("struct "):
        n = t.split()[1]
        return getattr(capi, f"struct_{n}", None) or getattr(capi, n)
    return CTYPES[t]
KW = dict(n_ctx=64, n_threads=2, verbose=False)


def _header():
    text = re.sub(r"//[^\n]*", "", vis_header_text())
    enums = {n: int(v) for body in re.findall(r"enum \w+ \{(.*?)\};", text, re.S)
             for n, v in re.findall(r"\b(LLAMA_VIS_\w+)\s*=\s*(-?\d+)", body)}
    structs = {m.group(1): [(t, n, int(enums.get(a, a)) if a else None) for t, n, a in
                            re.findall(r"(int32_t \*|const float \*|int32_t|int64_t|double|const char \*|char|struct \w+)\s*"
                                       r"(\w+)\s*(?:\[(\w+)\])?;", m.group(2))]
               for m in re.finditer(r"struct (\w+) \{(.*?)\};", text, re.S)}
    funcs = re.findall(r"LLAMA_API[^;(]*?\b(llama_vis_\w+)\s*\(", text)
    return structs, funcs, enums


def test_the_mirror_is_the_header():
    """Every struct of llama-vis.h with its fields in order and their C types, every function, nothing more."""
    structs, funcs, enums = _header()
    assert len(structs) >= 10 and len(funcs) >= 42 and len(enums) >= 11
    for name, cfields in structs.items():
        cls = getattr(capi, f"struct_{name}", None) or getattr(capi, name)   # struct_: named like a function
        assert [(n, _ctype(t) if a is None else _ctype(t) * a) for t, n, a in cfields] == list(cls._fields_), name
    assert {n: getattr(capi, n, None) for n in enums} == enums                # enum constants, same values
    assert {n for n in dir(capi) if n.startswith("LLAMA_VIS_")} == set(enums)
    bound = {n for n in dir(capi) if n.startswith("llama_vis_") and callable(getattr(capi, n))
             and not isinstance(getattr(capi, n), type)}
    assert bound == set(funcs)
    # the mirror's files (capi.py, its library handle capi_lib.py and the sections it re-exports: capi_moe.py,
    # capi_paging.py, capi_vlm.py)
    src = "".join(p.read_text() for p in sorted(Path(capi.__file__).parent.glob("capi*.py")))
    for f in funcs:       # the C declaration is written above each binding
        assert re.search(rf"# LLAMA_API [^\n]*\b{f}\(", src), f
    # section by section: the functions of src/api/llama-vis-X.h are bound in pyvis/runtime/capi_X.py
    api = Path(__file__).resolve().parent.parent / "src" / "api"
    for section in ("moe", "paging", "vlm"):
        text = re.sub(r"//[^\n]*", "", (api / f"llama-vis-{section}.h").read_text())
        declared = set(re.findall(r"LLAMA_API[^;(]*?\b(llama_vis_\w+)\s*\(", text))
        mirror = (Path(capi.__file__).parent / f"capi_{section}.py").read_text()
        assert declared and declared == set(re.findall(r'@ctypes_function\("(llama_vis_\w+)"', mirror)), section


def test_every_settings_field_is_a_flag_of_the_c_table():
    """The process-wide structs and pyvis.vlm's sections are parts of MoeConfig (tests/test_config.py holds MoeConfig
    to the table): the same names, the same flags."""
    rows = {f.name: f for f in native.flags()}
    config = {f.name for f in dataclasses.fields(MoeConfig)}
    for cls in (MoeParams, TierParams, PrecisionParams, CapacityParams):
        assert {f.name for f in dataclasses.fields(cls)} <= config, cls
        assert {settings.flag_of(f.name) for f in dataclasses.fields(cls)} <= set(rows), cls
    assert all(rows[n].env.startswith("VIS_MOE_") and rows[n].help for n in rows)


def test_caller_settings_survive_a_load(fixture_dir):
    """Process-wide settings made before pyvis.moe.load are in force after it (the old load reset them to the
    environment's), and so is the calling thread's own override."""
    path = fixture_dir / "qwen3moe.gguf"
    settings.set_params(MoeParams(slots=8, pinned_layers=1))
    settings.set_tier_params(TierParams(io_threads=3, host_mib=2))
    try:
        llm = moe.load(path, moe.MoeConfig(slots=4, io_threads=1), **KW)
        assert moe.stats(llm).n_slots == 4                       # the load used its own
        assert settings.get_params() == MoeParams(slots=8, pinned_layers=1)
        assert settings.get_tier_params() == TierParams(io_threads=3, host_mib=2)
        assert not capi.llama_vis_moe_thread_params_active()
        with applied(MoeConfig(slots=6, io_threads=5)):
            llm = moe.load(path, moe.MoeConfig(slots=4), **KW)
            assert moe.stats(llm).n_slots == 4
            assert settings.get_params().slots == 6 and settings.get_tier_params().io_threads == 5
            assert capi.llama_vis_moe_thread_params_active()
        assert settings.get_params().slots == 8 and not capi.llama_vis_moe_thread_params_active()
    finally:
        settings.set_params(None)
        settings.set_tier_params(None)


def test_a_failed_load_restores_too(fixture_dir):
    settings.set_params(MoeParams(slots=5))
    try:
        with pytest.raises(native.VisError, match="--moe-pinned-layers 7 exceeds"):
            moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=8, pinned_layers=7), **KW)
        assert settings.get_params().slots == 5 and not capi.llama_vis_moe_thread_params_active()
    finally:
        settings.set_params(None)


def test_threads_loading_at_once_keep_their_own_settings(fixture_dir):
    """Two threads load with different settings at the same time, several rounds: each gets its own."""
    path = fixture_dir / "qwen3moe.gguf"
    rounds = 4
    barrier = threading.Barrier(2)
    got: dict[str, list] = {"cached": [], "plain": []}
    errors = []

    def worker(name, kw):
        try:
            for _ in range(rounds):
                barrier.wait(timeout=60)
                llm = moe.load(path, moe.MoeConfig(**kw), **KW)
                st = moe.stats(llm)
                got[name].append(st.n_slots if st else None)
                del llm
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=worker, args=("cached", dict(slots=4))),
          threading.Thread(target=worker, args=("plain", {}))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert got == {"cached": [4] * rounds, "plain": [None] * rounds}


def test_errors_belong_to_the_failing_call(fixture_dir, tmp_path):
    """A failed load's message is not reported again by a later failure of another kind."""
    with pytest.raises(native.VisError, match=r"MoeConfig slots: --moe-slots: expected an integer in 0..65536"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=-1), **KW)
    with pytest.raises(native.VisError, match="--moe-pinned-layers 7 exceeds"):
        moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=8, pinned_layers=7), **KW)
    # not ours to word: llama-cpp-python's own errors, exactly (no VisError, no --moe flag blamed)
    with pytest.raises(ValueError) as e:
        moe.load(tmp_path / "nonexistent.gguf", **KW)
    assert type(e.value) is ValueError and str(e.value) == f"Model path does not exist: {tmp_path / 'nonexistent.gguf'}"
    assert "--moe" not in str(e.value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError) as e:
        moe.load(bad, moe.MoeConfig(slots=4), **KW)
    assert type(e.value) is ValueError and str(e.value) == f"Failed to load model from file: {bad}"
    assert "--moe" not in str(e.value)


@pytest.mark.parametrize("kw, needle", [
    (dict(slots=2 ** 32), r"MoeConfig slots: --moe-slots: expected an integer in 0..65536 \(0 = off\), got '4294967296'"),
    (dict(slots=2 ** 32 + 4), r"MoeConfig slots: .*got '4294967300'"),
    (dict(pinned_layers=-2 ** 31 - 1), r"MoeConfig pinned_layers: --moe-pinned-layers: .*got '-2147483649'"),
    (dict(cache_mib=2 ** 63), r"MoeConfig cache_mib: --moe-cache-mib: expected an integer in 0..1073741824"),
    (dict(mem=2 ** 64), r"MoeConfig mem: --moe-mem: .*got '18446744073709551616'"),
    (dict(host_mib=-2 ** 63 - 1), r"MoeConfig host_mib: --moe-host-mib: expected an integer in 0..1073741824"),
    (dict(io_threads=2 ** 31), r"MoeConfig io_threads: --moe-io-threads: expected an integer in 1..64"),
    (dict(slots=1.5), r"slots \(--moe-slots\) must be an integer, got 1.5"),
    (dict(mem="lots"), r"MoeConfig mem: --moe-mem: expected an integer in 1..1073741824 MiB \(or auto, off\), got 'lots'"),
    (dict(direct_io="maybe"), r"MoeConfig direct_io: --moe-direct-io: expected auto, on or off, got 'maybe'"),
    (dict(store="disk"), r"MoeConfig store: --moe-store: expected file or model, got 'disk'"),
    (dict(slots=70000), r"MoeConfig slots: --moe-slots: expected an integer in 0..65536"),
    (dict(io_threads=0), r"MoeConfig io_threads: --moe-io-threads: expected an integer in 1..64"),
    (dict(slots=8, cache_mib=64), r"MoeConfig slots, cache_mib: --moe-slots and --moe-cache-mib are alternatives"),
])
def test_values_are_checked_by_the_c_parser_and_name_the_field(fixture_dir, kw, needle):
    """Integers of any size reach C as text, so nothing wraps around; the C parser's range is the check."""
    settings.set_params(MoeParams(slots=3))
    try:
        with pytest.raises(native.VisError, match=needle):
            moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(**kw), **KW)
        assert settings.get_params().slots == 3          # nothing half-applied
        assert not capi.llama_vis_moe_thread_params_active()
    finally:
        settings.set_params(None)


def test_native_arguments_are_range_checked(fixture_dir):
    llm = moe.load(fixture_dir / "qwen3moe.gguf", moe.MoeConfig(slots=8), **KW)
    for call, name in [(lambda: native.set_layer_limit(llm, 2 ** 32), "n_layers"),
                       (lambda: native.saliency_enable(None, 2 ** 32 + 1), "n_layers"),
                       (lambda: native.moe_stats(llm, 2 ** 32 - 1), "layer"),
                       (lambda: native.moe_routes(llm, -2 ** 31 - 1), "layer"),
                       (lambda: native.estimate_reserve(2 ** 63, 1, 1, 1, 1), "n_ubatch"),
                       (lambda: native.plan(budget=1 << 30, reserve_bytes=0, n_expert=2 ** 31), "n_expert")]:
        with pytest.raises(native.VisError, match=rf"{name} = -?\d+ is out of range"):
            call()
    assert native.get_layer_limit(llm) == 0


def test_missing_symbol_is_an_error_when_called_not_at_import():
    @capi.ctypes_function("llama_vis_no_such_function", [], ctypes.c_int32)
    def llama_vis_no_such_function() -> int:
        """A function a newer header might declare."""
    with pytest.raises(capi.MissingSymbol, match="llama_vis_no_such_function is missing from .*Rebuild"):
        llama_vis_no_such_function()


def test_cli_options_mirror_the_c_flag_table():
    """pyvis chat / prune-report / prune-eval take the C tools' --moe-* flags with the C table's help text (chat also
    the user switches --moe-mem and --moe-mode)."""
    from pyvis.cli import build_parser
    rows = {f.name: f for f in native.flags()}
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    lossy = [settings.flag_of(f.name) for cls in (PrecisionParams, CapacityParams) for f in dataclasses.fields(cls)]
    for cmd, names in [("chat", ["--moe-slots", "--moe-cache-mib", "--moe-pinned-layers", "--moe-stats", "--moe-trace"]
                        + lossy + ["--moe-mem", "--moe-mode"]),
                       ("prune-report", ["--moe-slots", "--moe-cache-mib", "--moe-pinned-layers"]),
                       ("prune-eval", ["--moe-slots", "--moe-cache-mib", "--moe-pinned-layers"] + lossy)]:
        opts = {o: a for a in sub[cmd]._actions for o in a.option_strings if o.startswith("--moe-")}
        assert sorted(opts) == sorted(names), cmd
        for n in names:
            assert opts[n].help.replace("%%", "%") == rows[n].help.replace("\n", " "), (cmd, n)
            assert (opts[n].metavar or None) == rows[n].value_hint, (cmd, n)
    args = sub["chat"].parse_args(["-m", "m", "--mmproj", "p", "--moe-slots", "8", "--moe-stats", "--moe-trace", "t"])
    assert settings.from_args(MoeParams, args) == MoeParams(slots=8, stats=True, trace="t")
