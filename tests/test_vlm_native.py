"""Native support for visual-token pruning (issue #4, docs/vlm-native-api.md):

* encoder saliency from libmtmd (patch 0010, src/vlm/vis-mtmd-saliency.cpp): off = the encoder
  graph is upstream's, node for node; on = one score per image output token, checked
  against the attention matrix read from the graph itself;
* layer limit + routing capture (patch 0011, src/vlm/vis-moe-capture.cpp): the routes of the
  first L layers equal those of a full decode, and a full decode after a limited one gives
  byte-identical logits once the probe's KV is removed.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyvis.fixtures import mmproj as mm
from pyvis.runtime import native as nv
from pyvis.testbed import _llm
from pyvis import fixtures as fx

from llama_cpp import llama_cpp as L  # noqa: E402  (pyvis configured the library paths)
from llama_cpp import mtmd_cpp as M  # noqa: E402
from llama_cpp import _internals as I  # noqa: E402

FA_DISABLED, FA_ENABLED = 0, 1
MERGE = 4  # the fixture's Qwen3-VL projector merges 2x2 patches into one token

_base = _llm._ggml_base()
_base.ggml_op_desc.argtypes = [ctypes.c_void_p]
_base.ggml_op_desc.restype = ctypes.c_char_p


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_model(fixture_dir):
    model = I.LlamaModel(path_model=str(fixture_dir / "qwen3vlmoe.gguf"), params=L.llama_model_default_params(),
                         verbose=False)
    yield model
    model.close()


class Mtmd:
    """An mtmd context on the fixture's mmproj, optionally recording the encoder graph (cb_eval)."""

    def __init__(self, model, fixture_dir, fa: int, record: bool = False):
        self.nodes: list[tuple[str, str]] = []   # (op, name) of every computed encoder node
        self.softmax: list[np.ndarray] = []      # outputs of the SOFT_MAX nodes, in graph order
        mcp = M.mtmd_context_params_default()
        mcp.n_threads = 2
        mcp.warmup = False
        mcp.print_timings = False
        mcp.flash_attn_type = fa
        self._cb = None
        if record:
            def cb(t, ask, _ud):
                if ask:
                    return True
                op = (_base.ggml_op_desc(t) or b"").decode()
                self.nodes.append((op, _llm.tensor_name(t)))
                if op == "SOFT_MAX":
                    tt = ctypes.cast(t, ctypes.POINTER(_llm.ggml_tensor)).contents
                    self.softmax.append(_llm.read_tensor(t).reshape(tt.ne[2], tt.ne[1], tt.ne[0]))
                return True
            self._cb = L.ggml_backend_sched_eval_callback(cb)
            mcp.cb_eval = self._cb
        self.ptr = M.mtmd_init_from_file(str(fixture_dir / "qwen3vlmoe-mmproj.gguf").encode(), model.model, mcp)
        assert self.ptr
        self.n_embd = L.llama_model_n_embd_inp(model.model)
        self.chunks = None

    def tokenize(self, image, prompt: str = "Describe <__media__> briefly."):
        bm = M.mtmd_helper_bitmap_init_from_file(self.ptr, str(image).encode(), False)
        assert bm
        self.chunks = M.mtmd_input_chunks_init()
        t = M.mtmd_input_text()
        b = prompt.encode()
        t.text, t.text_len, t.add_special, t.parse_special = b, len(b), True, True
        arr = (M.mtmd_bitmap_p_ctypes * 1)(bm)
        assert M.mtmd_tokenize(self.ptr, self.chunks, ctypes.byref(t), arr, 1) == 0
        M.mtmd_bitmap_free(bm)
        return self.chunks

    def image_chunk(self):
        for i in range(M.mtmd_input_chunks_size(self.chunks)):
            c = M.mtmd_input_chunks_get(self.chunks, i)
            if M.mtmd_input_chunk_get_type(c) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return c
        raise AssertionError("no image chunk")

    def encode(self) -> np.ndarray:
        c = self.image_chunk()
        n = M.mtmd_input_chunk_get_n_tokens(c)
        self.nodes.clear()
        self.softmax.clear()
        assert M.mtmd_encode_chunk(self.ptr, c) == 0
        return np.ctypeslib.as_array(M.mtmd_get_output_embd(self.ptr), shape=(n * self.n_embd,)).copy()

    def close(self):
        if self.chunks:
            M.mtmd_input_chunks_free(self.chunks)
        M.mtmd_free(self.ptr)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


