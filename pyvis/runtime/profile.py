"""Buddy profiles: the GGUF sidecar that ``--moe-sub-profile`` reads (docs/substitution.md, issue #13).

A profile is a GGUF file with no model weights, written by ``pyvis calibrate buddies``
(:mod:`pyvis.calibrate.buddies`) and tied to one model by a fingerprint:

* :func:`router_hash`: the hash of the routers' stored bytes (``llama_vis_moe_router_hash`` in C):

      h = 0xcbf29ce484222325
      for each layer il, in order, that has blk.<il>.ffn_gate_inp.weight:
          t = nbytes + sum_i (w_i + 1) * (2 i + 1)  mod 2^64   (w_i: its bytes as little-endian u32, zero-padded)
          h = h * 0x100000001b3 + t                 mod 2^64

* :func:`model_fingerprint`: architecture, layer count, expert count, top-k and router hash of a model GGUF;
* :func:`write_buddy_profile` / :func:`read_buddy_profile`: the file itself (key and tensor names below).

Every kind of profile (``vis.profile.kind``: ``buddies`` here, ``predictor`` in :mod:`pyvis.runtime.predict_profile`,
``shadow`` in :mod:`pyvis.runtime.shadow`)
carries the same fingerprint keys, written by :func:`start_profile` and checked by :func:`open_profile` and
:func:`check_model`.  Every way a profile can be wrong raises :class:`ProfileError` with the file's name and the fix.
The writer never replaces a model or any other file that is not a profile.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KIND = "buddies"
VERSION = 1
PROFILE_ARCH = "vis-profile"          # general.architecture of a profile: llama.cpp refuses to load it as a model
HASH_INIT = 0xCBF29CE484222325
HASH_MUL = 0x100000001B3
MASK64 = (1 << 64) - 1
N_QUANTILES = 101                     # percentiles 0..100

K_KIND, K_VERSION = "vis.profile.kind", "vis.profile.version"
K_ARCH, K_NLAYER, K_NEXPERT = "vis.model.arch", "vis.model.n_layer", "vis.model.n_expert"
K_HASH = "vis.model.router_hash"
K_K, K_NTOK, K_SOURCE = "vis.profile.k", "vis.profile.n_tokens", "vis.profile.source"
K_ALPHA, K_KMAX, K_SMOOTH = "vis.buddy.alpha", "vis.buddy.k_max", "vis.buddy.smoothing"
T_IDS, T_Q, T_TAE, T_FREQ = "buddy.ids", "buddy.q", "tae.quantiles", "expert.freq"

_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
# the fingerprint and provenance keys every kind carries, with their Python types
COMMON_KEYS = ((K_ARCH, str), (K_NLAYER, int), (K_NEXPERT, int), (K_HASH, str), (K_K, int), (K_NTOK, int),
               (K_SOURCE, str))


def fix_for(kind: str, path) -> str:
    """The fix a ProfileError names: re-run the calibration of that kind (``pyvis shadow`` for a shadow sidecar)."""
    if kind == "shadow":
        return f"re-run `pyvis shadow MODEL --type TYPE --out {path}` for this model"
    return f"re-run `pyvis calibrate {kind} -m MODEL ... --out {path}` for this model"


class ProfileError(ValueError):
    """A profile that cannot be used (not a GGUF, another kind or version, another model, bad contents)."""


def _reader(path: Path, what: str):
    import gguf
    if not path.is_file():
        raise ProfileError(f"{what} not found: {path}")
    try:
        r = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct.error, IndexError, ... on bad files
        raise ProfileError(f"{path}: not a GGUF file, or truncated ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in r.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ProfileError(f"{path}: truncated GGUF (tensor {t.name} ends past the end of the file)")
    return r


def _field(r, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def model_readers(path: str | os.PathLike) -> list:
    """GGUFReaders of every file of the model ``path`` names (the shards of a split model, in order); ProfileError
    for a later shard, a missing one, an mmproj or a sidecar (:mod:`pyvis.runtime.gguf_model`)."""
    from .gguf_model import ModelFileError, shard_paths, what_it_is
    path = Path(path)
    try:
        paths = shard_paths(path)
    except ModelFileError as e:
        raise ProfileError(str(e)) from None
    readers = [_reader(p, "model") for p in paths]
    why = what_it_is(path, readers[0])
    if why:
        raise ProfileError(why)
    return readers


def router_hash(model_path: str | os.PathLike) -> int:
    """The routers' fingerprint (formula above) over the raw stored bytes of every ``blk.<il>.ffn_gate_inp.weight``."""
    path = Path(model_path)
    return _hash_routers(model_readers(path), path)


