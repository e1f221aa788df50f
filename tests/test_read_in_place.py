"""Expert reads land in place (docs/paging.md#tier-3-the-gguf-file): an O_DIRECT read puts a slice's whole 4 KiB
pages of the file straight into its slot, which the slabs' placement makes 4 KiB-aligned at the same offset within a
page as in the file; only the partial pages at both ends pass through the I/O thread's bounce buffer.  It must read
exactly the expert's bytes: logits byte-identical to upstream's with every expert resident, on files whose tensor
offsets are and are not page-aligned and whose slices are and are not whole pages, while the bytes copied out of the
bounce buffers show which path ran."""
from __future__ import annotations

import numpy as np
import pytest

from pyvis import fixtures as fx
from pyvis import moe
from conftest import greedy_logits

PROMPT = "Reading an expert straight into its slot must not change a single bit of the logits."
PAGE = 4096


def _spec(n_ff_exp: int, alignment: int | None) -> fx.ModelSpec:
    extra = {"alignment": alignment} if alignment else {}
    return fx.ModelSpec(name=f"inplace-{n_ff_exp}-{alignment or 32}", arch="qwen3moe", n_layer=2, n_embd=256,
                        n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_ff_exp=n_ff_exp, n_expert=16, n_expert_used=4,
                        expert_type="Q8_0", weight_type="Q8_0", embd_type="Q8_0", extra=extra)


# (n_ff_exp, file alignment): 512 gives Q8_0 slices of 256 x 512 = 34 whole pages, 384 gives 25.5 pages
CASES = {"pages-unaligned-offsets": (512, None), "pages-aligned-offsets": (512, 4096),
         "half-pages-aligned-file": (384, 4096), "half-pages-unaligned": (384, None)}


def _model(fixture_dir, case: str):
    """The case's fixture (written once) and the bytes of one expert slice (256 x n_ff_exp Q8_0)."""
    n_ff_exp, alignment = CASES[case]
    spec = _spec(n_ff_exp, alignment)
    path = fixture_dir / f"{spec.name}-{spec.key()}.gguf"
    if not path.exists():
        fx.write_model(spec, path, fast_quant=True)
    return spec, path, 256 * n_ff_exp // 32 * 34


@pytest.mark.parametrize("case", list(CASES))
def test_reads_in_place_are_byte_identical(fixture_dir, case):
    _, alignment = CASES[case]
    spec, path, slice_bytes = _model(fixture_dir, case)
    ref = greedy_logits(path, PROMPT, 4)[0]
    logits, llm = greedy_logits(path, PROMPT, 4, slots=spec.n_expert_used)   # top-k slots: decode misses
    io = moe.io_stats(llm)
    del llm
    assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32)), case
    assert io["file_reads"] > 0 and io["bytes_read"] == io["file_reads"] * 3 * slice_bytes, io
    if not io["direct_io"]:
        pytest.skip("this filesystem refuses O_DIRECT: reads are buffered, straight into the slot, with no bounce")
    copied = io["bytes_copied"]
    n_slices = io["file_reads"] * 3
    if alignment == PAGE and slice_bytes % PAGE == 0:
        assert copied == 0, io                                   # every page of every slice read into its slot
    elif slice_bytes % PAGE == 0:
        assert copied == n_slices * PAGE, io                     # one partial page at each end: 4 KiB per slice
    else:
        # slots 104448 bytes apart, not whole pages: a slot is at the file's offset within a page only every other
        # expert, so some slices are read in place (a partial page or two copied) and the others through the bounce
        assert 0 < copied < io["bytes_read"], io


def test_staged_streaming_reads_in_place(fixture_dir, monkeypatch):
    """Staged prefill streaming (src/features/vis-moe-stage.h) places each staging tensor at its file tensor's offset
    within a page, as the slabs are: on a file whose tensor offsets are not page-aligned a staged expert's whole
    pages are read into the block and only its two partial end pages bounce (before stop 38 every staged byte was
    read into a bounce buffer and copied: 48-layer model at 12.5 %, 7 GB of 70).  Logits stay upstream's."""
    spec, path, slice_bytes = _model(fixture_dir, "pages-unaligned-offsets")
    ref = greedy_logits(path, PROMPT, 4)[0]
    monkeypatch.setenv("VIS_MOE_STREAM_PASSES", "1")      # every prefill ubatch streams, staged in the slabs
    logits, llm = greedy_logits(path, PROMPT, 4, slots=2 * spec.n_expert_used)
    io = moe.io_stats(llm)
    del llm
    assert np.array_equal(logits.view(np.uint32), ref.view(np.uint32))
    assert io["streamed"] > 0 and io["bytes_streamed"] > 0, io
    if not io["direct_io"]:
        pytest.skip("this filesystem refuses O_DIRECT: reads are buffered, straight into the slot, with no bounce")
    n_slices = io["bytes_read"] // slice_bytes              # demand reads and staged ones (bytes_streamed)
    assert io["bytes_copied"] == n_slices * PAGE, io   # demand and staged reads alike: one partial page at each end
