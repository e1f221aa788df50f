"""Reads overlapped with compute in decode (VIS_MOE_OVERLAP, docs/paging.md#reads-overlapped-with-compute-in-decode).

A decode step's misses are read in the background from pass 0 on, while the layer's resident experts compute, and
each miss runs in a miss pass of its own.  It must change nothing but time: logits byte-identical to upstream's, the
same misses and bytes read as without it; and it must really overlap: the reads are issued before the hits compute
(none late) and read time passed while the layer computed.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from pyvis import moe
from pyvis import fixtures as fx
from pyvis.runtime import trace as vtrace
from conftest import greedy_logits, run

PROMPT = "Reading a miss while the resident experts compute must not change a single bit."
N_DECODE = 5


def _run(path, **kw):
    return greedy_logits(path, PROMPT, N_DECODE, **kw)


@pytest.mark.parametrize("name", ["qwen3moe", "deepseek2", "gptoss"])
def test_overlap_is_byte_identical_reads_the_same_and_overlaps(fixture_dir, name):
    path = fixture_dir / f"{name}.gguf"
    ref = _run(path)[0]
    k = fx.FIXTURES[name]().n_expert_used
    overlapped = 0
    for slots in (k, k + 2):
        seen = {}
        for ov in ("off", "on", 2):
            logits, llm = _run(path, slots=slots, overlap=ov)
            where = f"{name} slots={slots} overlap={ov}"
            assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32)), where
            st, io, o = moe.stats(llm), moe.io_stats(llm), moe.overlap_stats(llm)
            # the same cache behaviour: misses, tiers, bytes read and the (slot-bound) passes
            seen[ov] = (st.n_hits, st.n_misses, st.n_passes, io["file_reads"], io["host_hits"], io["bytes_read"])
            if ov == "off":
                assert o == dict(o, max_passes=0, n_ubatches=0, n_reads=0, n_passes=0, hidden_us=0), where
            else:
                want = k if ov == "on" else 2
                assert o["max_passes"] == want, where
                assert o["n_ubatches"] == N_DECODE * _managed(llm), where     # every decode step of every layer
                assert o["n_passes"] == o["n_ubatches"] * want, where         # its miss passes ran
                assert o["n_late"] == 0, where                               # issued before the hits computed
                if o["n_reads"] > 0:
                    assert o["hidden_us"] > 0, where                          # read time passed during compute
                    overlapped += 1
            del llm
        assert seen["on"] == seen["off"] == seen[2], (name, slots, seen)
    assert overlapped > 0, name                                               # decode did read misses


def _managed(llm) -> int:
    from pyvis.runtime import native
    return native.moe_n_managed(llm)


def test_a_failed_overlapped_read_is_a_clear_error(fixture_dir, tmp_path):
    """An expert first needed in a decode step is read by the overlap path: its read error fails that decode with the
    message naming the expert, tensor and file, as a demand read's does."""
    path = fixture_dir / "qwen3moe.gguf"
    k = fx.FIXTURES["qwen3moe"]().n_expert_used
    tr = tmp_path / "x.trace"
    llm = moe.load(path, moe.MoeConfig(slots=k, trace=str(tr)), n_ctx=64, n_threads=2, verbose=False)
    toks = llm.tokenize(b"x y z", add_bos=True)
    llm.eval(toks)
    for _ in range(3):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    del llm
    t = vtrace.read(tr)
    lt = t.for_layer(1)
    prompt = set(lt.ids[lt.phase == 0].ravel().tolist())
    later = [int(e) for e in lt.ids[lt.phase == 1].ravel() if int(e) not in prompt]
    assert later, "no expert first routed in decode at layer 1"
    e = later[0]
    code = (
        "import numpy as np\nfrom pyvis import moe\n"
        f"llm = moe.load({str(path)!r}, moe.MoeConfig(slots={k}, overlap='on'), n_ctx=64, n_threads=2, verbose=False)\n"
        "llm.eval(llm.tokenize(b'x y z', add_bos=True))\n"
        "print('PROMPT OK', flush=True)\n"
        "try:\n"
        "    for _ in range(3):\n"
        "        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])\n"
        "except Exception as e:\n"
        "    from pyvis.runtime import native as _native\n"
        "    print('RAISED', _native.last_error())\n"
        "    print('OVERLAP', moe.overlap_stats(llm))\n"
    )
    r = run([sys.executable, "-c", code], timeout=120, extra_env={"VIS_MOE_FAULT_READ": f"1:{e}"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PROMPT OK" in r.stdout and "RAISED" in r.stdout, (e, r.stdout, r.stderr[-2000:])
    assert f"failed to read expert {e} of tensor blk.1.ffn_" in r.stdout and "Input/output error" in r.stdout, r.stdout
    assert "'n_ubatches': 0" not in r.stdout, r.stdout                      # the failing step was an overlapped one


def test_overlap_knob_is_parsed_strictly(bindir, fixture_dir):
    for bad in ("maybe", "0.5", "-1", "65"):
        r = run([bindir / "llama-cli", "-m", fixture_dir / "qwen3moe.gguf", "--moe-slots", "8", "-p", "hi", "-n", "1",
                 "-st", "-c", "64"], timeout=60, extra_env={"VIS_MOE_OVERLAP": bad})
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "VIS_MOE_OVERLAP" in out and f"got '{bad}'" in out, (bad, out[-1500:])
