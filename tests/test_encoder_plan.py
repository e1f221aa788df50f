"""The vision encoder in the --moe-mem budget (issue #24 item 2, docs/planning.md#the-vision-encoder).

llama-mtmd-cli (patch 0015) and pyvis.vlm.Session hand the mmproj to the planner before the text model: the plan
counts the projector's weights, compute buffer and image copies (llama_vis_moe_encoder_estimate), so a VLM gets
fewer expert slots than the same text model alone, runs inside the budget with a large image, and its outputs stay
the resident run's.  The estimate is checked against what clip itself reserves.
"""
from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest

from pyvis import fixtures as fx
from pyvis.fixtures import mmproj as mm
from pyvis.runtime import native

from conftest import run
from test_paging import memory_cgroup

MIB = 1 << 20
BUDGET = 187          # MiB: 13 slots per layer for the text model alone, 2 next to the encoder at 512 image tokens
CGROUP = 232          # MiB: with clip's warmup the buffer is the warmup image's (2116 tokens): 5 slots
IMAGE_TOKENS = 512
# the VLM fixture's shape with 8192-wide experts (3 layers x 16 x 1.7 MiB, ~88 MiB): big enough that --moe-mem pages
# its experts at this budget instead of loading it whole, small enough to write in seconds
BIG = fx.FIXTURES["qwen3vlmoe"](n_ff_exp=8192)
CLI = ["-p", "Describe the image.", "-n", "6", "--temp", "0", "-c", "2048", "-b", "2048", "-ub", "32", "-t", "2",
       "--image-max-tokens", str(IMAGE_TOKENS)]
SLOTS = re.compile(r"vis-moe: +(\d+) +(\d+) +\d+")          # the --moe-stats table: layer, slots, routed, ...
PLAN_LINE = re.compile(r"vis-moe: memory plan: budget (\d+) MiB \([^)]*\); vision encoder (\d+) MiB of it")


@pytest.fixture(scope="module")
def vlm(fixture_dir, tmp_path_factory) -> dict:
    path = fixture_dir / f"encoder-plan-{BIG.key()}.gguf"
    if not path.exists():
        fx.write_model(BIG, path, fast_quant=True)
    d = tmp_path_factory.mktemp("encoder")
    big = d / "big.png"
    mm.write_test_image(big, 1024, 1024, 1)            # 32 x 32 tokens, resized to the planned 512 at most
    return {"model": path, "mmproj": fixture_dir / "qwen3vlmoe-mmproj.gguf", "small": fixture_dir / "test-image.png",
            "big": big}


def _mtmd(bindir, v, image, *extra, wrap=lambda c: c):
    return run(wrap([bindir / "llama-mtmd-cli", "-m", v["model"], "--mmproj", v["mmproj"], "--image", image, *CLI,
                     *extra]), timeout=300, extra_env={"VIS_MOE_CONFIGURE": "off"})


def _slots(stderr: str) -> set[int]:
    return {int(m.group(2)) for m in SLOTS.finditer(stderr)}


def _planned(p: dict) -> set[int]:
    """The slot counts `pyvis plan` gives the managed layers' slabs: the even count, and + 1 where the bytes left after
    whole rows give some layers one more (tests/test_extra_slots.py); the plan at a 16-token ubatch where borrowed
    slots (on by default) apply (tests/test_borrow.py)."""
    q = p["plan"].get("borrow") or p["plan"]
    return set(q["layer_slots"].values()) or {q["n_slots"]}


def _plan(model, *extra, budget=BUDGET) -> dict:
    r = run([sys.executable, "-m", "pyvis", "plan", model, "--budget", str(budget), "-c", "2048", "-ub", "32",
             "--json", *extra], extra_env={"VIS_MOE_CONFIGURE": "off"})
    assert r.returncode in (0, 2), r.stderr[-2000:]
    return json.loads(r.stdout)


def _reserved(stderr: str) -> tuple[float, float]:
    """clip's own numbers from a -v run: the weights (model size) and the compute buffer reserved at warmup."""
    w = re.search(r"load_hparams: model size: +([\d.]+) MiB", stderr)
    c = re.search(r"reserve_compute_meta: +CPU compute buffer size = +([\d.]+) MiB", stderr)
    assert w and c, stderr[-3000:]
    return float(w.group(1)), float(c.group(1))


