"""The freed vision encoder's bytes become expert slots (issue #24 item 2, VIS_MOE_ENCODER_RELEASE;
docs/planning.md#freeing-the-encoder-after-the-image).

A single-turn llama-mtmd-cli run under --moe-mem plans the encoder beside the text model (test_encoder_plan.py), so
the decode runs on the slots left next to it.  With the knob on, the tool frees the encoder once the prompt's images
are decoded (patch 0015) and the slots grow by its bytes: the decode misses and reads less, and the text stays the
resident run's byte for byte (a -varied text model, whose greedy text changes with what the layers compute).
"""
from __future__ import annotations

import json
import re
import sys

import pytest

from pyvis import fixtures as fx
from pyvis.fixtures import mmproj as mm

from conftest import run
from test_paging import memory_cgroup

MIB = 1 << 20
BUDGET = 187          # MiB: 1 slot per layer next to the encoder at 512 image tokens (--no-warmup), 11 without it
CGROUP = 232          # MiB: test_encoder_plan.py's cgroup, with clip's warmup
SPEC = fx._varied(fx.FIXTURES["qwen3vlmoe"])(n_ff_exp=8192)   # 3 layers x 16 experts of 1.7 MiB, varied text
CLI = ["-p", "Describe the image.", "-n", "24", "--temp", "0", "-c", "2048", "-b", "2048", "-ub", "32", "-t", "2",
       "--image-max-tokens", "512"]
FREED = re.compile(r"vis-moe: the vision encoder is freed: slots (\d+) -> (\d+) per layer")
SLOTS = re.compile(r"vis-moe: +\d+ +(\d+) +\d+")                        # the --moe-stats table: layer, slots, ...
TOTAL = re.compile(r"vis-moe: total +(\d+) +(\d+) +(\d+)")              # routed, hits, misses


@pytest.fixture(scope="module")
def vlm(fixture_dir, tmp_path_factory) -> dict:
    path = fixture_dir / f"encoder-release-{SPEC.key()}.gguf"
    if not path.exists():
        fx.write_model(SPEC, path, fast_quant=True)
    big = tmp_path_factory.mktemp("release") / "big.png"
    mm.write_test_image(big, 1024, 1024, 1)
    return {"model": path, "mmproj": fixture_dir / "qwen3vlmoe-mmproj.gguf", "small": fixture_dir / "test-image.png",
            "big": big}


def _mtmd(bindir, v, image, *extra, release=None, wrap=lambda c: c):
    # the plain plan (borrowed slots, on by default, turn off under the release; tests/test_borrow.py)
    env = {"VIS_MOE_CONFIGURE": "off", "VIS_MOE_BORROW": "off"}
    if release is not None:
        env["VIS_MOE_ENCODER_RELEASE"] = release
    return run(wrap([bindir / "llama-mtmd-cli", "-m", v["model"], "--mmproj", v["mmproj"], "--image", image, *CLI,
                     *extra]), timeout=300, extra_env=env)


def _misses(stderr: str) -> int:
    m = TOTAL.search(stderr)
    assert m, stderr[-2000:]
    return int(m.group(3))


def test_freed_encoder_grows_the_slots_and_keeps_the_text(bindir, vlm):
    ref = _mtmd(bindir, vlm, vlm["small"], "--no-warmup")
    held = _mtmd(bindir, vlm, vlm["small"], "--no-warmup", "--moe-mem", str(BUDGET), "--moe-stats", release="off")
    freed = _mtmd(bindir, vlm, vlm["small"], "--no-warmup", "--moe-mem", str(BUDGET), "--moe-stats", release="on")
    for r in (ref, held, freed):
        assert r.returncode == 0, r.stderr[-3000:]
    assert len(set(ref.stdout.split())) >= 8, ref.stdout      # text that can differ
    assert held.stdout == ref.stdout and freed.stdout == ref.stdout
    m = FREED.search(freed.stderr)
    assert m and not FREED.search(held.stderr), freed.stderr[-3000:]
    before, after = int(m.group(1)), int(m.group(2))
    # off: the decode keeps the planned slots (+ 1 in the layers the bytes left after whole rows give one more; on,
    # the plan is even: the controller scales every layer's slots together)
    assert {int(s) for s in SLOTS.findall(held.stderr)} - {before + 1} == {before}
    assert {int(s) for s in SLOTS.findall(freed.stderr)} == {after} and after >= before + 5
    # what it is for: the decode reads far less with the encoder's bytes in slots
    assert _misses(freed.stderr) * 2 < _misses(held.stderr), (held.stderr[-1500:], freed.stderr[-1500:])


