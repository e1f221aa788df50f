"""Upstream's --fit probe (llama-cli's default: a model and context made with no_alloc, to measure memory) allocates
no slabs: the attach gives them a dummy buffer, as upstream gives its weights and KV cache.  Before stop 39 it
allocated the slabs, zeroed and locked them, then freed them; with --moe-slots that churned the slabs' size through
memory before the real load, and the run after it read and computed 1.3x slower (docs/benchmarks.md#stop-39).
"""
from __future__ import annotations

import sys

from conftest import run

PROBE = r"""
import sys
from pyvis import moe
from pyvis.runtime import native  # first: points llama_cpp at our libraries
import llama_cpp

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

with moe.applied(moe.MoeConfig(slots=int(sys.argv[2]), mem=4000, host_mib=int(sys.argv[3]))):
    mp = llama_cpp.llama_model_default_params()
    mp.no_alloc = True
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE   # as common/fit.cpp makes its probe
    model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), mp)
    assert model, "model"
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads = 256, 256, 256, 2
    before = hwm()
    ctx = llama_cpp.llama_init_from_model(model, cp)
    assert ctx, "context"
    grew = hwm() - before
    print("SLOTS", native.moe_n_managed(ctx), "GREW", grew)
"""


def test_the_fit_probe_allocates_no_slabs(medium_model):
    """--moe-slots 100 on the medium fixture (4 managed layers x 0.8 MiB experts: 320 MiB of slabs) and a 64 MiB host
    cache: making the probe's context grows the peak RSS by far less than one slab (the compute buffers are dummies
    too), and the probe still manages every MoE layer (the scheduler sees the slab tensors)."""
    r = run([sys.executable, "-c", PROBE, str(medium_model), "100", "64"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("SLOTS")]
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    _, managed, _, grew = line[-1].split()
    assert int(managed) == 4
    assert int(grew) < 40 << 20, f"the probe's context grew the peak RSS by {int(grew) >> 20} MiB"
