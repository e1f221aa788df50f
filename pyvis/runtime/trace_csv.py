"""CSV route traces recorded by other engines, read into our :class:`~pyvis.runtime.trace.Trace`
(``pyvis trace import``); :func:`load_any` reads a CSV route trace or anything :func:`pyvis.runtime.trace.load` reads.

Format (``route_trace v1``, e.g. ``../shared/traces/qwen3-30b-a3b-top6.route.csv``, described in its README):

    # route_trace v1
    # model=PATH arch=ARCH n_layer=48 n_expert=128 n_expert_used=6
    # layer=0 expert_bytes=3059712 dense_bytes=11953152          (one line per layer, optional)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
    0,0,0,0,0,49,0.221297,0,3059712
    ...

One row per (token, layer, top-k slot): ``phase`` 0 = prompt, 1 = generation; ``step`` the token position;
``slot`` the rank in the token's top-k; ``weight`` the router's gate weight.  Columns after ``weight`` (the
recording engine's residency) are ignored.  Each (turn, phase, step) becomes one ubatch of one token, in file
order; ``turn`` becomes the sequence id.  Every (token, layer) must list slots ``0..n_expert_used-1`` once.
Errors name the file and line.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from .trace import Trace, TraceError, load

MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight")
_KV = re.compile(r"(\w+)=(\S+)")


def looks_like_csv(head: bytes) -> bool:
    """Do a file's first bytes start a CSV route trace?"""
    return head.startswith(b"# route_trace") or head.startswith(b"turn,phase,")