@pytest.mark.parametrize("shape,fa", [("fixture", "on"), ("fixture", "off"), ("mid", "on"), ("mid", "off")])
def test_estimate_covers_what_clip_reserves(bindir, fixture_dir, tmp_path, shape, fa):
    """clip reserves its compute buffer at warmup for a 46 x 46-token image (qwen3vl_merger): the estimate at 2116
    image tokens is at least that and at most 1.45x it, with and without flash attention, on the fixture's encoder
    (n_embd 32, patch 16) and a wider one (n_embd 256, n_ff 1024, patch 14); the weights are the tensors' bytes."""
    mmproj = fixture_dir / "qwen3vlmoe-mmproj.gguf"
    if shape == "mid":
        mmproj = tmp_path / "mid-mmproj.gguf"
        mm.write_qwen3vl_mmproj(mmproj, n_embd_text=64, n_deepstack=1, n_embd_v=256, n_head=4, n_ff=1024, n_layer=2,
                                patch_size=14, pos_side=8, deepstack_layers=[0])
    r = run([bindir / "llama-mtmd-cli", "-m", fixture_dir / "qwen3vlmoe.gguf", "--mmproj", mmproj, "--image",
             fixture_dir / "test-image.png", "-p", "hi", "-n", "1", "--temp", "0", "-c", "256", "-t", "2", "-v",
             "-fa", fa], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    weights, compute = _reserved(r.stderr)
    e = native.encoder_estimate(mmproj, 46 * 46, 1 if fa == "on" else 0)
    assert e["n_patches"] == 46 * 46 * 4 and e["projector"] == "qwen3vl_merger"
    assert abs(e["weight_bytes"] / MIB - weights) < 0.01 + weights * 0.001, (e, weights)
    est = e["compute_bytes"] / MIB - 36                         # libmtmd's runtime (36 MiB) is not in the buffer
    assert compute <= est <= 1.45 * compute, (est, compute)


def test_vlm_gets_fewer_slots_by_the_encoders_bytes_with_the_resident_output(bindir, vlm):
    """--moe-mem 187 on the same text model: llama-cli (text only) runs 13 slots per layer, llama-mtmd-cli with the
    projector at 512 image tokens (--no-warmup) 2 (its ~52 MiB cost 11 slot rows of 4.8 MiB), as `pyvis plan
    --mmproj` says, and prints the encoder's share; the generated text is the resident run's byte for byte."""
    text = run([bindir / "llama-cli", "-m", vlm["model"], "-p", "hi", "-n", "2", "-st", "-c", "2048", "-ub", "32",
                "-t", "2", "--temp", "0", "--moe-mem", str(BUDGET), "--moe-stats"], timeout=300,
               extra_env={"VIS_MOE_CONFIGURE": "off"})
    assert text.returncode == 0, text.stderr[-3000:]
    ref = _mtmd(bindir, vlm, vlm["small"], "--no-warmup")
    got = _mtmd(bindir, vlm, vlm["small"], "--no-warmup", "--moe-mem", str(BUDGET), "--moe-stats")
    assert ref.returncode == 0 and got.returncode == 0, (ref.stderr + got.stderr)[-3000:]
    assert got.stdout == ref.stdout
    alone, with_enc = _plan(vlm["model"]), _plan(vlm["model"], "--mmproj", vlm["mmproj"], "--image-max-tokens",
                                                 str(IMAGE_TOKENS), "--no-warmup")
    enc = with_enc["plan"]["encoder"]
    assert _slots(text.stderr) == _planned(alone) and _slots(got.stderr) == _planned(with_enc)
    row = with_enc["plan"]["request"]["expert_bytes"]                       # one slot, one layer (CPU: no staging)
    assert alone["plan"]["n_slots"] - with_enc["plan"]["n_slots"] == pytest.approx(enc["total_bytes"] / (3 * row), abs=1)
    assert alone["plan"]["n_slots"] >= with_enc["plan"]["n_slots"] + 5
    m = PLAN_LINE.search(got.stderr)
    assert m and int(m.group(2)) == round(enc["total_bytes"] / MIB), got.stderr[-2000:]
    assert "vision encoder" not in text.stderr


def test_a_large_image_stays_inside_the_cgroup(bindir, vlm):
    """llama-mtmd-cli --moe-mem auto in a 232 MiB memory cgroup (with clip's warmup, as the tool runs by default), a
    1024 x 1024 image (resized to the 512 tokens planned): the run finishes, the cgroup's peak stays within the
    limit, the plan is `pyvis plan --mmproj`'s and the text is the resident run's."""
    ref = _mtmd(bindir, vlm, vlm["big"])
    assert ref.returncode == 0, ref.stderr[-3000:]
    with memory_cgroup(CGROUP * MIB) as (wrap, peak):
        r = _mtmd(bindir, vlm, vlm["big"], "--moe-mem", "auto", "--moe-stats", wrap=wrap)
        used = peak()
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0 < used <= CGROUP * MIB
    p = _plan(vlm["model"], "--mmproj", vlm["mmproj"], "--image-max-tokens", str(IMAGE_TOKENS), budget=CGROUP)
    assert _slots(r.stderr) == _planned(p)
    assert r.stdout == ref.stdout
    assert _slots(r.stderr) and max(_slots(r.stderr)) < BIG.n_expert       # it paged


def test_too_small_names_the_smallest_budget_with_the_encoder(bindir, vlm):
    """A budget below the floor: llama-mtmd-cli and llama-server --mmproj refuse, naming the smallest budget with the
    encoder in it (the one `pyvis plan --mmproj` names, the text-only one + the encoder's MiB); that budget runs."""
    named_by = re.compile(r"smallest budget for this \d+-token context: (\d+) MiB \(KV cache \d+ MiB, vision encoder "
                          r"(\d+) MiB\)")
    r = _mtmd(bindir, vlm, vlm["small"], "--moe-mem", "100")
    m = named_by.search(r.stderr)
    assert r.returncode == 1 and m, r.stderr[-3000:]
    named, enc_mib = int(m.group(1)), int(m.group(2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = run([bindir / "llama-server", "-m", vlm["model"], "--mmproj", vlm["mmproj"], "-c", "2048", "-ub", "32",
               "-t", "2", "--image-max-tokens", str(IMAGE_TOKENS), "--moe-mem", "100", "--port", str(port)], timeout=120,
              extra_env={"VIS_MOE_CONFIGURE": "off"})
    ms = named_by.search(srv.stdout + srv.stderr)
    assert srv.returncode == 1 and ms and ms.groups() == m.groups(), (srv.stdout + srv.stderr)[-3000:]
    p = _plan(vlm["model"], "--mmproj", vlm["mmproj"], "--image-max-tokens", str(IMAGE_TOKENS), budget=100)
    alone = _plan(vlm["model"], budget=100)
    assert -(-p["plan"]["min_budget"] // MIB) == named
    assert named - enc_mib <= -(-alone["plan"]["min_budget"] // MIB) <= named - enc_mib + 1
    ok = _mtmd(bindir, vlm, vlm["small"], "--moe-mem", str(named))
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_not_an_mmproj_is_a_clear_error(bindir, vlm, fixture_dir):
    r = run([bindir / "llama-mtmd-cli", "-m", vlm["model"], "--mmproj", fixture_dir / "qwen3moe.gguf", "--image",
             vlm["small"], "-p", "hi", "-n", "1"], timeout=120)
    assert r.returncode == 1 and "not a multimodal projector" in r.stderr, r.stderr[-2000:]


def test_session_plans_the_encoder(vlm):
    """pyvis.vlm.Session under VIS_MOE_MEM: the slots of `pyvis plan --mmproj` (as llama-mtmd-cli), the encoder, the logits
    of the prompt those of the Session without a budget, bit for bit; the planner forgets the encoder after."""
    code = (
        "import sys, numpy as np\n"
        "import pyvis.vlm as vlm\n"
        "from pyvis.runtime import native\n"
        f"s = vlm.Session({str(vlm['model'])!r}, {str(vlm['mmproj'])!r}, n_ctx=2048, n_batch=2048, n_ubatch=32,"
        f" n_threads=2, image_max_tokens={IMAGE_TOKENS})\n"
        f"p = s.prepare('Describe the image.', [{str(vlm['small'])!r}])\n"
        "st = native.moe_stats(s.main.ptr, -1)\n"
        "print('SLOTS', st.n_slots if st else 0, 'ENC', (s.encoder or {}).get('total_bytes', 0),"
        " 'AFTER', native.planned_encoder())\n"
        "sys.stdout.buffer.write(b'LOGITS' + np.ascontiguousarray(p.logits, dtype=np.float32).tobytes().hex().encode())\n")
    outs = {}
    for mem in ("off", str(BUDGET)):
        r = run([sys.executable, "-c", code], timeout=300, extra_env={"VIS_MOE_MEM": mem, "VIS_MOE_CONFIGURE": "off"})
        assert r.returncode == 0, r.stderr[-3000:]
        outs[mem] = r.stdout
    m = re.search(r"SLOTS (\d+) ENC (\d+) AFTER None", outs[str(BUDGET)])
    enc = native.encoder_estimate(vlm["mmproj"], IMAGE_TOKENS, warmup=False)
    want = _plan(vlm["model"], "--mmproj", vlm["mmproj"], "--image-max-tokens", str(IMAGE_TOKENS),
                 "--no-warmup")                                 # the Session does not warm the encoder up
    assert want["plan"]["n_slots"] < BIG.n_expert_used
    assert m and int(m.group(1)) == max(_planned(want))         # the stats of all layers: the most slots of one and int(m.group(2)) == enc["total_bytes"], outs[str(BUDGET)][:300]
    assert re.search(r"SLOTS 0 ", outs["off"])
    assert outs["off"].split("LOGITS")[1] == outs[str(BUDGET)].split("LOGITS")[1]