# ---------------------------------------------------------------------------
# saliency
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("fa", [FA_ENABLED, FA_DISABLED], ids=["flash", "noflash"])
def test_saliency_off_is_upstream_graph_and_on_keeps_embeddings(vlm_model, fixture_dir, fa):
    m = Mtmd(vlm_model, fixture_dir, fa, record=True)
    try:
        m.tokenize(fixture_dir / "test-image.png")
        e_off = m.encode()
        nodes_off = list(m.nodes)
        assert nodes_off and not any(n.startswith("vis_") for _, n in nodes_off)
        with pytest.raises(nv.VisError, match="off"):
            nv.mtmd_saliency(m.ptr)

        nv.saliency_enable(m.ptr, 1)
        e_on = m.encode()
        extra = [n for _, n in m.nodes if n.startswith("vis_saliency-")]
        n_layer = len([1 for op, _ in nodes_off if op in ("SOFT_MAX", "FLASH_ATTN_EXT")])
        assert extra == [f"vis_saliency-{n_layer - 1}"]
        # the embeddings do not change when saliency is on (flash attention included)
        assert np.array_equal(_bits(e_on), _bits(e_off))

        nv.saliency_enable(m.ptr, 0)
        e_off2 = m.encode()
        assert m.nodes == nodes_off          # off again: node for node the upstream graph
        assert np.array_equal(_bits(e_off2), _bits(e_off))
    finally:
        m.close()


def test_saliency_scores_match_the_attention_matrix(vlm_model, fixture_dir):
    # without flash attention the encoder's own softmax outputs can be read: the score of token t
    # is the mean over heads, queries and t's 2x2 merged patches of the attention received
    m = Mtmd(vlm_model, fixture_dir, FA_DISABLED, record=True)
    try:
        m.tokenize(fixture_dir / "test-image.png")
        for k in (1, 2):
            nv.saliency_enable(m.ptr, k)
            m.encode()
            n_tok = M.mtmd_input_chunk_get_n_tokens(m.image_chunk())
            nx, ny = mm.expected_image_tokens(64, 48)
            assert n_tok == nx * ny
            raw = nv.mtmd_saliency(m.ptr, raw=True)
            s = nv.mtmd_saliency(m.ptr)
            assert raw.shape == s.shape == (n_tok,)
            per_layer = [a.mean(axis=(0, 1)) for a in m.softmax[-k:]]      # [n_patches] each
            ref = np.mean([p.reshape(n_tok, MERGE).mean(axis=1) for p in per_layer], axis=0)
            np.testing.assert_allclose(raw, ref, rtol=1e-5, atol=1e-7)
            assert raw.sum() * MERGE == pytest.approx(1.0, abs=1e-5)       # every query's attention sums to 1
            assert s.min() == 0.0 and s.max() == 1.0 and len(np.unique(s)) > 2
            np.testing.assert_allclose(s, (raw - raw.min()) / (raw.max() - raw.min()), rtol=1e-5, atol=1e-6)
    finally:
        m.close()


def test_saliency_is_deterministic_and_close_across_attention_paths(vlm_model, fixture_dir):
    out = {}
    for fa in (FA_ENABLED, FA_DISABLED):
        m = Mtmd(vlm_model, fixture_dir, fa)
        try:
            m.tokenize(fixture_dir / "test-image.png")
            nv.saliency_enable(m.ptr, 1)
            m.encode()
            a = nv.mtmd_saliency(m.ptr)
            m.encode()
            b = nv.mtmd_saliency(m.ptr)
            assert np.array_equal(_bits(a), _bits(b))
            assert np.all((a >= 0) & (a <= 1)) and a.std() > 0.05
            out[fa] = a
        finally:
            m.close()
    # flash attention changes the encoder's earlier layers by F16 rounding only
    np.testing.assert_allclose(out[FA_ENABLED], out[FA_DISABLED], atol=5e-3)


def test_saliency_in_query_chunks_beside_flash_attention(vlm_model, fixture_dir, monkeypatch):
    # a tiny chunk budget splits the side attention into one query per chunk: same scores
    out = []
    for budget in (None, "0.0001"):
        if budget:
            monkeypatch.setenv("VIS_MTMD_SALIENCY_CHUNK_MIB", budget)
        m = Mtmd(vlm_model, fixture_dir, FA_ENABLED, record=True)
        try:
            m.tokenize(fixture_dir / "test-image.png")
            nv.saliency_enable(m.ptr, 1)
            m.encode()
            out.append((nv.mtmd_saliency(m.ptr, raw=True), sum(op == "SOFT_MAX" for op, _ in m.nodes)))
        finally:
            m.close()
    (a, n_a), (b, n_b) = out
    n_patches = MERGE * len(a)
    assert n_a == 1 and n_b == n_patches          # one softmax per query chunk
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_saliency_process_default_and_errors(vlm_model, fixture_dir):
    with pytest.raises(nv.VisError, match="n_layers must be >= 0"):
        nv.saliency_enable(None, -1)
    m = Mtmd(vlm_model, fixture_dir, FA_ENABLED)
    try:
        with pytest.raises(nv.VisError, match="no image has been encoded"):
            nv.mtmd_saliency(m.ptr)
        m.tokenize(fixture_dir / "test-image.png")
        nv.saliency_enable(None, 1)          # process-wide default reaches a context without an override
        try:
            m.encode()
            assert len(nv.mtmd_saliency(m.ptr)) == M.mtmd_input_chunk_get_n_tokens(m.image_chunk())
            nv.saliency_enable(m.ptr, 0)     # a per-context override wins over the default
            m.encode()
            with pytest.raises(nv.VisError, match="off"):
                nv.mtmd_saliency(m.ptr)
        finally:
            nv.saliency_enable(None, 0)
    finally:
        m.close()


