"""`pyvis plan` (pyvis.runtime.plan): the runtime's compute reserve, and clear errors for nonsense options
(issue #12 item 7)."""
from __future__ import annotations

import sys

import pytest

import pyvis.moe as moe
from pyvis import fixtures as fx
from pyvis.runtime import native
from pyvis.runtime import plan as vplan
from conftest import run


@pytest.mark.parametrize("name", list(fx.FIXTURES))
def test_plan_reserve_is_the_runtimes(fixture_dir, name):
    """pyvis plan's compute reserve equals the one the runtime's --moe-mem plan used for the same model."""
    path = fixture_dir / f"{name}.gguf"
    llm = moe.load(path, moe.MoeConfig(mem=4096, slots=2),
                   n_ctx=256, n_threads=2, verbose=False)  # explicit slots: a managed plan
    used = native.context_reserve(llm)
    assert used is not None and used > 0
    shape = vplan.read_shape(path)
    p = vplan.make_plan(shape, budget_mib=4096, n_ctx=256, n_ubatch=llm.context_params.n_ubatch, slots=2)
    assert p["request"]["reserve_bytes"] == used


@pytest.mark.parametrize("args, option, expected", [
    (["--budget", "0"], "--budget", "an integer in 1..8796093022207 MiB (or auto), got '0'"),
    (["--budget", "abc"], "--budget", "got 'abc'"),
    (["--pinned", "-2"], "--pinned", "an integer in -1..2147483647 (-1 = all), got '-2'"),
    (["-c", "-5"], "-c/--ctx-size", "an integer in 1..2147483647, got '-5'"),
    (["-ub", "0"], "-ub/--ubatch-size", "an integer in 1..2147483647, got '0'"),
    (["--slots", "-1"], "--slots", "an integer in 0..65536 (0 = planned), got '-1'"),
    (["--host-mib", "-2"], "--host-mib", "(-1 = planned), got '-2'"),
    (["--device-mib", "0"], "--device-mib", "got '0'"),
    (["--slots", "4294967296"], "--slots", "got '4294967296'"),
    (["--image-max-tokens", "0"], "--image-max-tokens", "in 1..2147483647 (or -1 = the projector's limit), got '0'"),
    (["--image-max-tokens", "-2"], "--image-max-tokens", "got '-2'"),
    (["chat", "--image-max-tokens", "-5"], "--image-max-tokens", "(or -1 = the projector's limit), got '-5'"),
])
def test_plan_rejects_nonsense(fixture_dir, args, option, expected):
    """pyvis plan's options (and pyvis chat's --image-max-tokens, the same parser) refuse a value out of range."""
    cmd = ["chat", "--mmproj", fixture_dir / "qwen3moe.gguf"] if args[0] == "chat" else ["plan", fixture_dir / "qwen3moe.gguf"]
    r = run([sys.executable, "-m", "pyvis", *cmd, *args[args[0] == "chat":]])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert f"argument {option}: expected an integer in " in r.stderr and expected in r.stderr, r.stderr


def test_make_plan_checks_its_arguments(fixture_dir):
    shape = vplan.read_shape(fixture_dir / "qwen3moe.gguf")
    for kw, needle in [(dict(n_ctx=0), "-c/--ctx-size must be an integer in 1.."),
                       (dict(budget_mib=0), "--budget must be an integer in 1.."),
                       (dict(slots=-1), "--slots must be"), (dict(pinned=-2), "--pinned must be")]:
        with pytest.raises(ValueError, match=needle):
            vplan.make_plan(shape, **kw)