def _hash_routers(readers: list, path: Path) -> int:
    routers = sorted(((int(m.group(1)), r, t) for r in readers for t in r.tensors
                      if (m := _ROUTER.fullmatch(t.name))), key=lambda x: x[0])
    if not routers:
        raise ProfileError(f"{path}: no router tensors (blk.N.ffn_gate_inp.weight): not a MoE model")
    h = HASH_INIT
    for _, r, t in routers:
        h = (h * HASH_MUL + bytes_sum(r.data[t.data_offset: t.data_offset + t.n_bytes])) & MASK64
    return h


def bytes_sum(data) -> int:
    """The checksum of a run of bytes: ``nbytes + sum_i (w_i + 1) * (2 i + 1) mod 2^64`` over its little-endian u32
    words ``w_i`` (zero-padded).  Each router's term of :func:`router_hash`, and each shadow expert's checksum
    (:mod:`pyvis.runtime.shadow`); ``vis_bytes_sum`` in C.  A change of any one word changes it (odd factors)."""
    raw = np.asarray(data, np.uint8).reshape(-1)
    n = len(raw)
    pad = (-n) % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    w = raw.view("<u4").astype(np.uint64)
    i = np.arange(len(w), dtype=np.uint64)
    with np.errstate(over="ignore"):
        s = int(((w + np.uint64(1)) * (np.uint64(2) * i + np.uint64(1))).sum(dtype=np.uint64))  # wraps mod 2^64
    return (n + s) & MASK64


_FP_CACHE: dict = {}   # (path, inode, size, mtime) -> fingerprint: GGUFReader takes seconds on a large vocabulary


def model_fingerprint(model_path: str | os.PathLike) -> dict:
    """``{arch, n_layer, n_expert, n_expert_used, router_hash}`` of a model GGUF."""
    path = Path(model_path)
    if not path.is_file():
        raise ProfileError(f"model not found: {path}")
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _FP_CACHE:
        _FP_CACHE[key] = _fingerprint(path)
    return dict(_FP_CACHE[key])


def _fingerprint(path: Path) -> dict:
    readers = model_readers(path)
    r = readers[0]
    arch = _field(r, "general.architecture")
    if not isinstance(arch, str):
        raise ProfileError(f"{path}: no general.architecture: not a model GGUF")
    vals = {}
    for name, key in (("n_layer", "block_count"), ("n_expert", "expert_count"), ("n_expert_used", "expert_used_count")):
        v = _field(r, f"{arch}.{key}")
        if v is None:
            raise ProfileError(f"{path}: no {arch}.{key}: not a MoE model")
        vals[name] = int(v)
    return {"arch": arch, **vals, "router_hash": _hash_routers(readers, path)}


@dataclass
class BuddyProfile:
    path: Path
    arch: str
    n_layer: int
    n_expert: int
    router_hash: int
    k: int                    # top-k of the calibration run
    n_tokens: int
    source: str
    alpha: float
    k_max: int
    smoothing: float | None   # None in files that do not record it
    ids: np.ndarray           # [n_layer, n_expert, k_max] int32, -1 padded
    q: np.ndarray             # [n_layer, n_expert, k_max] float32
    tae_quantiles: np.ndarray  # [n_layer, 101] float64, NaN rows for layers without routing
    freq: np.ndarray | None   # [n_layer, n_expert] float32, share of the layer's tokens that selected each expert

    def buddies(self, il: int, i: int) -> list[int]:
        """The buddy list of expert i of layer il, best first."""
        return [int(j) for j in self.ids[il, i] if j >= 0]


