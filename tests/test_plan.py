"""`pyvis plan` (pyvis.runtime.plan): the runtime's compute reserve, and clear errors for nonsense options
(issue #12 item 7)."""
from __future__ import annotations

import re
import sys

import pytest

import pyvis.moe as moe
from pyvis import fixtures as fx
from pyvis.runtime import native
from pyvis.runtime import plan as vplan
from conftest import run
from test_paging import memory_cgroup

MIB = 1 << 20


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


IO_LINE = re.compile(r"vis-moe: memory plan: budget (\d+) MiB = .* \+ I/O buffers ([\d.]+) \+ slabs")


def test_the_plan_counts_the_io_threads_bounce_buffers(bindir, medium_model):
    """The expert reads' O_DIRECT bounce buffers are in the --moe-mem plan: one page-aligned region of the largest
    slice's aligned superset per reading thread, for VIS_MOE_IO_THREADS demand readers and as many fetch workers,
    and a page per slab tensor for its placement within a page (reads in place).
    The plan's fixed bytes and its smallest budget grow with the threads by exactly that; the runtime plans the same
    bytes (its memory-plan line); a run with 16 threads at the tight budget (top-k slots, every resident weight locked)
    stays inside a cgroup of that size."""
    shape = vplan.read_shape(medium_model)
    slice_bytes = max(shape.slice_bytes.values())
    assert slice_bytes == 512 * 512 // 32 * 34               # one Q8_0 512 x 512 expert of one tensor
    region = -(-slice_bytes // 4096) * 4096 + 4096
    kw = dict(n_ctx=256, n_ubatch=256, gpu=False)
    p1, p16 = (vplan.make_plan(shape, budget_mib=4096, io_threads=n, **kw) for n in (1, 16))
    placed = 4 * 3 * 4096                                    # one page of slack per slab tensor (gate, up, down x 4)
    assert p1["request"]["io_bytes"] == 2 * region + placed and p16["request"]["io_bytes"] == 32 * region + placed
    assert p16["fixed_bytes"] - p1["fixed_bytes"] == 30 * region
    assert p16["min_budget"] - p1["min_budget"] == 30 * region
    # nothing deferred (every layer pinned): no reads, no buffers
    assert vplan.make_plan(shape, budget_mib=4096, pinned=-1, io_threads=16, **kw)["request"]["io_bytes"] == 0
    env = {"VIS_MOE_IO_THREADS": "16"}
    cli = ["-p", "hello there", "-n", "8", "-st", "-t", "2", "--temp", "0", "-c", "256", "-v"]
    assert p16["tight_budget"] - p1["tight_budget"] == 30 * region
    limit = -(-p16["tight_budget"] // MIB) * MIB
    with memory_cgroup(limit) as (wrap, peak):
        r = run(wrap([bindir / "llama-cli", "-m", medium_model, *cli, "--moe-mem", "auto"]), timeout=300, extra_env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-2500:]
        assert 0 < peak() <= limit
    m = IO_LINE.search(out)
    assert m and int(m.group(1)) == limit // MIB, out[-2500:]
    assert abs(float(m.group(2)) - p16["request"]["io_bytes"] / MIB) < 0.06, m.group(0)
    assert re.search(r"file reads [1-9]", out) or "16 I/O threads" in out, out[-2500:]