def load_any(path: str | os.PathLike) -> Trace:
    """A CSV route trace (:func:`read_csv`), a ``--moe-trace`` file or an ``.npz`` (:func:`pyvis.runtime.trace.load`)."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            if looks_like_csv(f.read(16)):
                return read_csv(p)
    return load(p)


def _int(v: str, what: str, where: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise TraceError(f"{where}: {what} must be an integer, got '{v}'") from None


def read_csv(path: str | os.PathLike) -> Trace:
    """A CSV route trace as a :class:`Trace` (``meta["format"] = "route_trace v1"``, ``expert_bytes`` from the
    preamble when every layer has one)."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{p}: cannot read a CSV route trace: {e}") from e
    if not lines or lines[0].strip() != MAGIC:
        raise TraceError(f"{p}:1: not a CSV route trace (expected the first line '{MAGIC}')")
    shape: dict[str, int] = {}
    sizes: dict[int, int] = {}
    i = 1
    while i < len(lines) and lines[i].startswith("#"):
        kv = dict(_KV.findall(lines[i]))
        where = f"{p}:{i + 1}"
        if "n_layer" in kv:
            for key in ("n_layer", "n_expert", "n_expert_used"):
                if key not in kv:
                    raise TraceError(f"{where}: the model line lacks {key}=")
                shape[key] = _int(kv[key], key, where)
            shape["model"] = kv.get("model", "")       # type: ignore[assignment]
        elif "layer" in kv and "expert_bytes" in kv:
            sizes[_int(kv["layer"], "layer", where)] = _int(kv["expert_bytes"], "expert_bytes", where)
        i += 1
    if "n_layer" not in shape:
        raise TraceError(f"{p}: the preamble has no model line with n_layer=, n_expert=, n_expert_used=")
    n_layer, n_expert, k = shape["n_layer"], shape["n_expert"], shape["n_expert_used"]
    if n_layer <= 0 or n_expert <= 0 or not 0 < k <= n_expert:
        raise TraceError(f"{p}: bad model shape n_layer={n_layer} n_expert={n_expert} n_expert_used={k}")
    if i >= len(lines):
        raise TraceError(f"{p}: no header row after the preamble (truncated file?)")
    header = [c.strip() for c in lines[i].split(",")]
    if tuple(header[:len(COLUMNS)]) != COLUMNS:
        raise TraceError(f"{p}:{i + 1}: wrong header: expected columns {','.join(COLUMNS)}[,...], got '{lines[i]}'")
    body = lines[i + 1:]
    while body and not body[-1].strip():
        body.pop()
    first = i + 2                                     # line number of body[0]
    if not any(ln.strip() for ln in body):
        raise TraceError(f"{p}: no routing rows after the header")
    try:
        arr = np.array([[float(x) for x in ln.split(",")[:len(COLUMNS)]] for ln in body], np.float64)
    except ValueError:
        arr = None
    if arr is None or arr.ndim != 2 or arr.shape[1] != len(COLUMNS):
        for j, ln in enumerate(body):                 # the first bad line, for the message
            f = ln.split(",")
            if len(f) < len(COLUMNS):
                raise TraceError(f"{p}:{first + j}: expected {len(COLUMNS)} or more columns, got {len(f)} "
                                 f"(truncated file?)")
            for name, v in zip(COLUMNS, f):
                try:
                    float(v)
                except ValueError:
                    raise TraceError(f"{p}:{first + j}: {name} is not a number: '{v}'") from None
        raise TraceError(f"{p}: cannot parse the routing rows")   # not reached: some line failed above
    ints = arr[:, :6]
    bad = np.nonzero((ints != np.round(ints)).any(1) | (ints < 0).any(1))[0]
    if len(bad):
        raise TraceError(f"{p}:{first + bad[0]}: turn, phase, step, layer, slot and expert must be integers >= 0")
    turn, phase, step, layer, slot, expert = (ints[:, c].astype(np.int64) for c in range(6))
    for name, v, lim in (("phase", phase, 2), ("layer", layer, n_layer), ("slot", slot, k), ("expert", expert, n_expert)):
        bad = np.nonzero(v >= lim)[0]
        if len(bad):
            raise TraceError(f"{p}:{first + bad[0]}: {name} {v[bad[0]]} is out of range 0..{lim - 1}")
    # rows come in groups of k (one token at one layer), slots 0..k-1 in order
    n = len(arr)
    if n % k:
        g = n - n % k
        raise TraceError(f"{p}:{first + g}: the last (token, layer) has {n % k} of {k} slots (truncated file?)")
    key = np.stack([turn, phase, step, layer], 1).reshape(-1, k, 4)
    same = (key == key[:, :1]).all(axis=(1, 2))
    order = (slot.reshape(-1, k) == np.arange(k)).all(1)
    bad = np.nonzero(~(same & order))[0]
    if len(bad):
        raise TraceError(f"{p}:{first + bad[0] * k}: a (token, layer) must list slots 0..{k - 1} in order "
                         f"on {k} consecutive rows")
    g = key[:, 0]                                     # [groups, 4]
    tok = g[:, :3]
    change = np.r_[True, (tok[1:] != tok[:-1]).any(1)]
    ub = np.cumsum(change) - 1                        # one ubatch per token, in file order
    pairs = ub * n_layer + g[:, 3]
    if len(np.unique(pairs)) != len(pairs):
        j = int(np.nonzero(np.r_[False, np.diff(np.sort(pairs)) == 0])[0][0])
        dup = np.sort(pairs)[j]
        row = int(np.nonzero(pairs == dup)[0][1])
        raise TraceError(f"{p}:{first + row * k}: token (turn {g[row, 0]}, step {g[row, 2]}) lists layer "
                         f"{g[row, 3]} twice, or its rows are not together")
    ids = expert.reshape(-1, k).astype(np.int32)
    srt = np.sort(ids, axis=1)
    bad = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(1))[0]
    if len(bad):
        raise TraceError(f"{p}:{first + bad[0] * k}: a token selects the same expert twice in one layer")
    eb = None
    if sizes:
        missing = [il for il in range(n_layer) if il not in sizes]
        if missing:
            raise TraceError(f"{p}: the preamble gives expert_bytes for {len(sizes)} of {n_layer} layers "
                             f"(none for layer {missing[0]})")
        eb = np.array([sizes[il] for il in range(n_layer)], np.int64)
    meta = {"format": "route_trace v1", "source": str(p), "model": shape.get("model", "")}
    return Trace(n_layer, n_expert, k, ub.astype(np.int32), g[:, 3].astype(np.int32), g[:, 0].astype(np.int32),
                 g[:, 2].astype(np.int32), np.zeros(len(g), np.uint8), ids,
                 arr[:, 6].reshape(-1, k).astype(np.float32), meta, phase=g[:, 1].astype(np.uint8), expert_bytes=eb)