def test_release_stays_inside_the_cgroup(bindir, vlm):
    """--moe-mem auto in a 232 MiB cgroup, clip's warmup, a 1024 x 1024 image: the slots grow after the image, the
    run finishes within the limit and the text is the resident run's."""
    ref = _mtmd(bindir, vlm, vlm["big"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    with memory_cgroup(CGROUP * MIB) as (wrap, peak):
        r = _mtmd(bindir, vlm, vlm["big"], "--moe-mem", "auto", "--moe-stats", release="on", wrap=wrap)
        used = peak()
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0 < used <= CGROUP * MIB
    m = FREED.search(r.stderr)
    assert m and int(m.group(2)) > int(m.group(1)), r.stderr[-3000:]
    assert r.stdout == ref.stdout


def test_where_it_does_not_apply(bindir, vlm):
    """A bad word is refused naming the knob; with VIS_MOE_ONLINE=on it is refused naming both; --moe-slots keeps
    the encoder (the plan line says why); llama-cli (no encoder) is unchanged."""
    bad = _mtmd(bindir, vlm, vlm["small"], "--no-warmup", "--moe-mem", str(BUDGET), release="maybe")
    assert bad.returncode != 0 and "VIS_MOE_ENCODER_RELEASE" in bad.stderr, bad.stderr[-2000:]
    both = run([bindir / "llama-mtmd-cli", "-m", vlm["model"], "--mmproj", vlm["mmproj"], "--image", vlm["small"],
                *CLI, "--no-warmup", "--moe-mem", str(BUDGET)], timeout=300,
               extra_env={"VIS_MOE_CONFIGURE": "off", "VIS_MOE_ENCODER_RELEASE": "on", "VIS_MOE_ONLINE": "on"})
    assert both.returncode != 0 and "VIS_MOE_ONLINE" in both.stderr and "VIS_MOE_ENCODER_RELEASE" in both.stderr
    fixed = _mtmd(bindir, vlm, vlm["small"], "--no-warmup", "--moe-mem", str(BUDGET), "--moe-slots", "2", "-v",
                  release="on")
    assert fixed.returncode == 0 and not FREED.search(fixed.stderr), fixed.stderr[-2000:]
    assert "VIS_MOE_ENCODER_RELEASE: off (--moe-slots fixes the slots)" in fixed.stderr
    text = run([bindir / "llama-cli", "-m", vlm["model"], "-p", "hi", "-n", "4", "-st", "-c", "2048", "-ub", "32", "-t", "2",
                "--temp", "0", "--moe-mem", str(BUDGET), "--moe-stats"], timeout=300,
               extra_env={"VIS_MOE_CONFIGURE": "off", "VIS_MOE_ENCODER_RELEASE": "on"})
    assert text.returncode == 0 and "encoder release" not in text.stderr, text.stderr[-2000:]


PY_RELEASE = """
import json, sys
from pyvis import vlm, moe
from pyvis.runtime import native
cfg = moe.MoeConfig(mem={budget}) if {budget} else None
with vlm.Session({model!r}, {mmproj!r}, cfg, n_ctx=2048, n_batch=2048, n_ubatch=32, n_threads=2,
                 image_max_tokens=512) as s:
    p = s.prepare("Describe the image.", [{image!r}])
    freed = s.release_encoder()
    text = s.generate(p, 24)
    st = native.moe_stats(s.main.ptr) if cfg else None
    try:
        s.prepare("Describe the image.", [{image!r}])
        again = "no error"
    except vlm.VLMError as e:
        again = str(e)
print(json.dumps(dict(text=text, freed=freed, misses=st.n_misses if st else 0, again=again)))
"""


def _py(v, budget, release):
    env = {"VIS_MOE_CONFIGURE": "off", "VIS_MOE_BORROW": "off", "VIS_MOE_ENCODER_RELEASE": release}
    r = run([sys.executable, "-c", PY_RELEASE.format(budget=budget, model=str(v["model"]), mmproj=str(v["mmproj"]),
                                                     image=str(v["small"]))], timeout=300, extra_env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_python_session_frees_the_encoder_too(vlm):
    """pyvis.vlm.Session.release_encoder (what `pyvis chat`'s single turn calls), with the budget in the MoeConfig:
    the resident run's text, far fewer misses (the encoder's bytes became slots, as in llama-mtmd-cli); the knob off
    keeps the encoder and says False; after the release a new prompt is a clear error."""
    ref = _py(vlm, 0, "off")
    held = _py(vlm, BUDGET, "off")
    freed = _py(vlm, BUDGET, "on")
    assert len(set(ref["text"].split())) >= 8, ref["text"]              # text that can differ
    assert held["text"] == ref["text"] and freed["text"] == ref["text"]
    assert not held["freed"] and held["again"] == "no error"
    assert freed["freed"]
    assert freed["misses"] * 2 < held["misses"], (held, freed)   # measured: 277 -> 47 (prefill and decode)
    assert "the vision encoder was freed" in freed["again"] and "new Session" in freed["again"]


def test_pyvis_chat_takes_the_budget_and_frees_the_encoder(vlm):
    """`pyvis chat --moe-mem` (chat's user switches --moe-mem / --moe-mode, as the C tools'): one turn frees the encoder
    (the fork's line), with the text of the run without a budget; --moe-mode fast says it is lossy; bad words are
    clear errors naming the flag."""
    base = [sys.executable, "-m", "pyvis", "chat", "-m", str(vlm["model"]), "--mmproj", str(vlm["mmproj"]), "--image",
            str(vlm["small"]), "-c", "2048", "-b", "2048", "-ub", "32", "-t", "2", "--image-max-tokens", "512",
            "-n", "24"]
    env = {"VIS_MOE_CONFIGURE": "off", "VIS_MOE_BORROW": "off", "VIS_MOE_ENCODER_RELEASE": "on"}
    ref = run(base, timeout=300, extra_env=env)
    got = run(base + ["--moe-mem", str(BUDGET)], timeout=300, extra_env=env)
    fast = run(base + ["--moe-mem", str(BUDGET), "--moe-mode", "fast"], timeout=300, extra_env=env)
    for r in (ref, got, fast):
        assert r.returncode == 0, r.stderr[-3000:]
    assert not FREED.search(ref.stderr)                       # no budget: nothing planned, nothing freed
    m = FREED.search(got.stderr)
    assert m and int(m.group(2)) >= int(m.group(1)) + 5, got.stderr[-3000:]
    assert got.stdout == ref.stdout and len(set(ref.stdout.split())) >= 8, (ref.stdout, got.stdout)
    assert "LOSSY" in fast.stderr and fast.stdout != ref.stdout
    for flag, word in (("--moe-mode", "quick"), ("--moe-mem", "lots")):
        bad = run(base + [flag, word], timeout=300, extra_env=env)
        assert bad.returncode != 0 and flag in bad.stderr and word in bad.stderr, bad.stderr[-2000:]
