"""User flags and engine knobs: each tool's --help lists only the --moe-* flags its users decide; every other row of
the settings table is a VIS_MOE_* knob documented in docs/knobs.md, whose old flag spelling still parses (with a
deprecation line) and still takes effect."""
from __future__ import annotations

import re
from pathlib import Path

from pyvis.runtime import capi, native, settings
from conftest import run

ROOT = Path(__file__).resolve().parent.parent
USER, VISION, KNOB = capi.LLAMA_VIS_MOE_SCOPE_USER, capi.LLAMA_VIS_MOE_SCOPE_VISION, capi.LLAMA_VIS_MOE_SCOPE_KNOB


def _listed(bindir, tool: str) -> tuple[list[str], str]:
    out = run([bindir / tool, "--help"]).stdout
    return re.findall(r"^(--moe-[a-z-]+)", out, re.M), out


def test_help_lists_the_user_flags_only(bindir):
    rows = native.flags()
    user = {f.name for f in rows if f.scope == USER}
    vision = {f.name for f in rows if f.scope == VISION}
    assert user and vision and all(f.scope in (USER, VISION, KNOB) for f in rows)
    for tool, want in [("llama-perplexity", user), ("llama-cli", user | vision), ("llama-mtmd-cli", user | vision),
                       ("llama-server", user | vision)]:
        listed, text = _listed(bindir, tool)
        assert sorted(listed) == sorted(want), tool             # each once, no knob, the vision ones where images go
        assert len(listed) <= 14, (tool, len(listed))         # issue #23 item 6: a dozen or so user flags
        for f in rows:
            if f.name in want:
                assert f"(env: {f.env})" in text, (tool, f.env)


def test_every_knob_is_documented_and_no_user_flag_is_a_knob():
    doc = (ROOT / "docs/knobs.md").read_text()
    documented = set(re.findall(r"^\| `(VIS_MOE_[A-Z_]+)` \(`(--moe-[a-z-]+)`\)", doc, re.M))
    knobs = {(f.env, f.name) for f in native.flags() if f.knob}
    assert knobs == documented


def test_a_knob_in_its_old_flag_spelling_still_works_and_says_it_is_deprecated(capfd):
    before = settings.get_tier_params().io_threads
    try:
        assert capi.llama_vis_moe_cli_apply(b"--moe-io-threads", b"3") == 0
        assert settings.get_tier_params().io_threads == 3 != before
        err = capfd.readouterr().err
        assert ("warning: --moe-io-threads is deprecated as a flag: it is an engine knob now; set "
                "VIS_MOE_IO_THREADS=3 instead") in err
        # a user flag prints nothing of the kind
        assert capi.llama_vis_moe_cli_apply(b"--moe-slots", b"4") == 0
        assert "deprecated" not in capfd.readouterr().err
    finally:
        settings.set_tier_params(None)
        settings.set_params(None)


def test_the_old_spelling_works_in_the_tools(bindir, fixture_dir):
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-slots", "4", "--moe-stream-passes", "0",
             "-p", "hi", "-n", "2", "-st", "-c", "128", "--no-warmup"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--moe-stream-passes is deprecated as a flag" in r.stderr


def test_a_flag_does_not_hide_a_bad_variable_of_its_group(bindir, fixture_dir):
    """--moe-mem sets the tier group from the values in force: a bad VIS_MOE_IO_THREADS next to it is an error, not
    silently the default."""
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-mem", "4000", "-p", "hi", "-n", "1",
             "-st", "--no-warmup"], extra_env={"VIS_MOE_IO_THREADS": "eight"}, timeout=60)
    assert r.returncode != 0
    assert "VIS_MOE_IO_THREADS: expected an integer in 1..64, got 'eight'" in r.stdout + r.stderr
    # the flag's own variable is overridden by the flag, as before
    r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-mem", "4000", "-p", "hi", "-n", "1",
             "-st", "--no-warmup"], extra_env={"VIS_MOE_MEM": "lots"}, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_profiles_demoted_to_knobs_still_take_effect_by_flag_and_variable(bindir, fixture_dir):
    """Issue #23 item 6: --moe-sub-profile and --moe-cap-profile left --help (the lossy switches' finer settings);
    their old spelling says it is deprecated and still opens the file (a missing one is the error naming it), and so
    does the variable."""
    base = [bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-slots", "4", "-p", "hi", "-n", "1", "-st",
            "-c", "128", "--no-warmup"]
    for flag, env in [("--moe-sub-profile", "VIS_MOE_SUB_PROFILE"), ("--moe-cap-profile", "VIS_MOE_CAP_PROFILE")]:
        assert next(f for f in native.flags() if f.name == flag).knob
        r = run([*base, flag, "/nonexistent/p.gguf"], timeout=120)
        assert f"warning: {flag} is deprecated as a flag: it is an engine knob now; set {env}=/nonexistent/p.gguf" \
            in r.stderr
        assert f"{env}=/nonexistent/p.gguf: cannot read it as GGUF" in r.stdout + r.stderr  # errors name the knob
        r = run(base, extra_env={env: "/nonexistent/p.gguf"}, timeout=120)
        assert "deprecated" not in r.stderr
        assert f"{env}=/nonexistent/p.gguf: cannot read it as GGUF" in r.stdout + r.stderr
