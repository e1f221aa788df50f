"""Shared pytest fixtures: the native build, the generated MoE models."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import pyvis  # noqa: F401  (points llama_cpp at our build before anything imports it)
from pyvis import _paths
from pyvis import fixtures as fx

ROOT = Path(__file__).resolve().parent.parent
TEXT_FIXTURES = ["qwen3moe", "deepseek2", "gptoss", "mixtral", "qwen3vlmoe"]


LOGITS_KW = dict(n_ctx=256, n_batch=512, n_ubatch=512, logits_all=True, n_threads=2, verbose=False, seed=1)


def greedy_logits(path, prompt: str, n_decode: int, **moe_kw):
    """Logits of a prompt and n_decode greedy steps, and the Llama: through pyvis.moe.load with a MoeConfig of these
    fields, or upstream's path without any."""
    import numpy as np
    from pyvis import moe
    from pyvis.runtime import native
    llm = moe.load(path, moe.MoeConfig(**moe_kw),
                   **LOGITS_KW) if moe_kw else native.llama_cpp.Llama(str(path), **LOGITS_KW)
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
    for _ in range(n_decode):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return np.array(llm.scores[: llm.n_tokens], copy=True), llm


def later_hits(t, outcome: int) -> tuple[int, int]:
    """For each (layer, step, expert) whose pairs got `outcome` in a --moe-trace (substituted away, dropped): does the
    layer's next step that routes that expert find it resident (every pair outcome 0)?  (hits, misses)"""
    import numpy as np
    hits = misses = 0
    for il in np.unique(t.layer):
        lt = t.for_layer(int(il))
        ubs = np.unique(lt.ubatch)
        for i, u in enumerate(ubs):
            rows = lt.ubatch == u
            for e in np.unique(lt.ids[rows][lt.outcome[rows] == outcome]):
                later = next((v for v in ubs[i + 1:] if (lt.ids[lt.ubatch == v] == e).any()), None)
                if later is None:
                    continue
                m = lt.ids[lt.ubatch == later] == e
                if (lt.outcome[lt.ubatch == later][m] == 0).all():
                    hits += 1
                else:
                    misses += 1
    return hits, misses


@pytest.fixture(scope="session")
def bindir() -> Path:
    return _paths.lib_dir()


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    fx.ensure_all()
    return fx.default_dir()


@pytest.fixture(scope="session", params=TEXT_FIXTURES)
def text_model(request, fixture_dir) -> Path:
    return fixture_dir / f"{request.param}.gguf"