def check_output_path(out: Path, model_path: Path | None, kind: str | None = None, force: bool = False) -> None:
    """Raise ProfileError unless ``out`` may be written: not the model, not an existing file other than a profile,
    and (``kind`` given) not a profile of another kind unless ``force`` (``--force``): a predictor profile written
    with ``-o X.shadow.gguf`` must not replace the shadow sidecar there without a word."""
    if model_path is not None and (out.resolve() == model_path.resolve()
                                   or (out.exists() and model_path.exists() and os.path.samefile(out, model_path))):
        raise ProfileError(f"refusing to write the profile over the model itself ({out}); give another --out")
    if not out.exists():
        return
    if not out.is_file():
        raise ProfileError(f"refusing to overwrite {out}: it is not a regular file; give another --out")
    with open(out, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ProfileError(f"refusing to overwrite {out}: it exists and is not a vis profile; give another --out")
    try:
        have = _field(_reader(out, "profile"), K_KIND)
    except ProfileError:
        have = None
    if have is None:
        raise ProfileError(f"refusing to overwrite {out}: it is a GGUF file that is not a vis profile "
                           "(a model?); give another --out")
    if kind is not None and have != kind and not force:
        raise ProfileError(f"refusing to overwrite {out}: it is a '{have}' sidecar, not a '{kind}' one; "
                           "give another --out, or --force to replace it")


def start_profile(path: str | os.PathLike, fingerprint: dict, kind: str, version: int, k: int, n_tokens: int,
                  source: str, model_path: str | os.PathLike | None = None, force: bool = False):
    """A GGUFWriter on ``PATH.part`` holding the kind, version, fingerprint and provenance keys; add the kind's keys
    and tensors, then :func:`finish_profile`.  Refuses ``model_path``, any file that is not a vis profile, and one of
    another kind unless ``force``."""
    import gguf
    out = Path(path)
    check_output_path(out, Path(model_path) if model_path else None, kind, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(tmp), PROFILE_ARCH)
    w.add_string(K_KIND, kind)
    w.add_uint32(K_VERSION, int(version))
    w.add_string(K_ARCH, str(fingerprint["arch"]))
    w.add_uint32(K_NLAYER, int(fingerprint["n_layer"]))
    w.add_uint32(K_NEXPERT, int(fingerprint["n_expert"]))
    w.add_string(K_HASH, f"{int(fingerprint['router_hash']) & MASK64:016x}")
    w.add_uint32(K_K, int(k))
    w.add_uint64(K_NTOK, int(n_tokens))
    w.add_string(K_SOURCE, str(source))
    return w


def finish_profile(w, path: str | os.PathLike) -> Path:
    """Write what :func:`start_profile` began and move it over ``path`` (atomically)."""
    out = Path(path)
    tmp = out.with_name(out.name + ".part")
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def write_buddy_profile(path: str | os.PathLike, fingerprint: dict, ids, q, tae_quantiles, alpha: float, k_max: int,
                        k: int, n_tokens: int, source: str, *, freq=None, smoothing: float | None = None,
                        model_path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write a buddies profile (atomically: ``PATH.part``, then rename).  Refuses to replace ``model_path``, any
    non-profile file, or a GGUF that is not a vis profile."""
    L, E = int(fingerprint["n_layer"]), int(fingerprint["n_expert"])
    if not 1 <= k_max <= E:
        raise ProfileError(f"k_max {k_max}: must be in 1..{E} (the model's expert count)")
    ids = np.ascontiguousarray(ids, np.int32)
    q = np.ascontiguousarray(q, np.float32)
    tae = np.ascontiguousarray(tae_quantiles, np.float64)
    for name, a, shape in ((T_IDS, ids, (L, E, k_max)), (T_Q, q, (L, E, k_max)), (T_TAE, tae, (L, N_QUANTILES))):
        if a.shape != shape:
            raise ProfileError(f"{name}: shape {a.shape}, expected {shape}")
    if ids.size and (ids.min() < -1 or ids.max() >= E):
        raise ProfileError(f"{T_IDS}: expert ids must be -1 or in [0, {E})")
    if freq is not None:
        freq = np.ascontiguousarray(freq, np.float32)
        if freq.shape != (L, E):
            raise ProfileError(f"{T_FREQ}: shape {freq.shape}, expected {(L, E)}")
    w = start_profile(path, fingerprint, KIND, VERSION, k, n_tokens, source, model_path, force)
    w.add_float32(K_ALPHA, float(alpha))
    w.add_uint32(K_KMAX, int(k_max))
    if smoothing is not None:
        w.add_float32(K_SMOOTH, float(smoothing))
    w.add_tensor(T_IDS, ids)
    w.add_tensor(T_Q, q)
    w.add_tensor(T_TAE, tae)
    if freq is not None:
        w.add_tensor(T_FREQ, freq)
    return finish_profile(w, path)


def profile_tensor(r, name: str, dtype, shape: tuple, path: Path, required: bool = True, kind: str = KIND):
    """Tensor ``name`` of an open profile as a numpy copy of ``dtype`` and ``shape`` (None if optional and absent)."""
    t = next((t for t in r.tensors if t.name == name), None)
    if t is None:
        if required:
            raise ProfileError(f"{path}: tensor {name} is missing; {fix_for(kind, path)}")
        return None
    a = np.asarray(t.data)
    if a.dtype != dtype or a.shape != shape:
        raise ProfileError(f"{path}: tensor {name} is {a.dtype} {a.shape}, expected {np.dtype(dtype)} {shape}; "
                           + fix_for(kind, path))
    return np.array(a)


def open_profile(path: str | os.PathLike, kind: str, version: int, keys: tuple = ()) -> tuple:
    """``(reader, meta)`` of a profile of ``kind``: checks the file, kind, version, the common keys and ``keys``
    (``(name, type)`` pairs of the kind's own required keys); ``meta`` maps each key to its value."""
    p = Path(path)
    fix = fix_for(kind, p)
    r = _reader(p, "profile")
    got, ver = _field(r, K_KIND), _field(r, K_VERSION)
    if got is None:
        raise ProfileError(f"{p}: a GGUF without {K_KIND}: not a vis profile (a model file?); {fix}")
    if got != kind:
        raise ProfileError(f"{p}: a {got!r} profile, not a {kind!r} one ({K_KIND}); {fix}")
    if ver != version:
        raise ProfileError(f"{p}: profile version {ver} is not supported (expected {version}); {fix}")
    arch = _field(r, "general.architecture")
    if arch != PROFILE_ARCH:
        raise ProfileError(f"{p}: general.architecture is {arch!r}, a vis profile has {PROFILE_ARCH!r} (damaged file); "
                           f"{fix}")
    meta = {}
    for key, typ in COMMON_KEYS + tuple(keys):
        v = _field(r, key)
        if v is None or not isinstance(v, (str if typ is str else (int, float))):
            raise ProfileError(f"{p}: key {key} is missing or has the wrong type; {fix}")
        meta[key] = typ(v)
    if not re.fullmatch(r"[0-9a-f]{16}", meta[K_HASH]):
        raise ProfileError(f"{p}: {K_HASH} = {meta[K_HASH]!r} is not 16 lowercase hex digits; {fix}")
    return r, meta


def optional_key(r, key: str):
    """The value of an optional key of an open profile (None if absent)."""
    return _field(r, key)


def read_buddy_profile(path: str | os.PathLike, model_path: str | os.PathLike | None = None) -> BuddyProfile:
    """Read and check a buddies profile; with ``model_path``, also check it was calibrated for that model."""
    p = Path(path)
    fix = fix_for(KIND, p)
    r, meta = open_profile(p, KIND, VERSION, ((K_ALPHA, float), (K_KMAX, int)))
    L, E, kmax = meta[K_NLAYER], meta[K_NEXPERT], meta[K_KMAX]
    if not 1 <= kmax <= E:
        raise ProfileError(f"{p}: {K_KMAX} = {kmax} is outside 1..{E}; {fix}")
    ids = profile_tensor(r, T_IDS, np.int32, (L, E, kmax), p)
    q = profile_tensor(r, T_Q, np.float32, (L, E, kmax), p)
    tae = profile_tensor(r, T_TAE, np.float64, (L, N_QUANTILES), p)
    freq = profile_tensor(r, T_FREQ, np.float32, (L, E), p, required=False)
    smooth = _field(r, K_SMOOTH)
    del r
    if ids.size and (ids.min() < -1 or ids.max() >= E):
        bad = np.argwhere((ids < -1) | (ids >= E))[0]
        raise ProfileError(f"{p}: {T_IDS}[{bad[0]}, {bad[1]}, {bad[2]}] = {ids[tuple(bad)]} is out of range "
                           f"(experts 0..{E - 1}, -1 = none); {fix}")
    prof = BuddyProfile(p, meta[K_ARCH], L, E, int(meta[K_HASH], 16), meta[K_K], meta[K_NTOK], meta[K_SOURCE],
                        meta[K_ALPHA], kmax, None if smooth is None else float(smooth), ids, q, tae, freq)
    if model_path is not None:
        check_model(prof, model_path)
    return prof


def check_model(prof, model_path: str | os.PathLike, kind: str = KIND) -> None:
    """Raise ProfileError naming every fingerprint field where a profile (anything with ``path, arch, n_layer,
    n_expert, router_hash``) and the model differ."""
    fp = model_fingerprint(model_path)
    diffs = [f"{name}: profile {a}, model {b}" for name, a, b in
             (("architecture", prof.arch, fp["arch"]), ("n_layer", prof.n_layer, fp["n_layer"]),
              ("n_expert", prof.n_expert, fp["n_expert"]),
              ("router_hash", f"{prof.router_hash:016x}", f"{fp['router_hash']:016x}")) if a != b]
    if diffs:
        raise ProfileError(f"{prof.path} was calibrated for another model than {model_path} ({'; '.join(diffs)}); "
                           + fix_for(kind, prof.path))
