"""Under --moe-mem a run fits the budget it reports or refuses before it allocates (issue #25, items 1-2), in a real
memory cgroup: the context's whole plan (resident weights, KV cache, compute, minimal slots) is checked before
upstream allocates its KV cache; the refusal names the smallest budget for the context and the largest context for
the budget; `pyvis plan` in the same cgroup says the same; the context it names runs.  The issue's cases, on the
medium fixture (qwen3moe like `pyvis fixtures --large`, 438 MiB: 4 layers x 128 experts, 49152-token vocabulary),
with contexts and cgroups scaled to it so that each case falls in the gap the earlier lower-bound check left (the
KV cache alone fits the budget, the whole plan does not; a KV cache larger than the budget is test_hardening2's
case); the real-weights testbed where `make run` built it.  Each test here failed on the code before its fix."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import run
from test_paging import memory_cgroup

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
REFUSAL = re.compile(r"vis-moe: --moe-mem (\S+): (.*?); smallest budget for this (\d+)-token context: (\d+) MiB "
                     r"\(KV cache (\d+) MiB\); largest context for (\d+) MiB: (-c (\d+)|none \(\d+ tokens need (\d+) MiB\))")
HINT = re.compile(r"smallest budget for this (\d+)-token context: (\d+) MiB \(KV cache (\d+) MiB\); largest context "
                  r"for (\d+) MiB: (-c (\d+)|none \(\d+ tokens need (\d+) MiB\))")
KV_ALLOCATED = re.compile(r"KV buffer size = +(\d+\.\d+) MiB")
CLI = ["-p", "hi", "-n", "2", "-st", "-t", "2", "--temp", "0", "-v"]


def _tool(bindir, model, tool: str, args: list[str]) -> list:
    if tool == "llama-bench":
        return [bindir / tool, "-m", model, "-p", "16", "-n", "4", "-r", "1", "-t", "2", *args]
    if tool == "llama-server":
        return [bindir / tool, "-m", model, "--host", "127.0.0.1", "--port", "0", "-t", "2", *args]
    return [bindir / tool, "-m", model, *CLI, *args]


def _plan(wrap, model, budget: str, n_ctx: int, extra=()):
    p = run(wrap([sys.executable, "-m", "pyvis", "plan", model, "--budget", budget, "-c", str(n_ctx), *extra]),
            timeout=120)
    return p, p.stdout + p.stderr


def _refused_before_allocating(r, out: str, limit: int, peak: int) -> re.Match:
    assert r.returncode == 1, (r.returncode, out[-2500:])              # never killed (-9 / 137)
    m = REFUSAL.search(out)
    assert m, out[-2500:]
    # the refusal came before upstream allocated the KV cache: no non-empty KV buffer was made (the --fit probe's
    # is 0.00 MiB), and the cgroup's peak stayed below what the cache would have taken
    assert not [kv for kv in KV_ALLOCATED.findall(out) if float(kv) > 0], out[-2500:]
    assert 0 < peak <= limit
    return m


@pytest.mark.parametrize("tool, args, limit_mib, budget, n_ctx, env, plan_extra", [
    # -c 32768 in 357 MiB on the 2.8 GiB --large --layers 8: KV cache 512 MiB; here -c 65536 (128 MiB) in 250 MiB
    ("llama-cli", ["-c", "65536", "--moe-mem", "auto"], 250, "auto", 65536, None, ()),
    # llama-server -c 65536 --parallel 4 (four 16384-cell sequences)
    ("llama-server", ["-c", "65536", "--parallel", "4", "--moe-mem", "auto"], 250, "auto", 65536, None, ()),
    # a budget above the cgroup (--moe-mem 2000 in 714 MiB): clamped to it, then refused with the clamped numbers
    ("llama-cli", ["-c", "65536", "--moe-mem", "2000"], 250, "2000", 65536, None, ()),
    # VIS_MOE_MEM=2000 llama-bench: the bench silences the llama log, the refusal must still be printed
    ("llama-bench", ["-d", "65536"], 250, "2000", 65556, {"VIS_MOE_MEM": "2000"}, ()),
    # --moe-slots 128 / --moe-pinned-layers -1 next to --moe-mem auto: every expert resident must fit with the KV
    ("llama-cli", ["-c", "65536", "--moe-mem", "auto", "--moe-slots", "128"], 600, "auto", 65536, None,
     ("--slots", "128")),
    ("llama-cli", ["-c", "65536", "--moe-mem", "auto", "--moe-pinned-layers", "-1"], 600, "auto", 65536, None,
     ("--pinned", "-1")),
], ids=["cli-context", "server-parallel", "budget-above-cgroup", "bench-env", "slots-all", "pinned-all"])
def test_refused_before_allocating_and_plan_agrees(bindir, medium_model, tool, args, limit_mib, budget, n_ctx, env,
                                                    plan_extra):
    limit = limit_mib * MIB
    with memory_cgroup(limit) as (wrap, peak):
        r = run(wrap(_tool(bindir, medium_model, tool, args)), timeout=300, extra_env=env)
        out = r.stdout + r.stderr
        m = _refused_before_allocating(r, out, limit, peak())
        p, pout = _plan(wrap, medium_model, budget, n_ctx, plan_extra)
    assert p.returncode == 2 and "does not fit: " in pout, pout[-2000:]
    h = HINT.search(pout)
    assert h, pout[-2000:]
    # the same minimum for this context, the same budget (clamped to the cgroup), the same largest context (within one
    # 256-cell step per sequence: pyvis plan does not model --parallel's per-sequence caches)
    assert int(m.group(4)) == int(h.group(2)) and int(m.group(6)) == int(h.group(4)) == limit_mib, (m.group(0), h.group(0))
    assert int(m.group(5)) == int(h.group(3))
    step = 256 * (4 if tool == "llama-server" else 1)
    assert (m.group(8) is None) == (h.group(6) is None), (m.group(0), h.group(0))
    if m.group(8):
        assert abs(int(m.group(8)) - int(h.group(6))) < step, (m.group(0), h.group(0))
    else:
        assert m.group(9) == h.group(7)
    if budget != "auto":
        assert f"--moe-mem {budget}: " in out


def test_the_context_a_refusal_names_runs_inside_the_budget(bindir, medium_model):
    """The largest context named fits (llama-cli runs it in the same cgroup, pyvis plan says fits) and one step
    more is refused; before, the refusal named a context from a lower bound that the full plan then refused."""
    limit = 250 * MIB
    with memory_cgroup(limit) as (wrap, peak):
        r = run(wrap(_tool(bindir, medium_model, "llama-cli", ["-c", "65536", "--moe-mem", "auto"])), timeout=300)
        m = _refused_before_allocating(r, r.stdout + r.stderr, limit, peak())
        n = int(m.group(8))
        assert 0 < n < 65536 and n % 256 == 0
        ok = run(wrap(_tool(bindir, medium_model, "llama-cli", ["-c", str(n), "--moe-mem", "auto"])), timeout=300)
        assert ok.returncode == 0, (ok.stdout + ok.stderr)[-2500:]
        assert 0 < peak() <= limit
        p, pout = _plan(wrap, medium_model, "auto", n)
        assert p.returncode == 0 and "fits: run with --moe-mem auto" in pout, pout[-1500:]
        more = run(wrap(_tool(bindir, medium_model, "llama-cli", ["-c", str(n + 256), "--moe-mem", "auto"])),
                   timeout=300)
        assert more.returncode == 1 and REFUSAL.search(more.stdout + more.stderr), (more.stdout + more.stderr)[-2500:]


def test_bench_above_the_cgroup_is_clamped_with_a_line_and_fits(bindir, medium_model):
    """VIS_MOE_MEM=2000 llama-bench in a 300 MiB cgroup: planned for 300 MiB, with the line in the bench's output
    (before: the line was a llama log warning, which llama-bench silences), and the run stays inside the limit;
    pyvis plan --budget 2000 in the same cgroup says it fits, clamped the same way."""
    limit = 300 * MIB
    with memory_cgroup(limit) as (wrap, peak):
        r = run(wrap(_tool(bindir, medium_model, "llama-bench", [])), timeout=300, extra_env={"VIS_MOE_MEM": "2000"})
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "tg4" in r.stdout, out[-2500:]
        assert re.search(r"vis-moe: --moe-mem 2000 exceeds what this process may hold \(cgroup v\d limit\): planned "
                         r"for 300 MiB instead", out), out[-2500:]
        assert 0 < peak() <= limit
        p, pout = _plan(wrap, medium_model, "2000", 16 + 4)
    assert p.returncode == 0 and "planned for 300 MiB instead" in pout and "fits: run with --moe-mem 2000" in pout


TESTBED = ROOT / "models" / "testbed" / "shared+16.gguf"


@pytest.mark.skipif(not TESTBED.exists(), reason="the real-weights testbed is built by `make run` (models/testbed)")
def test_testbed_long_context_in_a_small_cgroup(bindir):
    """llama-cli -m shared+16.gguf --moe-mem auto -c 131072 in 380 MiB: refused before the 2880 MiB KV cache, with
    the minimum and the largest context pyvis plan gives (before: it named -c 14381, which was refused too)."""
    limit = 380 * MIB
    with memory_cgroup(limit) as (wrap, peak):
        r = run(wrap(_tool(bindir, TESTBED, "llama-cli", ["-c", "131072", "--moe-mem", "auto"])), timeout=300)
        out = r.stdout + r.stderr
        m = _refused_before_allocating(r, out, limit, peak())
        p, pout = _plan(wrap, TESTBED, "auto", 131072)
    h = HINT.search(pout)
    assert p.returncode == 2 and h, pout[-2000:]
    assert (m.group(4), m.group(5), m.group(6), m.group(8)) == (h.group(2), h.group(3), h.group(4), h.group(6))
    assert int(m.group(5)) == 2880 and 0 < int(m.group(8)) < 14381


def test_an_option_that_cannot_take_effect_says_why_without_v(bindir, fixture_dir, tmp_path):
    """The "validated, not used" and "ignored" lines reach the user without -v (they were llama log warnings, which
    llama-cli shows only with -v); the generated text is unchanged."""
    from test_hardening2 import _predictor_profile_of
    model = fixture_dir / "qwen3moe.gguf"
    mine = _predictor_profile_of(model, tmp_path / "q.predict.gguf")
    base = ["-m", model, "-p", "hi", "-n", "4", "-st", "-c", "256", "-t", "2", "--temp", "0"]
    ref = run([bindir / "llama-cli", *base], timeout=120)
    r = run([bindir / "llama-cli", *base, "--moe-predict-profile", mine, "--moe-host-mib", "64"], timeout=120)
    out = r.stdout + r.stderr
    assert ref.returncode == 0 and r.returncode == 0, out[-1500:]
    assert f"vis-moe: --moe-predict-profile {mine}: validated, not used: --moe-predict is off" in out, out[-1500:]
    assert "vis-moe: --moe-host-mib 64 ignored: the host cache sits below the expert slots, which are off" in out
    assert out.count("--moe-host-mib 64 ignored") == 1                  # once, though two contexts were made
    text = lambda o: o.split("> hi", 1)[-1].split("[ Prompt:")[0]  # noqa: E731
    assert text(r.stdout) == text(ref.stdout)


def test_pyvis_load_raises_the_refusal(medium_model):
    """pyvis.moe.load: the refusal before the KV cache is a VisError with its text (before: llama_cpp's bare
    "Failed to create llama_context")."""
    from pyvis import moe
    from pyvis.runtime.native import VisError
    with pytest.raises(VisError, match=r"--moe-mem 250: .*smallest budget for this 65536-token context: \d+ MiB"):
        moe.load(medium_model, moe.MoeConfig(mem=250), n_ctx=65536, n_threads=2, verbose=False)


def test_a_refusal_names_a_smaller_ubatch_that_fits_and_it_runs(bindir, medium_model):
    """--moe-mem 160 -c 512 on the medium fixture: -ub 512's compute buffer leaves no room even for 256 tokens of
    context, but a smaller ubatch fits; the refusal names it (before: only the budget and the context), and that
    -ub runs in the same budget."""
    args = ["-c", "512", "--moe-mem", "160"]
    r = run(_tool(bindir, medium_model, "llama-cli", args), timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and REFUSAL.search(out), out[-2500:]
    m = re.search(r"; or -ub (\d+) at this context", out)
    assert m and 16 <= int(m.group(1)) < 512, out[-2500:]
    ok = run(_tool(bindir, medium_model, "llama-cli", [*args, "-ub", m.group(1)]), timeout=300)
    assert ok.returncode == 0 and not REFUSAL.search(ok.stdout + ok.stderr), (ok.stdout + ok.stderr)[-2500:]