def test_saliency_state_belongs_to_its_context(vlm_model, fixture_dir):
    """Two live mtmd contexts: each getter reads the state its own context owns (no registry keyed by pointer)."""
    a, b = Mtmd(vlm_model, fixture_dir, FA_ENABLED), Mtmd(vlm_model, fixture_dir, FA_ENABLED)
    try:
        for m in (a, b):
            m.tokenize(fixture_dir / "test-image.png")
        nv.saliency_enable(a.ptr, 1)
        nv.saliency_enable(b.ptr, 0)
        a.encode()
        with pytest.raises(nv.VisError, match="no image has been encoded"):
            nv.mtmd_saliency(b.ptr)
        b.encode()
        assert len(nv.mtmd_saliency(a.ptr)) == M.mtmd_input_chunk_get_n_tokens(a.image_chunk())
        with pytest.raises(nv.VisError, match="off"):
            nv.mtmd_saliency(b.ptr)
    finally:
        a.close()
        b.close()


_ENV_PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from test_vlm_native import I, L, Mtmd, nv, FA_ENABLED
d = Path(sys.argv[2])
model = I.LlamaModel(path_model=str(d / "qwen3vlmoe.gguf"), params=L.llama_model_default_params(), verbose=False)
m = Mtmd(model, d, FA_ENABLED)
m.tokenize(d / "test-image.png")
out = {}
for value in sys.argv[3:]:        # an invalid value is not kept: the next one is read at the next encode
    os.environ["VIS_MTMD_SALIENCY"] = value
    m.encode()
    try:
        out[value] = len(nv.mtmd_saliency(m.ptr))
    except nv.VisError as e:
        out[value] = str(e)
