"""`import pyvis` gives a working llama_cpp bound to our fork; pyvis' own bindings and CLI."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pyvis
from pyvis import _paths
from pyvis.runtime import native as _native
from pyvis import fixtures as fx
from conftest import run

llama_cpp = _native.llama_cpp


def test_llama_cpp_is_bound_to_our_build():
    lib = Path(llama_cpp.llama_cpp._lib._name).resolve()
    assert lib.parent == _paths.lib_dir().resolve()
    info = llama_cpp.llama_print_system_info().decode()
    assert _native.system_info_fragment() in info  # patch 0001 calls into src/api/vis-info.cpp
    assert _native.upstream_commit() == "0c1e570"
    assert _native.version() == pyvis.__version__


def test_mtmd_bindings_load_our_libmtmd():
    from llama_cpp import mtmd_cpp
    assert Path(mtmd_cpp._libmtmd._name).resolve().parent == _paths.lib_dir().resolve()


def _expert_bytes(spec) -> int:
    plan = {t.name: t for t in fx.tensor_plan(spec)}
    last = spec.n_layer - 1
    return sum(fx._byte_size(t) // spec.n_expert for n, t in plan.items()
               if n.startswith(f"blk.{last}.") and n.endswith("_exps.weight"))


@pytest.mark.parametrize("name", list(fx.FIXTURES))
def test_generate_and_moe_info(fixture_dir, name):
    spec = fx.FIXTURES[name]()
    llm = llama_cpp.Llama(model_path=str(fixture_dir / f"{name}.gguf"), n_ctx=256, n_threads=2, verbose=False)
    info = _native.moe_info(llm)
    assert info.n_expert == spec.n_expert
    assert info.n_expert_used == spec.n_expert_used
    assert info.n_layer == spec.n_layer
    assert info.n_moe_layers == spec.n_layer - spec.n_dense_lead
    assert info.first_moe_layer == spec.n_dense_lead
    assert info.expert_bytes == _expert_bytes(spec)
    assert info.has_shared_exp == (spec.n_expert_shared > 0)
    assert info.has_exp_bias == (spec.arch == "gpt-oss")
    assert info.has_gate_up_exp == spec.merged_gate_up
    outs = []
    for _ in range(2):
        llm.reset()
        out = llm.create_completion("Mixture of experts", max_tokens=8, temperature=0.0, top_k=1)
        outs.append(out["choices"][0]["text"])
        assert out["usage"]["completion_tokens"] > 0
    assert outs[0] == outs[1]  # greedy is deterministic
    logits = llm.eval_logits
    assert len(logits) > 0 and all(map(lambda v: v == v, logits[-1][:100]))  # no NaN


def pyvis_cli(*args, timeout=180):
    return run([sys.executable, "-m", "pyvis.cli", *args], timeout=timeout)


def test_cli_help_lists_commands():
    r = pyvis_cli("--help")
    assert r.returncode == 0
    for cmd in ("info", "fixtures", "generate"):
        assert cmd in r.stdout


def test_cli_generate(fixture_dir):
    r = pyvis_cli("generate", "-m", fixture_dir / "mixtral.gguf", "-p", "Routing test", "-n", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("Routing test")
    assert "8 experts, top-2" in r.stderr


def test_cli_generate_takes_the_budget_and_the_mode(fixture_dir, medium_model):
    """`pyvis generate --moe-mem / --moe-mode` (the C tools' user switches): the budget is the model's and context's
    (too small: the planner's error naming it), fast says LOSSY and changes the text, bad words name the flag."""
    base = ("generate", "-m", fixture_dir / "qwen3moe-varied.gguf", "-p", "Routing test", "-n", "12", "-t", "2")
    exact, fast = pyvis_cli(*base), pyvis_cli(*base, "--moe-mode", "fast")
    assert exact.returncode == 0 and fast.returncode == 0, (exact.stderr[-2000:], fast.stderr[-2000:])
    assert "mode exact" in exact.stderr and "mode LOSSY (topk=" in fast.stderr, fast.stderr[-2000:]
    assert fast.stdout != exact.stdout
    small = pyvis_cli("generate", "-m", medium_model, "-n", "2", "--moe-mem", "60")
    assert small.returncode == 1 and "--moe-mem 60" in small.stderr and "too small" in small.stderr
    assert "Traceback" not in small.stderr
    for flag, word in (("--moe-mode", "quick"), ("--moe-mem", "lots")):
        bad = pyvis_cli(*base, flag, word)
        assert bad.returncode != 0 and flag in bad.stderr and word in bad.stderr and "Traceback" not in bad.stderr


def test_cli_info_reports_moe_shape(fixture_dir):
    r = pyvis_cli("info", "-m", fixture_dir / "deepseek2.gguf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "VIS_MOE" in r.stdout
    assert "n_expert_shared  2" in r.stdout and "first_moe_layer  1" in r.stdout


def test_cli_missing_model_is_a_clear_error(tmp_path):
    r = pyvis_cli("generate", "-m", tmp_path / "nope.gguf")
    assert r.returncode != 0
    assert "model file not found" in r.stderr and "Traceback" not in r.stderr


def test_truncated_gguf_is_a_clear_error(fixture_dir, tmp_path, bindir):
    src = (fixture_dir / "qwen3moe.gguf").read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(src[: len(src) // 2])
    r = pyvis_cli("generate", "-m", bad)
    assert r.returncode == 1 and "failed to load" in r.stderr and "Traceback" not in r.stderr
    r = run([bindir / "llama-cli", "-m", bad, "-p", "x", "-n", "1", "-st"], timeout=60)
    assert r.returncode not in (0,) and r.returncode > 0  # an error exit, not a signal


def _resolve(dotted: str):
    """Import the longest module prefix of a dotted name, then get the rest as attributes."""
    import importlib
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for a in parts[i:]:
            obj = getattr(obj, a)
        return obj
    raise ModuleNotFoundError(dotted)


def test_documented_python_names_resolve():
    """Every `pyvis.x.y` the README and the user docs name is importable."""
    import re
    root = Path(__file__).resolve().parent.parent
    names = set()
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if doc.name == "architecture.md":          # the maintainers' map, redrawn with the C layout
            continue
        names |= {m.rstrip(".") for m in re.findall(r"\bpyvis(?:\.[A-Za-z_][A-Za-z0-9_]*)+", doc.read_text())}
    assert {"pyvis.moe.load", "pyvis.vlm.VLMError"} <= names
    for name in sorted(names):
        if name.endswith(".py"):                   # a file path like pyvis/vlm/session.py written with dots
            continue
        assert _resolve(name) is not None, name


def test_documented_entry_points_are_the_runtime_modules():
    """One name per module: pyvis.moe is the module that defines load (there is no second name for it), and
    pyvis._native is pyvis.runtime.native."""
    import importlib.util
    import pyvis.moe
    import pyvis.vlm
    from pyvis import _native as documented
    from pyvis.runtime import native
    assert documented is native
    assert pyvis.moe.load.__module__ == "pyvis.moe" and importlib.util.find_spec("pyvis.runtime.moe") is None
    assert pyvis.moe.MoeConfig.__module__ == "pyvis.runtime.config"    # re-exported: the settings are runtime's
    assert callable(pyvis.moe.load) and callable(pyvis.vlm.prepare) and callable(documented.moe_info)
