"""Substitution on a miss, the Python half (issue #13): the buddy profile format and its fingerprint, the calibration
(co-activation, CFT lists, TAE percentiles) against hand computations, the SUB1 trace records, `pyvis calibrate
buddies` end to end and the buddy graph picture.  Tiny GGUFs and traces are written here; only the --corpus test
and the C router hash need the native build."""
from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest

import gguf
from pyvis.calibrate import buddies as bd
from pyvis.runtime import profile as prof
from pyvis.runtime import trace as vtrace
from pyvis.runtime.trace import Trace, TraceError

from conftest import vis_header_text

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "models" / "fixtures" / "qwen3moe.gguf"      # 3 layers x 32 experts, top-8
MASK = (1 << 64) - 1


# --------------------------------------------------------------------------
# helpers: tiny GGUFs and binary traces written by hand
# --------------------------------------------------------------------------
def tiny_model(path: Path, routers: dict, arch: str = "qwen3moe", n_layer: int = 2, n_expert: int = 4,
               k: int = 2, extra: dict | None = None) -> Path:
    """A GGUF with only the keys and tensors the fingerprint reads; tensors in the order given."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.expert_count", n_expert)
    w.add_uint32(f"{arch}.expert_used_count", k)
    for name, a in {**{f"blk.{il}.ffn_gate_inp.weight": a for il, a in routers.items()}, **(extra or {})}.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def router(n_expert: int = 4, n_embd: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_expert, n_embd)).astype(np.float32)


def trace_bytes(n_layer: int, n_expert: int, k: int, records: list) -> bytes:
    """records: ("REC1", ub, il, ids [n,k], weights [n,k][, modality: 0 text (default), 1 image]) or
    ("SUB1", ub, il, exec [n,k], outcome [n,k])."""
    out = [b"VISTRACE", struct.pack("<4I", 1, n_layer, n_expert, k)]
    for kind, ub, il, a, b, *mod in records:
        a = np.asarray(a, np.int32)
        n, kk = a.shape
        if kind == "REC1":
            out += [struct.pack("<5i", vtrace.REC_TAG, ub, il, n, kk), np.zeros(n, np.int32).tobytes(),
                    np.arange(n, dtype=np.int32).tobytes(), np.full(n, mod[0] if mod else 0, np.uint8).tobytes(),
                    a.tobytes(),
                    np.asarray(b, np.float32).tobytes()]
        else:
            out += [struct.pack("<5i", vtrace.SUB_TAG, ub, il, n, kk), a.tobytes(), np.asarray(b, np.uint8).tobytes()]
    return b"".join(out)


def synthetic(ids: np.ndarray, n_expert: int, weights=None, layers=None) -> Trace:
    """Trace.from_routes with gate weights (from_routes alone has none)."""
    t = Trace.from_routes(ids, n_expert, layers)
    if weights is not None:
        t.weights = np.asarray(weights, np.float32).reshape(t.ids.shape)
    return t


# --------------------------------------------------------------------------
# calibration maths against hand computations
# --------------------------------------------------------------------------
ROWS = [[0, 1], [0, 1], [0, 2], [1, 3], [0, 1]]     # E = 5: expert 4 never routed


def test_coactivation_counts_by_hand():
    C, A = bd.coactivation(np.array(ROWS), 5)
    assert A.tolist() == [4, 4, 1, 1, 0]
    want = np.zeros((5, 5), int)
    for i, j, c in [(0, 1, 3), (0, 2, 1), (1, 3, 1)]:
        want[i, j] = want[j, i] = c
    assert np.array_equal(C, want)


def test_cft_lists_and_q_without_smoothing():
    t = synthetic(np.array([ROWS]), 5)
    # q(.|0) = (0, 3/4, 1/4, 0, 0); q(.|1) = (3/4, 0, 0, 1/4, 0); q(.|2) = (1, 0, ...); q(.|3) = (0, 1, 0, ...)
    f = bd.fit([t], n_layer=1, n_expert=5, alpha=0.7, k_max=3, smoothing=0.0)
    assert f.ids[0].tolist() == [[1, -1, -1], [0, -1, -1], [0, -1, -1], [1, -1, -1], [-1, -1, -1]]
    assert np.allclose(f.q[0, :4, 0], [0.75, 0.75, 1.0, 1.0]) and (f.q[0, :, 1:] == 0).all()
    f = bd.fit([t], n_layer=1, n_expert=5, alpha=0.75, k_max=3, smoothing=0.0)
    assert f.ids[0, 0].tolist() == [1, -1, -1]                # cumulative q >= alpha: reaching it exactly is enough
    f = bd.fit([t], n_layer=1, n_expert=5, alpha=0.8, k_max=3, smoothing=0.0)
    assert f.ids[0, 0].tolist() == [1, 2, -1] and np.allclose(f.q[0, 0], [0.75, 0.25, 0])
    assert f.ids[0, 1].tolist() == [0, 3, -1]                # no zero-q peer is ever a buddy, even at alpha 1
    assert bd.fit([t], 1, 5, alpha=1.0, k_max=4, smoothing=0.0).ids[0, 0].tolist() == [1, 2, -1, -1]
    assert np.allclose(f.freq[0], [0.8, 0.8, 0.2, 0.2, 0.0]) and f.rows.tolist() == [5] and f.n_tokens == 5


def test_cft_lists_with_smoothing_and_cap():
    t = synthetic(np.array([ROWS]), 5)
    # eps = 0.5: M[0] = (0, 3.5, 1.5, 0.5, 0.5), sum 6 -> q = (0, .5833, .25, .0833, .0833)
    f = bd.fit([t], 1, 5, alpha=0.9, k_max=4, smoothing=0.5)
    assert f.ids[0, 0].tolist() == [1, 2, 3, -1]             # .5833 + .25 = .8333 < .9; + .0833 = .9167 (3 before 4)
    assert np.allclose(f.q[0, 0, :3], [3.5 / 6, 1.5 / 6, 0.5 / 6])
    assert f.ids[0, 4].tolist() == [-1] * 4                   # never seen: no buddies, smoothing or not
    f = bd.fit([t], 1, 5, alpha=0.9, k_max=2, smoothing=0.5)
    assert f.ids[0, 0].tolist() == [1, 2]                     # capped at k_max
    f = bd.fit([synthetic(np.array([[[0, 1]] * 3]), 40)], 1, 40, alpha=0.99, k_max=6, smoothing=0.5)
    assert f.ids[0, 0].tolist() == [1, 2, 3, 4, 5, 6]          # 38 peers tie at q = 0.5/22.5: the lowest ids first
    f = bd.fit([t], 1, 5, alpha=0.01, k_max=2, smoothing=0.5)
    assert ((f.ids[0, :4] >= 0).sum(1) == 1).all()            # at least one buddy for every active expert


def test_tae_and_percentiles_by_hand():
    w = np.array([[0.5, 0.5], [1.0, 0.0], [0.75, 0.25], [2.0, 2.0], [np.nan, np.nan]])
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)      # 0.811278...
    tae = bd.token_tae(w)
    assert np.allclose(tae[:4], [1.0, 0.0, h, 1.0]) and np.isnan(tae[4])
    assert bd.token_tae(np.array([[0.3], [1.0]])).tolist() == [0.0, 0.0]     # k = 1
    q = bd.tae_quantiles(tae)                                 # sorted finite values: 0, h, 1, 1 at positions 0..3
    assert q.dtype == np.float64 and q.shape == (101,)
    assert q[0] == 0.0 and q[100] == 1.0
    assert math.isclose(q[25], 0.75 * h)                      # position 0.75: 0 + 0.75 (h - 0)
    assert math.isclose(q[50], h + 0.5 * (1 - h))             # position 1.5
    assert np.isnan(bd.tae_quantiles(np.array([np.nan]))).all()
    # in a fit: per layer, NaN rows for layers without routing
    ids = np.array([[[0, 1]] * 4])
    f = bd.fit([synthetic(ids, 4, w[:4][None], layers=[1])], n_layer=3, n_expert=4)
    assert np.isnan(f.tae[0]).all() and np.isnan(f.tae[2]).all()
    assert np.allclose(f.tae[1], np.percentile([1.0, 0.0, h, 1.0], np.arange(101)))
    assert (f.ids[0] == -1).all() and (f.ids[2] == -1).all()


def test_fit_refuses_traces_of_another_model():
    t = synthetic(np.array([ROWS]), 5)
    with pytest.raises(bd.CalibrationError, match="5 experts per layer, the model has 8"):
        bd.fit([t], 1, 8)
    with pytest.raises(bd.CalibrationError, match="layer 1 is out of range"):
        bd.fit([synthetic(np.array([ROWS, ROWS]), 5)], 1, 5)
    with pytest.raises(bd.CalibrationError, match="alpha"):
        bd.fit([t], 1, 5, alpha=0.0)
    with pytest.raises(bd.CalibrationError, match="--k-max 0: must be at least 1"):
        bd.fit([t], 1, 5, k_max=0)
    f = bd.fit([t], 1, 5, alpha=1.0, k_max=6, smoothing=0.5)      # 4 peers: lists of at most 4 (the C loader wants
    assert f.k_max == 4 and f.ids.shape == (1, 5, 4)               # k_max <= n_expert)
    assert f.ids[0, 0].tolist() == [1, 2, 3, 4]


# --------------------------------------------------------------------------
# router hash and fingerprint
# --------------------------------------------------------------------------
def test_router_hash_by_hand(tmp_path):
    r0 = np.array([[1, 2]], np.uint32).view(np.float32)        # words w = (1, 2), 8 bytes
    r1 = np.array([1, 2, 3], np.int8)                          # 3 bytes: one word 0x00030201 after zero padding
    decoy = np.full((2, 2), 7.0, np.float32)
    m = tiny_model(tmp_path / "m.gguf", {1: r1, 0: r0}, extra={"blk.0.ffn_gate_inp_shexp.weight": decoy})
    t0 = 8 + (1 + 1) * 1 + (2 + 1) * 3                          # = 19
    t1 = 3 + (0x030201 + 1) * 1
    h = ((0xCBF29CE484222325 * 0x100000001B3 + t0) & MASK) * 0x100000001B3 + t1 & MASK   # layer order, not file order
    assert prof.router_hash(m) == h
    fp = prof.model_fingerprint(m)
    assert fp == {"arch": "qwen3moe", "n_layer": 2, "n_expert": 4, "n_expert_used": 2, "router_hash": h}
    # one byte of one router changes it
    data = bytearray(m.read_bytes())
    off = next(t.data_offset for t in gguf.GGUFReader(str(m)).tensors if t.name == "blk.1.ffn_gate_inp.weight")
    data[off + 2] ^= 1
    (tmp_path / "m2.gguf").write_bytes(bytes(data))
    assert prof.router_hash(tmp_path / "m2.gguf") != h


def _slow_hash(path: Path) -> int:
    """The formula with Python integers, one word at a time."""
    r = gguf.GGUFReader(str(path))
    ts = sorted((int(t.name.split(".")[1]), t) for t in r.tensors if re.fullmatch(r"blk\.\d+\.ffn_gate_inp\.weight",
                                                                                   t.name))
    h = 0xCBF29CE484222325
    for _, t in ts:
        b = bytes(r.data[t.data_offset: t.data_offset + t.n_bytes])
        b += bytes(-len(b) % 4)
        s = t.n_bytes
        for i in range(len(b) // 4):
            s += (int.from_bytes(b[4 * i: 4 * i + 4], "little") + 1) * (2 * i + 1)
        h = (h * 0x100000001B3 + s) & MASK
    return h


def test_router_hash_of_the_fixture_matches_the_formula():
    assert prof.router_hash(FIXTURE) == _slow_hash(FIXTURE)


def test_router_hash_refuses_a_model_without_routers(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "dense.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(prof.ProfileError, match="no router tensors"):
        prof.router_hash(tmp_path / "dense.gguf")


def test_c_router_hash_equals_python():
    """llama_vis_moe_router_hash (C) on the fixture == pyvis.runtime.profile.router_hash (needs the native build)."""
    import ctypes
    from pyvis.runtime import capi, native   # the build always makes them: a failure, never a skip
    llm = native.llama_cpp.Llama(str(FIXTURE), n_ctx=64, verbose=False)
    out = ctypes.c_uint64()
    rc = capi.llama_vis_moe_router_hash(native._ptr(llm, "model"), ctypes.byref(out))
    assert rc == 0 and out.value == prof.router_hash(FIXTURE)


# --------------------------------------------------------------------------
# profile file: round trip, format, errors
# --------------------------------------------------------------------------
def _arrays(L=2, E=4, kmax=3):
    ids = np.full((L, E, kmax), -1, np.int32)
    ids[1] = [[1, 2, -1], [0, -1, -1], [3, 0, 1], [2, -1, -1]]
    q = np.where(ids >= 0, 0.25, 0).astype(np.float32)
    tae = np.full((L, 101), np.nan)
    tae[1] = np.linspace(0.1, 0.9, 101)
    freq = np.zeros((L, E), np.float32)
    freq[1] = [0.5, 0.25, 0.75, 0.5]
    return ids, q, tae, freq


@pytest.fixture
def model(tmp_path):
    return tiny_model(tmp_path / "model.gguf", {0: router(seed=1), 1: router(seed=2)})


@pytest.fixture
def profile(tmp_path, model):
    ids, q, tae, freq = _arrays()
    return prof.write_buddy_profile(tmp_path / "p.gguf", prof.model_fingerprint(model), ids, q, tae, 0.9, 3, 2, 1234,
                                    "trace x sha256:00", freq=freq, smoothing=1e-3, model_path=model)


def test_round_trip_and_the_documented_layout(profile, model):
    ids, q, tae, freq = _arrays()
    p = prof.read_buddy_profile(profile, model)
    assert (p.arch, p.n_layer, p.n_expert, p.k, p.n_tokens, p.k_max, p.source) == \
        ("qwen3moe", 2, 4, 2, 1234, 3, "trace x sha256:00")
    assert p.router_hash == prof.router_hash(model) and math.isclose(p.alpha, 0.9, rel_tol=1e-6)
    assert np.array_equal(p.ids, ids) and np.array_equal(p.q, q) and np.array_equal(p.freq, freq)
    assert np.array_equal(p.tae_quantiles, tae, equal_nan=True)
    assert p.buddies(1, 2) == [3, 0, 1] and p.buddies(0, 0) == []
    # the exact keys, types and tensors of docs/substitution.md (GGUF ne is the numpy shape reversed)
    r = gguf.GGUFReader(str(profile))
    V = gguf.GGUFValueType
    types = {k: f.types[0] for k, f in r.fields.items() if k.startswith("vis.")}
    assert types == {"vis.profile.kind": V.STRING, "vis.profile.version": V.UINT32, "vis.model.arch": V.STRING,
                     "vis.model.n_layer": V.UINT32, "vis.model.n_expert": V.UINT32, "vis.model.router_hash": V.STRING,
                     "vis.profile.k": V.UINT32, "vis.profile.n_tokens": V.UINT64, "vis.profile.source": V.STRING,
                     "vis.buddy.alpha": V.FLOAT32, "vis.buddy.k_max": V.UINT32, "vis.buddy.smoothing": V.FLOAT32}
    assert r.fields["vis.model.router_hash"].contents() == f"{prof.router_hash(model):016x}"
    assert r.fields["vis.profile.kind"].contents() == "buddies" and r.fields["vis.profile.version"].contents() == 1
    Q = gguf.GGMLQuantizationType
    assert {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in r.tensors} == {
        "buddy.ids": (Q.I32, [3, 4, 2]), "buddy.q": (Q.F32, [3, 4, 2]), "tae.quantiles": (Q.F64, [101, 2]),
        "expert.freq": (Q.F32, [4, 2])}


def test_not_a_gguf_or_truncated(tmp_path, profile):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a profile at all")
    with pytest.raises(prof.ProfileError, match=rf"{re.escape(str(bad))}: not a GGUF file"):
        prof.read_buddy_profile(bad)
    data = profile.read_bytes()
    for cut in (len(data) - 100, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(prof.ProfileError, match="cut.gguf: (not a GGUF file, or truncated|truncated GGUF)"):
            prof.read_buddy_profile(tmp_path / "cut.gguf")
    with pytest.raises(prof.ProfileError, match="profile not found"):
        prof.read_buddy_profile(tmp_path / "nope.gguf")


def test_wrong_kind_or_version(tmp_path, model, monkeypatch):
    ids, q, tae, _ = _arrays()
    fp = prof.model_fingerprint(model)
    with pytest.raises(prof.ProfileError, match="a GGUF without vis.profile.kind: not a vis profile .*"
                                                "re-run `pyvis calibrate buddies"):
        prof.read_buddy_profile(model)
    monkeypatch.setattr(prof, "VERSION", 2)
    prof.write_buddy_profile(tmp_path / "v2.gguf", fp, ids, q, tae, 0.9, 3, 2, 1, "s")
    monkeypatch.setattr(prof, "VERSION", 1)
    with pytest.raises(prof.ProfileError, match="v2.gguf: profile version 2 is not supported .*calibrate buddies"):
        prof.read_buddy_profile(tmp_path / "v2.gguf")
    monkeypatch.setattr(prof, "KIND", "predictor")
    prof.write_buddy_profile(tmp_path / "k.gguf", fp, ids, q, tae, 0.9, 3, 2, 1, "s")
    monkeypatch.setattr(prof, "KIND", "buddies")
    with pytest.raises(prof.ProfileError, match="k.gguf: a 'predictor' profile, not a 'buddies' one"):
        prof.read_buddy_profile(tmp_path / "k.gguf")


@pytest.mark.parametrize("change, field", [
    (dict(arch="mixtral"), "architecture: profile qwen3moe, model mixtral"),
    (dict(n_layer=3), "n_layer: profile 2, model 3"),
    (dict(n_expert=8), "n_expert: profile 4, model 8"),
    (dict(seed=9), "router_hash: profile [0-9a-f]{16}, model [0-9a-f]{16}"),
])
def test_wrong_model_names_the_field(tmp_path, profile, change, field):
    E = change.get("n_expert", 4)
    seed = change.get("seed", 1)
    other = tiny_model(tmp_path / "other.gguf", {0: router(E, seed=seed), 1: router(E, seed=2)},
                       arch=change.get("arch", "qwen3moe"), n_layer=change.get("n_layer", 2), n_expert=E)
    with pytest.raises(prof.ProfileError, match=rf"p.gguf was calibrated for another model than .*other.gguf "
                                                rf"\((.*; )?{field}(; .*)?\); re-run `pyvis calibrate buddies"):
        prof.read_buddy_profile(profile, other)


def test_ids_out_of_range(tmp_path, profile):
    r = gguf.GGUFReader(str(profile))
    t = next(t for t in r.tensors if t.name == "buddy.ids")
    data = bytearray(profile.read_bytes())
    struct.pack_into("<i", data, t.data_offset + 4 * 5, 4)     # [0, 1, 2] = 4 with 4 experts
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(prof.ProfileError, match=r"bad.gguf: buddy.ids\[0, 1, 2\] = 4 is out of range"):
        prof.read_buddy_profile(tmp_path / "bad.gguf")
    struct.pack_into("<i", data, t.data_offset + 4 * 5, -1)
    (tmp_path / "ok.gguf").write_bytes(bytes(data))
    prof.read_buddy_profile(tmp_path / "ok.gguf")            # the same file with the id back in range reads
    ids, q, tae, _ = _arrays()
    ids[1, 0, 0] = 7
    with pytest.raises(prof.ProfileError, match=r"k_max 5: must be in 1..4"):
        prof.write_buddy_profile(tmp_path / "w.gguf", {"arch": "a", "n_layer": 2, "n_expert": 4, "router_hash": 1},
                                 np.full((2, 4, 5), -1), np.zeros((2, 4, 5)), tae, 0.9, 5, 2, 1, "s")
    with pytest.raises(prof.ProfileError, match="expert ids must be -1 or in"):
        prof.write_buddy_profile(tmp_path / "w.gguf", {"arch": "a", "n_layer": 2, "n_expert": 4, "router_hash": 1},
                                 ids, q, tae, 0.9, 3, 2, 1, "s")


def test_writer_never_replaces_a_model_or_another_file(tmp_path, model, profile):
    ids, q, tae, _ = _arrays()
    fp = prof.model_fingerprint(model)
    before = model.read_bytes()
    with pytest.raises(prof.ProfileError, match="over the model itself"):
        prof.write_buddy_profile(model, fp, ids, q, tae, 0.9, 3, 2, 1, "s", model_path=model)
    with pytest.raises(prof.ProfileError, match="GGUF file that is not a vis profile"):
        prof.write_buddy_profile(model, fp, ids, q, tae, 0.9, 3, 2, 1, "s")          # even unnamed as the model
    assert model.read_bytes() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(prof.ProfileError, match="exists and is not a vis profile"):
        prof.write_buddy_profile(notes, fp, ids, q, tae, 0.9, 3, 2, 1, "s")
    assert notes.read_text() == "keep me"
    prof.write_buddy_profile(profile, fp, ids, q, tae, 0.5, 3, 2, 99, "again")       # an earlier profile: replaced
    assert prof.read_buddy_profile(profile, model).n_tokens == 99
    assert not list(tmp_path.glob("*.part"))


# --------------------------------------------------------------------------
# SUB1 trace records
# --------------------------------------------------------------------------
def test_outcome_names_mirror_the_header():
    text = vis_header_text()
    body = re.search(r"enum llama_vis_sub_outcome \{(.*?)\};", text, re.S).group(1)
    vals = {int(v): n.lower() for n, v in re.findall(r"LLAMA_VIS_SUB_(\w+)\s*=\s*(\d+)", body) if n != "N_OUTCOMES"}
    assert vtrace.SUB_OUTCOMES == tuple(vals[i] for i in range(len(vals)))


def test_sub1_records(tmp_path):
    ids0 = [[0, 1], [2, 3]]
    w = [[0.6, 0.4], [0.5, 0.5]]
    recs = [("REC1", 0, 0, ids0, w), ("SUB1", 0, 0, [[0, 3], [2, 3]], [[0, 1], [7, 8]]),
            ("REC1", 0, 1, [[1, 2], [0, 3]], w),                                  # no SUB1 (a pinned layer)
            ("REC1", 1, 0, [[3, 1]], [[0.9, 0.1]]), ("SUB1", 1, 0, [[3, 2]], [[0, 1]])]
    p = tmp_path / "s.trace"
    p.write_bytes(trace_bytes(2, 4, 2, recs))
    t = vtrace.read(p)
    assert t.ids.tolist() == [[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]]
    assert t.exec_ids.tolist() == [[0, 3], [2, 3], [1, 2], [0, 3], [3, 2]]
    assert t.outcome.tolist() == [[0, 1], [7, 8], [0, 0], [0, 0], [0, 1]]
    assert t.exec_ids.dtype == np.int32 and t.outcome.dtype == np.uint8
    assert vtrace.SUB_OUTCOMES[t.outcome[1, 1]] == "needed_anyway"
    l0 = t.for_layer(0)
    assert l0.exec_ids.tolist() == [[0, 3], [2, 3], [3, 2]] and l0.outcome[:, 1].tolist() == [1, 8, 1]
    back = vtrace.load(t.save(tmp_path / "s.npz"))
    assert np.array_equal(back.exec_ids, t.exec_ids) and np.array_equal(back.outcome, t.outcome)
    plain = vtrace.parse(trace_bytes(2, 4, 2, [r for r in recs if r[0] == "REC1"]))
    assert np.array_equal(plain.exec_ids, plain.ids) and not plain.outcome.any()
    assert np.array_equal(Trace.from_routes(np.array([ids0]), 4).exec_ids, np.array(ids0))


@pytest.mark.parametrize("recs, msg", [
    ([("SUB1", 0, 0, [[0, 1]], [[0, 0]])], "does not follow the REC1"),
    ([("REC1", 0, 0, [[0, 1]], [[1, 0]]), ("SUB1", 0, 1, [[0, 1]], [[0, 0]])], "does not follow the REC1"),
    ([("REC1", 0, 0, [[0, 1]], [[1, 0]]), ("SUB1", 0, 0, [[0, 1]], [[0, 0]]), ("SUB1", 0, 0, [[0, 1]], [[0, 0]])],
     "does not follow the REC1"),
    ([("REC1", 0, 0, [[0, 1]], [[1, 0]]), ("SUB1", 0, 0, [[0, 9]], [[0, 1]])], "executed expert ids"),
    ([("REC1", 0, 0, [[0, 1]], [[1, 0]]), ("SUB1", 0, 0, [[0, 1]], [[0, 12]])], "outcome 12 is not one of"),
])
def test_bad_sub1_records(recs, msg):
    with pytest.raises(TraceError, match=msg):
        vtrace.parse(trace_bytes(1, 4, 2, recs))


def test_truncated_sub1_record():
    data = trace_bytes(1, 4, 2, [("REC1", 0, 0, [[0, 1]], [[1, 0]]), ("SUB1", 0, 0, [[0, 1]], [[0, 0]])])
    with pytest.raises(TraceError, match="truncated SUB1 record"):
        vtrace.parse(data[:-1])


# --------------------------------------------------------------------------
# pyvis calibrate buddies, pyvis report-buddies
# --------------------------------------------------------------------------
def paired_trace(path: Path, n_tokens: int = 240, seed: int = 0) -> Path:
    """A --moe-trace file for the qwen3moe fixture (3 layers x 32 experts, top-8) in which experts 2p and 2p+1
    are always routed together: each token takes 4 of the 16 pairs (layer 1 leaves pair 15 out)."""
    rng = np.random.default_rng(seed)
    recs = []
    for ub in range(0, n_tokens, 60):
        for il in range(3):
            pairs = [rng.choice(15 if il == 1 else 16, 4, replace=False) for _ in range(60)]
            ids = np.array([np.ravel([[2 * p, 2 * p + 1] for p in ps]) for ps in pairs])
            w = rng.dirichlet(np.ones(8), 60)
            recs.append(("REC1", ub // 60, il, ids, w))
    path.write_bytes(trace_bytes(3, 32, 8, recs))
    return path


def test_calibrate_buddies_cli_end_to_end(tmp_path, capsys):
    from pyvis.cli import main
    tr = paired_trace(tmp_path / "cal.trace")
    out = tmp_path / "qwen3moe.buddies.gguf"
    rc = main(["calibrate", "buddies", "-m", str(FIXTURE), "--trace", str(tr), "--out", str(out), "--alpha", "0.5",
               "--k-max", "4"])
    o = capsys.readouterr()
    assert rc == 0, o.err
    p = prof.read_buddy_profile(out, FIXTURE)
    assert (p.n_layer, p.n_expert, p.k, p.n_tokens, p.k_max) == (3, 32, 8, 240, 4)
    assert math.isclose(p.alpha, 0.5, rel_tol=1e-6) and math.isclose(p.smoothing, 1e-3, rel_tol=1e-6)
    assert p.source.startswith(f"traces {tr} sha256:")
    partner = np.arange(32) ^ 1
    for il in range(3):
        seen = np.arange(32) < (30 if il == 1 else 32)
        assert np.array_equal(p.ids[il, seen, 0], partner[seen]), il     # the planted buddy comes first
        assert (p.ids[il, ~seen] == -1).all()
        assert np.allclose(p.q[il, seen, 0], 1 / 7, atol=1e-3)          # always together: 1 of 7 peers per token
        assert (p.q[il, seen, 0] > 2 * p.q[il, seen, 1]).all()           # any other: ~ 1/35
    assert np.allclose(p.freq.sum(1), 8, atol=1e-4)
    t = vtrace.read(tr)
    for il in range(3):                                      # TAE quantiles = np.percentile of the hand formula
        w = t.for_layer(il).weights.astype(np.float64)
        w /= w.sum(1, keepdims=True)
        tae = -(w * np.log(w)).sum(1) / math.log(8)
        assert np.allclose(p.tae_quantiles[il], np.percentile(tae, np.arange(101)))
    assert re.search(r"^\s+1\s+240\s+30\s+[\d.]+", o.out, re.M)              # the per-layer summary
    assert "TAE p10" in o.out and f"wrote {out}" in o.out
    # the report picture
    png = tmp_path / "graph.png"
    assert main(["report-buddies", str(out), "--layer", "1", "--out", str(png), "-m", str(FIXTURE)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(["report-buddies", str(out), "--layer", "7", "--out", str(tmp_path / "x.png")]) == 1
    assert "--layer 7: the profile has layers 0..2" in capsys.readouterr().err


def test_calibrate_cli_errors(tmp_path, capsys, model):
    from pyvis.cli import main
    tr = paired_trace(tmp_path / "cal.trace", 60)
    before = FIXTURE.stat().st_mtime_ns
    assert main(["calibrate", "buddies", "-m", str(FIXTURE), "--trace", str(tr), "--out", str(FIXTURE)]) == 1
    assert "over the model itself" in capsys.readouterr().err and FIXTURE.stat().st_mtime_ns == before
    assert main(["calibrate", "buddies", "-m", str(model), "--trace", str(tr), "--out", str(tmp_path / "p")]) == 1
    assert "32 experts per layer, the model has 4" in capsys.readouterr().err
    assert main(["calibrate", "buddies", "-m", str(FIXTURE), "--trace", str(tmp_path / "nope"),
                 "--out", str(tmp_path / "p")]) == 1
    assert "trace not found" in capsys.readouterr().err and not (tmp_path / "p").exists()


WORDS = "the expert router selects tokens for each layer of the model and its cache".split()


def corpus_text(path: Path, n_words: int = 2500, step: int = 3) -> Path:
    """A toy text for --corpus runs (which need our llama-perplexity: the build always makes it, so a missing one
    fails here)."""
    from pyvis import _paths
    assert _paths.bin_path("llama-perplexity").is_file()
    path.write_text(" ".join(WORDS[i % len(WORDS)] if i % 7 else WORDS[(step * i) % len(WORDS)]
                             for i in range(n_words)))
    return path


def test_calibrate_from_a_corpus(tmp_path, capsys):
    """--corpus: our llama-perplexity writes the trace (needs the native build)."""
    from pyvis.cli import main
    text = corpus_text(tmp_path / "corpus.txt")
    out = tmp_path / "c.gguf"
    rc = main(["calibrate", "buddies", "-m", str(FIXTURE), "--corpus", str(text), "--out", str(out), "-c", "128",
               "--chunks", "2", "-t", "2", "--trace-out", str(tmp_path / "c.trace")])
    o = capsys.readouterr()
    assert rc == 0, o.err[-3000:]
    p = prof.read_buddy_profile(out, FIXTURE)
    t = vtrace.read(tmp_path / "c.trace")
    assert p.n_tokens == 256 == len(t.for_layer(0))           # 2 chunks of 128, no warm-up rows
    assert p.source.startswith(f"corpus {text} sha256:") and "-c 128 --chunks 2" in p.source
    f = bd.fit([t], 3, 32, 0.9, 8, 1e-3)
    assert np.array_equal(p.ids, f.ids) and np.array_equal(p.tae_quantiles, f.tae, equal_nan=True)


def test_the_runtime_substitutes_from_a_calibrated_profile(tmp_path, capsys):
    """llama-cli loads the profile this package writes, and the SUB1 records of its trace show stand-ins taken from
    the missing experts' buddy lists, as many as its stats table counts (needs the native build)."""
    from conftest import run
    from pyvis import _paths
    from pyvis.cli import main
    cli = _paths.bin_path("llama-cli")           # the build always makes it: a failure, never a skip
    out = tmp_path / "p.gguf"
    assert main(["calibrate", "buddies", "-m", str(FIXTURE), "--trace", str(paired_trace(tmp_path / "c.trace")),
                 "--out", str(out), "--k-max", "4"]) == 0
    capsys.readouterr()
    tr = tmp_path / "sub.trace"
    r = run([cli, "-m", FIXTURE, "-p", "the expert router selects tokens for each layer", "-n", "16", "-st", "-t", "2",
             "--moe-slots", "8", "--moe-substitute", "buddy", "--moe-sub-profile", out, "--moe-trace", tr,
             "--moe-stats"])
    assert r.returncode == 0, r.stderr[-3000:]
    t = vtrace.read(tr)
    p = prof.read_buddy_profile(out, FIXTURE)
    sub = np.argwhere(t.outcome == vtrace.SUB_OUTCOMES.index("substituted"))
    assert len(sub) > 0 and (t.exec_ids != t.ids).sum() == len(sub)
    assert all(t.exec_ids[a, b] in p.buddies(t.layer[a], t.ids[a, b]) for a, b in sub)
    total = next(line for line in (r.stdout + r.stderr).splitlines()
                 if line.startswith("vis-moe: total") and len(line.split()) > 12)            # the substitution table
    assert int(total.split()[4]) == len(sub), total                   # tokens, missing, subst, ...