m.close()
print(json.dumps(out))
"""


def test_saliency_variable_is_parsed_strictly(fixture_dir):
    """VIS_MTMD_SALIENCY sets the default layer count; a value that is not a plain non-negative integer (atoi
    read "1x" as 1 and "x" as off) is an error naming the variable, reported where the scores are asked for."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    bad = ["1x", "-1", "x", " 1", "99999999999"]
    r = subprocess.run([sys.executable, "-c", _ENV_PROBE, str(Path(__file__).parent), str(fixture_dir), *bad, "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for v in bad:
        assert isinstance(out[v], str) and "VIS_MTMD_SALIENCY: expected an integer >= 0" in out[v], out[v]
        assert f"got '{v}'" in out[v], out[v]
    assert out["1"] > 0          # a valid value after them is read and gives one score per image token


# ---------------------------------------------------------------------------
# layer limit and routing capture
# ---------------------------------------------------------------------------
class Ctx:
    def __init__(self, model, n_ubatch: int = 512):
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, n_ubatch
        cp.n_threads = cp.n_threads_batch = 2
        self.ctx = I.LlamaContext(model=model, params=cp, verbose=False)
        self.ptr = self.ctx.ctx
        self.mem = L.llama_get_memory(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model.model))

    def decode_tokens(self, tokens, p0: int = 0):
        b = L.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = t, p0 + i, 1, 0
            b.logits[i] = i == len(tokens) - 1
        b.n_tokens = len(tokens)
        try:
            assert L.llama_decode(self.ptr, b) == 0
        finally:
            L.llama_batch_free(b)

    def logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(L.llama_get_logits_ith(self.ptr, -1), shape=(self.n_vocab,)).copy()

    def close(self):
        self.ctx.close()


def _routes(ctx, n_layer):
    return [nv.moe_routes(ctx.ptr, il) for il in range(n_layer)]


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3vlmoe", "deepseek2", "gptoss", "mixtral"])
def test_layer_limit_routes_equal_full_decode_and_state_is_dropped(fixture_dir, name):
    model = I.LlamaModel(path_model=str(fixture_dir / f"{name}.gguf"), params=L.llama_model_default_params(),
                         verbose=False)
    c = Ctx(model, n_ubatch=32)   # 70 tokens: three ubatches
    try:
        info = nv.moe_info(model.model)
        toks = [int(t) for t in np.random.default_rng(0).integers(100, 4000, size=70)]
        nv.moe_capture(c.ptr, True)
        c.decode_tokens(toks)
        ref_logits = c.logits()
        full = _routes(c, info.n_layer)
        L.llama_memory_clear(c.mem, True)
        for lim in range(1, info.n_layer + 1):
            nv.moe_capture_reset(c.ptr)
            with nv.layer_limit(c.ptr, lim):
                assert nv.get_layer_limit(c.ptr) == lim
                c.decode_tokens(toks)
            assert nv.get_layer_limit(c.ptr) == 0
            got = _routes(c, info.n_layer)
            for il in range(info.n_layer):
                if il >= lim or full[il].shape[0] == 0:      # not evaluated, or a dense layer
                    assert got[il].shape[0] == 0, (il, lim)
                elif full[il].shape[0] == len(toks):
                    assert np.array_equal(got[il], full[il]), (il, lim)
                else:                                         # upstream's last layer routes the output row only
                    assert got[il].shape[0] == len(toks) and np.array_equal(got[il][-1:], full[il])
            # the probe's KV is dropped; the full decode is then exactly a fresh one
            assert L.llama_memory_seq_pos_max(c.mem, 0) == len(toks) - 1
            assert L.llama_memory_seq_rm(c.mem, 0, 0, -1)
            nv.moe_capture_reset(c.ptr)
            c.decode_tokens(toks)
            assert np.array_equal(_bits(c.logits()), _bits(ref_logits)), lim
            assert all(np.array_equal(a, b) for a, b in zip(_routes(c, info.n_layer), full))
            L.llama_memory_clear(c.mem, True)
        nv.moe_capture(c.ptr, False)
        with pytest.raises(nv.VisError, match="capture is off"):
            nv.moe_routes(c.ptr, 0)
    finally:
        c.close()
        model.close()


def test_layer_limit_on_image_tokens_through_mtmd(vlm_model, fixture_dir):
    """The prefix probe over an image prompt decoded by upstream's helper (M-RoPE positions)."""
    c = Ctx(vlm_model)
    m = Mtmd(vlm_model, fixture_dir, FA_ENABLED)
    try:
        chunks = m.tokenize(fixture_dir / "test-image.png")
        info = nv.moe_info(vlm_model.model)
        n_tok = int(M.mtmd_helper_get_n_tokens(chunks))
        n_past = ctypes.c_int32(0)

        def run():
            assert M.mtmd_helper_eval_chunks(m.ptr, c.ptr, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0

        nv.moe_capture(c.ptr, True)
        run()
        ref_logits, full = c.logits(), _routes(c, info.n_layer)
        assert full[0].shape[0] == n_tok
        L.llama_memory_clear(c.mem, True)
        nv.moe_capture_reset(c.ptr)
        with nv.layer_limit(c.ptr, 2):
            run()
        got = _routes(c, info.n_layer)
        assert np.array_equal(got[0], full[0]) and np.array_equal(got[1], full[1]) and got[2].shape[0] == 0
        assert L.llama_memory_seq_rm(c.mem, 0, 0, -1)
        run()
        assert np.array_equal(_bits(c.logits()), _bits(ref_logits))
    finally:
        m.close()
        c.close()


def test_layer_limit_and_capture_errors(fixture_dir, vlm_model):
    c = Ctx(vlm_model)
    try:
        n_layer = nv.moe_info(vlm_model.model).n_layer
        for bad in (-1, n_layer + 1):
            with pytest.raises(nv.VisError, match=rf"n_layers must be in 0\.\.{n_layer}.*got {bad}"):
                nv.set_layer_limit(c.ptr, bad)
        assert nv.get_layer_limit(c.ptr) == 0
        with pytest.raises(nv.VisError, match="capture is off"):
            nv.moe_routes(c.ptr, 0)
        nv.moe_capture(c.ptr, True)
        with pytest.raises(nv.VisError, match="out of range"):
            nv.moe_routes(c.ptr, n_layer)
        assert nv.moe_routes(c.ptr, 0).shape == (0, 0)   # nothing decoded yet
    finally:
        c.close()
    from pyvis import assets
    dense = I.LlamaModel(path_model=str(assets.smollm2_gguf()), params=L.llama_model_default_params(), verbose=False)
    d = Ctx(dense)
    try:
        with pytest.raises(nv.VisError, match="no routed experts"):
            nv.moe_capture(d.ptr, True)
    finally:
        d.close()
        dense.close()