def run(cmd: list, timeout: float = 120, extra_env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a command with a hard timeout; never hangs the suite. Output is decoded losslessly: a random-weights model
    may print half of a multi-byte character, which surrogateescape keeps as its raw byte (two outputs compare equal
    only if their bytes do)."""
    env = dict(os.environ)
    env.setdefault("LLAMA_LOG_COLORS", "0")
    env.update(extra_env or {})
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env, **{"errors": "surrogateescape", **kw})


@contextlib.contextmanager
def llama_server(bindir, model, *extra, log=None, env: dict | None = None, wrap=None):
    """A llama-server for ``model`` on a free 127.0.0.1 port, healthy within 60 s: yields (process, port); stopped
    (terminate, then kill) on exit.  ``log``: a path for its output (default: discarded); ``wrap``: a function of
    the command line (a memory cgroup's, test_paging.memory_cgroup)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = open(log, "w") if log else subprocess.DEVNULL
    cmd = [str(bindir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           *[str(x) for x in extra]]
    proc = subprocess.Popen(wrap(cmd) if wrap else cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "LLAMA_LOG_COLORS": "0", **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as h:
                    if h.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, open(log).read()[-3000:] if log else "server exited"
            assert time.monotonic() < deadline, "server did not become healthy in 60 s"
            time.sleep(0.3)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        if log:
            out.close()


MEDIUM = fx.ModelSpec(name="paging-medium", arch="qwen3moe", n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
                      n_ff=1024, n_ff_exp=512, n_expert=128, n_expert_used=4, expert_type="Q8_0", weight_type="Q8_0",
                      embd_type="Q8_0")


@pytest.fixture(scope="session")
def medium_model(fixture_dir) -> Path:
    """qwen3moe with 4 x 128 experts of 0.8 MiB: ~430 MiB, almost all of it routed experts."""
    path = fixture_dir / f"paging-medium-{MEDIUM.key()}.gguf"
    if not path.exists():
        fx.write_model(MEDIUM, path, fast_quant=True)
    return path


def paging_configs(spec) -> list[dict]:
    """The cache paths every model file must run byte-identically on (tests/test_paging.py, tests/test_model_files.py):
    the file tier with and without a host tier, buffered and direct reads, the staging path, passes below top-k."""
    k = spec.n_expert_used
    return [
        dict(slots=k, pinned_layers=1),                        # only the pinned prefix and top-k slots fit
        dict(slots=k, host_mib=1),                             # tier 2 between slabs and file
        dict(slots=min(2 * k, spec.n_expert - 1), direct_io="off", io_threads=1),  # buffered reads, one thread
        dict(slots=k, unified="off", host_mib=1),              # staging path + inclusive host cache
        dict(slots=spec.n_expert - 1, io_threads=8),
        dict(slots=1, pinned_layers=1),                        # the pinned prefix and one slot per layer: k passes a step
        dict(slots=k - 1, host_mib=1),                         # below top-k, with a host tier
    ]


def rewrite_gguf(src: Path, dst: Path, add: dict | None = None, split_max_tensors: int = 0) -> None:
    """`src` written again by gguf-py's writer: every key and tensor, then the tensors of `add` (name -> array);
    with `split_max_tensors`, as llama-gguf-split --split-max-tensors N writes it (the first shard holds every key,
    each shard split.no / split.count / split.tensors.count)."""
    import gguf
    import numpy as np
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents(), split_max_tensors=split_max_tensors)
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                            else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=gguf.GGMLQuantizationType(int(t.tensor_type)))
    for name, a in (add or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_split(src: Path, out_dir: Path, max_tensors: int) -> list[Path]:
    """`src` as llama-gguf-split --split-max-tensors N writes it; returns the shards in order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rewrite_gguf(src, out_dir / "m.gguf", split_max_tensors=max_tensors)
    return sorted(out_dir.glob("m-*-of-*.gguf"))


def lowlevel_greedy(path, prompt: bytes, n_decode: int, extra_bufts: bool = True, settings=None):
    """Logits of every prompt token and of `n_decode` greedy steps through the low-level API (llama_cpp.Llama cannot
    turn CPU repacking off: `extra_bufts` is the model's use_extra_bufts), with `settings` (a context manager, e.g.
    pyvis' applied(...)) around the load; and the cache's (stats, io stats), None when no cache ran."""
    import numpy as np
    import llama_cpp as L
    from pyvis import moe
    from pyvis.runtime import native as _native
    with settings or contextlib.nullcontext():
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 128, 128, 128, 2, 2
        ctx = L.llama_init_from_model(model, cp) if model else None
    assert model and ctx, _native.last_error()
    vocab = L.llama_model_get_vocab(model)
    nv = L.llama_vocab_n_tokens(vocab)
    toks = (L.llama_token * 64)()
    n = L.llama_tokenize(vocab, prompt, len(prompt), toks, 64, True, False)
    b = L.llama_batch_init(64, 0, 1)
    rows = []
    try:
        step = [toks[i] for i in range(n)]
        for pos0 in [0] + [n + j for j in range(n_decode)]:
            for i, t in enumerate(step):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, 1
                b.seq_id[i][0] = 0
            b.n_tokens = len(step)
            assert L.llama_decode(ctx, b) == 0, _native.last_error()
            rows += [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (nv,)).copy() for i in range(len(step))]
            step = [int(np.argmax(rows[-1]))]
        st = moe.stats(ctx)
        return np.array(rows), ((st, moe.io_stats(ctx)) if st is not None else None)
    finally:
        L.llama_batch_free(b)
        L.llama_free(ctx)
        L.llama_model_free(model)


def vis_header_text() -> str:
    """The public C API as one text: src/api/llama-vis.h and the section headers it includes, in its order."""
    api = Path(__file__).resolve().parent.parent / "src" / "api"
    umbrella = (api / "llama-vis.h").read_text()
    return umbrella + "".join((api / name).read_text() for name in re.findall(r'#include "(llama-vis-\w+\.h)"', umbrella))
