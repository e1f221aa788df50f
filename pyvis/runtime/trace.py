"""Routing traces: which experts each token selected at each MoE layer.  One model for every tool.

A :class:`Trace` holds one row per (token, MoE layer) evaluation, in the order the runtime computed
them: the ubatch, layer, sequence, position and modality of the row, its top-k expert ids and their
gating weights.  Sources:

* :func:`read` / :func:`parse`: the binary file the fork writes with ``--moe-trace FILE``;
* :meth:`Trace.from_routes`: a matrix ``ids [layers, tokens, k]`` (the eval-callback collector
  :mod:`pyvis.testbed.collect`, synthetic routing);
* :func:`pyvis.runtime.trace_csv.read_csv`: the CSV route traces other engines record (``# route_trace v1``,
  e.g. ``../shared/traces/``), with per-layer expert sizes and the prompt / generation phase of every row;
* :func:`load`: a ``--moe-trace`` file or a trace saved with :meth:`Trace.save` (``.npz``);
  :func:`pyvis.runtime.trace_csv.load_any` reads any of the three.

:meth:`Trace.routes` gives the matrix view ``[layers, tokens, k]`` of the layers that routed every
token (upstream computes the last layer for the output rows only); :mod:`pyvis.runtime.cachesim`
and :mod:`pyvis.testbed.routing_report` work on a Trace.

``--moe-trace`` format (little endian), documented in docs/residency.md:

    header   char[8] "VISTRACE", u32 version (1), u32 n_layer, u32 n_expert, u32 n_expert_used
    record*  i32 tag 0x31434552 ("REC1"), i32 ubatch, i32 layer, i32 n_tokens, i32 k,
             i32 seq[n_tokens], i32 pos[n_tokens], u8 modality[n_tokens] (0 text, 1 embeddings/image),
             i32 ids[n_tokens*k], f32 weights[n_tokens*k]

One record per MoE layer per ubatch, in compute order.  With substitution on (``--moe-substitute``,
docs/substitution.md), every REC1 of a managed layer is followed by the SUB1 record of the same (ubatch, layer);
with ``--moe-capacity``, every REC1 of a (ubatch, layer) whose image pairs it rerouted or dropped:

    SUB1     i32 tag 0x31425553 ("SUB1"), i32 ubatch, i32 layer, i32 n_tokens, i32 k,
             i32 exec[n_tokens*k] (the expert that ran), u8 outcome[n_tokens*k] (SUB_OUTCOMES)

:attr:`Trace.exec_ids` and :attr:`Trace.outcome` hold them; rows without a SUB1 record: exec = ids, outcome = 0.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"VISTRACE"
HEADER_BYTES = 24
REC_TAG = 0x31434552
SUB_TAG = 0x31425553
# enum llama_vis_sub_outcome of src/api/llama-vis.h, by value: what happened to one (token, expert) pair
SUB_OUTCOMES = ("resident", "substituted", "blocked_tae", "blocked_margin", "blocked_beta", "blocked_budget",
                "blocked_weight", "no_candidate", "needed_anyway", "not_eligible", "blocked_rank",
                "dropped")
_ROW_COLUMNS = ("ubatch", "layer", "seq", "pos", "modality")


class TraceError(ValueError):
    """A malformed trace, or a file that is not one."""


@dataclass
class Trace:
    n_layer: int          # layers of the model (0 if unknown)
    n_expert: int
    n_expert_used: int    # the model's top-k
    ubatch: np.ndarray    # [N] int32, ubatch (step) of each row
    layer: np.ndarray     # [N] int32, model layer index
    seq: np.ndarray       # [N] int32
    pos: np.ndarray       # [N] int32
    modality: np.ndarray  # [N] uint8 (0 text, 1 image/embeddings)
    ids: np.ndarray       # [N, k] int32, routed experts in top-k order
    weights: np.ndarray   # [N, k] float32, their gating weights (NaN when the source does not have them)
    meta: dict = field(default_factory=dict)
    exec_ids: np.ndarray | None = None   # [N, k] int32, the expert that ran for each pair (None: = ids)
    outcome: np.ndarray | None = None    # [N, k] uint8, index into SUB_OUTCOMES (None: all 0)
    phase: np.ndarray | None = None      # [N] uint8, 0 prompt (prefill), 1 generation (decode); None: a ubatch
                                         # is decode when no layer routed more than one row in it
    expert_bytes: np.ndarray | None = None  # [n_layer] int64, bytes of one routed expert per layer (0 / None: unknown)
    _routes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.ids = np.asarray(self.ids)
        if self.ids.ndim != 2:
            raise TraceError(f"trace rows hold [rows, k] expert ids; got shape {self.ids.shape}")
        n = self.ids.shape[0]
        for c in _ROW_COLUMNS:
            if len(getattr(self, c)) != n:
                raise TraceError(f"column {c} has {len(getattr(self, c))} rows for {n} rows of ids")
        if self.weights.shape != self.ids.shape:
            raise TraceError(f"weights {self.weights.shape} do not match ids {self.ids.shape}")
        if self.ids.shape[1] > self.n_expert:
            raise TraceError(f"k = {self.ids.shape[1]} > n_expert = {self.n_expert}")
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.n_expert):
            raise TraceError(f"expert ids must be in [0, {self.n_expert})")
        if self.ids.size:
            srt = np.sort(self.ids, axis=1)
            if (srt[:, 1:] == srt[:, :-1]).any():
                raise TraceError("a token selects the same expert twice in one layer")
        self.exec_ids = self.ids.astype(np.int32) if self.exec_ids is None else np.asarray(self.exec_ids, np.int32)
        self.outcome = (np.zeros(self.ids.shape, np.uint8) if self.outcome is None
                        else np.asarray(self.outcome, np.uint8))
        if self.exec_ids.shape != self.ids.shape or self.outcome.shape != self.ids.shape:
            raise TraceError(f"exec_ids {self.exec_ids.shape} / outcome {self.outcome.shape} do not match ids "
                             f"{self.ids.shape}")
        if self.exec_ids.size and (self.exec_ids.min() < 0 or self.exec_ids.max() >= self.n_expert):
            raise TraceError(f"executed expert ids must be in [0, {self.n_expert})")
        if self.outcome.size and self.outcome.max() >= len(SUB_OUTCOMES):
            raise TraceError(f"substitution outcome {int(self.outcome.max())} is not one of 0..{len(SUB_OUTCOMES) - 1}")
        self.phase = _decode_ubatches(self.ubatch, self.layer) if self.phase is None else np.asarray(self.phase, np.uint8)
        if self.phase.shape != (n,) or (n and self.phase.max() > 1):
            raise TraceError(f"phase must hold 0 (prompt) or 1 (decode) per row; got shape {self.phase.shape}")
        if self.expert_bytes is not None:
            self.expert_bytes = np.asarray(self.expert_bytes, np.int64)
            if self.expert_bytes.shape != (self.n_layer,) or (self.expert_bytes < 0).any():
                raise TraceError(f"expert_bytes must hold one size >= 0 per layer ({self.n_layer}); "
                                 f"got shape {self.expert_bytes.shape}")

    def __len__(self) -> int:
        return len(self.layer)

    @property
    def k(self) -> int:
        """Experts per row (the model's top-k, or an override the run used)."""
        return int(self.ids.shape[1])

    def layers(self) -> np.ndarray:
        """The traced layers, ascending."""
        return np.unique(self.layer)

    def for_mask(self, m: np.ndarray) -> "Trace":
        return Trace(self.n_layer, self.n_expert, self.n_expert_used, self.ubatch[m], self.layer[m], self.seq[m],
                     self.pos[m], self.modality[m], self.ids[m], self.weights[m], dict(self.meta),
                     self.exec_ids[m], self.outcome[m], self.phase[m], self.expert_bytes)

    def for_layer(self, il: int) -> "Trace":
        return self.for_mask(self.layer == il)

    def routes(self, seq: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [L, T, k], layers [L])``: the layers that routed the most rows (every token; upstream computes the
        last layer for the output rows only), their rows in trace order; only sequence ``seq`` if given."""
        if seq not in self._routes:
            t = self if seq is None else self.for_mask(self.seq == seq)
            per = {int(il): t.for_layer(int(il)).ids for il in t.layers()}
            if not per:
                raise TraceError("the trace holds no routing records" + ("" if seq is None else f" of sequence {seq}"))
            n = max(len(x) for x in per.values())
            keep = [il for il, x in per.items() if len(x) == n]
            self._routes[seq] = (np.stack([per[il] for il in keep]), np.array(keep))
        return self._routes[seq]

    @classmethod
    def from_routes(cls, ids, n_expert: int, layers=None, meta: dict | None = None) -> "Trace":
        """A trace from a matrix ``ids [L, T, k]``: token t of every layer is step (ubatch) t at position t."""
        ids = np.asarray(ids)
        if ids.ndim != 3:
            raise TraceError(f"a trace is [layers, tokens, k]; got shape {ids.shape}")
        L, T, k = ids.shape
        layers = np.arange(L) if layers is None else np.asarray(layers)
        if len(layers) != L:
            raise TraceError("layers must name every row of ids")
        steps = np.tile(np.arange(T, dtype=np.int32), L)
        return cls(int(layers.max()) + 1 if L else 0, int(n_expert), k, steps, np.repeat(layers.astype(np.int32), T),
                   np.zeros(L * T, np.int32), steps.copy(), np.zeros(L * T, np.uint8),
                   ids.reshape(L * T, k).astype(np.int32), np.full((L * T, k), np.nan, np.float32), dict(meta or {}))

    def save(self, path: str | os.PathLike) -> Path:
        """Write every column to an .npz (:func:`load` reads it back)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        dt = np.int16 if self.n_expert < 32768 else np.int32
        with open(p, "wb") as f:
            np.savez_compressed(f, ids=self.ids.astype(dt), weights=self.weights, exec_ids=self.exec_ids.astype(dt),
                                outcome=self.outcome, phase=self.phase,
                                **({} if self.expert_bytes is None else {"expert_bytes": self.expert_bytes}),
                                **{c: getattr(self, c) for c in _ROW_COLUMNS},
                                shape=np.array([self.n_layer, self.n_expert, self.n_expert_used], np.int64),
                                meta=np.array(json.dumps(self.meta)))
        return p


def parse(data: bytes, name: str = "<bytes>", progress=None) -> Trace:
    """A ``--moe-trace`` file's contents (``name`` only for messages); ``progress(bytes_done, bytes_total)`` is
    called after each record if given (``pyvis.cli.Progress`` throttles itself)."""
    if len(data) < HEADER_BYTES and MAGIC.startswith(data[:8]):
        raise TraceError(f"{name}: truncated header ({len(data)} of {HEADER_BYTES} bytes; the writer may still be "
                         "running, or the file was cut)")
    if data[:8] != MAGIC:
        raise TraceError(f"{name}: not a vis-moe routing trace (bad magic)")
    version, n_layer, n_expert, k_model = np.frombuffer(data, np.uint32, 4, 8)
    if version != 1:
        raise TraceError(f"{name}: trace version {version} is not supported (expected 1)")
    off = HEADER_BYTES
    cols: dict[str, list] = {c: [] for c in (*_ROW_COLUMNS, "ids", "weights", "exec_ids", "outcome")}
    k = int(k_model)
    prev = None   # (ubatch, layer, n_tokens, k) of the last REC1 that has no SUB1 yet
    while off < len(data):
        if off + 20 > len(data):
            raise TraceError(f"{name}: truncated record header at byte {off}")
        tag, ub, il, n, k = (int(x) for x in np.frombuffer(data, np.int32, 5, off))
        if tag == SUB_TAG:
            if prev != (ub, il, n, k):
                raise TraceError(f"{name}: SUB1 record at byte {off} (ubatch {ub}, layer {il}, {n} x {k}) does not "
                                 f"follow the REC1 of the same ubatch and layer")
            if off + 20 + n * k * 5 > len(data):
                raise TraceError(f"{name}: truncated SUB1 record at byte {off} (the writer may still be running)")
            off += 20
            cols["exec_ids"][-1] = np.frombuffer(data, np.int32, n * k, off).reshape(n, k); off += 4 * n * k
            cols["outcome"][-1] = np.frombuffer(data, np.uint8, n * k, off).reshape(n, k); off += n * k
            prev = None
            continue
        if tag != REC_TAG:
            raise TraceError(f"{name}: bad record tag at byte {off}")
        if n < 0 or k < 0:
            raise TraceError(f"{name}: bad record header at byte {off} ({n} tokens, k = {k})")
        prev = (ub, il, n, k)
        off += 20
        need = n * 4 * 2 + n + n * k * 8
        if off + need > len(data):
            raise TraceError(f"{name}: truncated record at byte {off - 20} (the writer may still be running)")
        cols["ubatch"].append(np.full(n, ub, np.int32))
        cols["layer"].append(np.full(n, il, np.int32))
        cols["seq"].append(np.frombuffer(data, np.int32, n, off)); off += 4 * n
        cols["pos"].append(np.frombuffer(data, np.int32, n, off)); off += 4 * n
        cols["modality"].append(np.frombuffer(data, np.uint8, n, off)); off += n
        cols["ids"].append(np.frombuffer(data, np.int32, n * k, off).reshape(n, k)); off += 4 * n * k
        cols["weights"].append(np.frombuffer(data, np.float32, n * k, off).reshape(n, k)); off += 4 * n * k
        cols["exec_ids"].append(cols["ids"][-1])
        cols["outcome"].append(np.zeros((n, k), np.uint8))
        if progress and off < len(data):
            progress(off, len(data))
    if progress:
        progress(len(data), len(data))
    if not cols["ids"]:
        empty = {c: np.zeros(0, np.uint8 if c == "modality" else np.int32) for c in _ROW_COLUMNS}
        return Trace(int(n_layer), int(n_expert), int(k_model), **empty, ids=np.zeros((0, k), np.int32),
                     weights=np.zeros((0, k), np.float32))
    return Trace(int(n_layer), int(n_expert), int(k_model), **{c: np.concatenate(v) for c, v in cols.items()},
                 meta={"format": "vis-moe trace v1"})


def _decode_ubatches(ubatch: np.ndarray, layer: np.ndarray) -> np.ndarray:
    """Per row: 1 when its ubatch is a decode step (no layer routed more than one row in it), else 0 (prompt)."""
    if not len(ubatch):
        return np.zeros(0, np.uint8)
    _, inv, cnt = np.unique(np.stack([ubatch, layer]), axis=1, return_inverse=True, return_counts=True)
    ub, ub_inv = np.unique(ubatch, return_inverse=True)
    most = np.zeros(len(ub), np.int64)
    np.maximum.at(most, ub_inv, cnt[inv.reshape(-1)])
    return (most[ub_inv] == 1).astype(np.uint8)


def read(path: str | os.PathLike, progress=None) -> Trace:
    """A ``--moe-trace`` file (``progress``: as for :func:`parse`)."""
    t = parse(Path(path).read_bytes(), str(path), progress)
    t.meta["source"] = str(path)
    return t


def load(path: str | os.PathLike, progress=None) -> Trace:
    """A ``--moe-trace`` file or a trace saved with :meth:`Trace.save` (``progress``: as for :func:`parse`, called
    for ``--moe-trace`` files only).  CSV route traces too: :func:`pyvis.runtime.trace_csv.load_any`."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace not found: {p}")
    with open(p, "rb") as f:
        head = f.read(16)
    if head[:8] == MAGIC:
        return read(p, progress)
    if not head.startswith(b"PK"):   # an .npz is a zip archive
        raise TraceError(f"{p}: not a routing trace: neither a --moe-trace file nor an .npz from Trace.save (a CSV "
                         f"route trace, first line '# route_trace v1': pyvis.runtime.trace_csv.load_any)")
    try:
        z = np.load(p, allow_pickle=False)
        meta = json.loads(str(z["meta"])) if "meta" in z else {}
        if "layer" not in z:   # saved before the one trace model: the matrix [layers, tokens, k]
            return Trace.from_routes(z["ids"], int(z["n_expert"]), z["layers"], meta)
        n_layer, n_expert, k = (int(x) for x in z["shape"])
        return Trace(n_layer, n_expert, k, **{c: z[c] for c in _ROW_COLUMNS}, ids=z["ids"].astype(np.int32),
                     weights=z["weights"], meta=meta, exec_ids=z["exec_ids"] if "exec_ids" in z else None,
                     outcome=z["outcome"] if "outcome" in z else None, phase=z["phase"] if "phase" in z else None,
                     expert_bytes=z["expert_bytes"] if "expert_bytes" in z else None)
    except TraceError:
        raise
    except (KeyError, ValueError, OSError) as e:
        raise TraceError(f"{p}: not a routing trace (a --moe-trace file or an .npz from Trace.save): {e}") from e


def as_decode(t: Trace) -> Trace:
    """Every token of `t` as a decode step of its own (the layers that routed every token), for traces of
    prefill-only runs such as ``llama-perplexity --moe-trace``."""
    ids, layers = t.routes()
    u = Trace.from_routes(ids, t.n_expert, layers, dict(t.meta))
    u.n_layer, u.n_expert_used = max(u.n_layer, t.n_layer), t.n_expert_used
    u.expert_bytes = t.expert_bytes
    return u
