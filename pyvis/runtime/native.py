"""ctypes bindings for the fork's own C API (src/llama-vis.h), in one place.

They use the very library handle llama-cpp-python loaded, so pointers from
`llama_cpp` (models, contexts) can be passed straight in.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .. import _paths

_paths.configure_native_env()
_paths.lib_dir()  # clear error if the build is missing

import llama_cpp  # noqa: E402  (after the env is set)
from llama_cpp import llama_cpp as _ll  # noqa: E402

_lib = _ll._lib


class llama_vis_moe_info(ctypes.Structure):
    _fields_ = [
        ("n_layer", ctypes.c_int32),
        ("n_moe_layers", ctypes.c_int32),
        ("first_moe_layer", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("n_expert_shared", ctypes.c_int32),
        ("has_shared_exp", ctypes.c_int32),
        ("has_exp_bias", ctypes.c_int32),
        ("has_gate_up_exp", ctypes.c_int32),
        ("expert_bytes", ctypes.c_int64),
        ("routed_bytes", ctypes.c_int64),
    ]


def _bind(name: str, argtypes: list, restype):
    try:
        fn = getattr(_lib, name)
    except AttributeError as e:
        raise RuntimeError(
            f"{name} is missing from {_paths.lib_dir()}: this libllama is not a vis-moe build "
            "(or an old one). Rebuild with scripts/setup.sh.") from e
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_version = _bind("llama_vis_version", [], ctypes.c_char_p)
_upstream = _bind("llama_vis_upstream_commit", [], ctypes.c_char_p)
_sysinfo = _bind("llama_vis_system_info", [], ctypes.c_char_p)
_moe_info = _bind("llama_vis_model_moe_info", [ctypes.c_void_p, ctypes.POINTER(llama_vis_moe_info)], ctypes.c_int32)


def version() -> str:
    return _version().decode()


def upstream_commit() -> str:
    return _upstream().decode()


def system_info_fragment() -> str:
    return _sysinfo().decode()


@dataclass(frozen=True)
class MoeInfo:
    n_layer: int
    n_moe_layers: int
    first_moe_layer: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    has_shared_exp: bool
    has_exp_bias: bool
    has_gate_up_exp: bool
    expert_bytes: int
    routed_bytes: int


def moe_info(model) -> MoeInfo:
    """MoE shape of a loaded model (a `llama_cpp.Llama`, or a raw llama_model pointer)."""
    ptr = getattr(model, "model", model)          # llama_cpp.Llama -> pointer
    ptr = getattr(ptr, "model", ptr)              # _internals.LlamaModel -> pointer
    info = llama_vis_moe_info()
    if _moe_info(ptr, ctypes.byref(info)) != 0:
        raise ValueError("llama_vis_model_moe_info: NULL model")
    return MoeInfo(**{name: (bool(getattr(info, name)) if name.startswith("has_") else int(getattr(info, name)))
                      for name, _ in llama_vis_moe_info._fields_})


__all__ = ["llama_cpp", "version", "upstream_commit", "system_info_fragment", "moe_info", "MoeInfo"]


# ---------------------------------------------------------------------------
# expert residency (src/vis-moe-cache.cpp)
# ---------------------------------------------------------------------------
class llama_vis_moe_params(ctypes.Structure):
    _fields_ = [
        ("n_slots", ctypes.c_int32),
        ("cache_mib", ctypes.c_int64),
        ("n_pinned", ctypes.c_int32),
        ("print_stats", ctypes.c_int32),
        ("trace_path", ctypes.c_char_p),
    ]


class llama_vis_moe_stats(ctypes.Structure):
    _fields_ = [
        ("n_slots", ctypes.c_int32),
        ("managed", ctypes.c_int32),
        ("n_routed", ctypes.c_int64),
        ("n_hits", ctypes.c_int64),
        ("n_misses", ctypes.c_int64),
        ("bytes_loaded", ctypes.c_int64),
        ("load_us", ctypes.c_int64),
        ("n_calls", ctypes.c_int64),
        ("n_passes", ctypes.c_int64),
    ]


_moe_default = _bind("llama_vis_moe_default_params", [], llama_vis_moe_params)
_moe_set = _bind("llama_vis_moe_set_params", [ctypes.POINTER(llama_vis_moe_params)], ctypes.c_int32)
_last_error = _bind("llama_vis_last_error", [], ctypes.c_char_p)
_moe_stats = _bind("llama_vis_moe_get_stats", [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(llama_vis_moe_stats)],
                   ctypes.c_int32)
_moe_reset = _bind("llama_vis_moe_reset_stats", [ctypes.c_void_p], None)
_moe_n_managed = _bind("llama_vis_moe_n_managed", [ctypes.c_void_p], ctypes.c_int32)
_moe_print = _bind("llama_vis_moe_print_stats", [ctypes.c_void_p], None)


class VisError(RuntimeError):
    """A configuration or runtime error reported by the fork (llama_vis_last_error)."""


def last_error() -> str:
    return (_last_error() or b"").decode()


@dataclass(frozen=True)
class MoeParams:
    """Expert-residency settings (the --moe-* flags). See docs/residency.md."""
    slots: int = 0            # slots per managed MoE layer (0 = off unless cache_mib)
    cache_mib: int = 0        # alternative: total slab budget in MiB
    pinned_layers: int = 0    # first N MoE layers fully resident (-1 = all)
    stats: bool = False       # print stats when the context is freed
    trace: str | None = None  # routing trace file

    def to_c(self) -> llama_vis_moe_params:
        return llama_vis_moe_params(self.slots, self.cache_mib, self.pinned_layers, int(self.stats),
                                    self.trace.encode() if self.trace else None)


def moe_set_params(p: MoeParams | None) -> None:
    """Set the residency parameters for contexts created from now on (None: defaults)."""
    c = p.to_c() if p is not None else None
    if _moe_set(ctypes.byref(c) if c is not None else None) != 0:
        raise VisError(last_error())


def moe_default_params() -> MoeParams:
    c = _moe_default()
    return MoeParams(c.n_slots, c.cache_mib, c.n_pinned, bool(c.print_stats),
                     c.trace_path.decode() if c.trace_path else None)


@dataclass(frozen=True)
class MoeStats:
    n_slots: int
    managed: bool
    n_routed: int
    n_hits: int
    n_misses: int
    bytes_loaded: int
    load_us: int
    n_calls: int
    n_passes: int

    @property
    def hit_rate(self) -> float:
        return self.n_hits / self.n_routed if self.n_routed else 0.0


def _ctx_ptr(ctx):
    ptr = getattr(ctx, "ctx", ctx)        # llama_cpp.Llama -> _internals.LlamaContext
    ptr = getattr(ptr, "ctx", ptr)        # LlamaContext -> pointer
    return ptr


def moe_stats(ctx, layer: int = -1) -> MoeStats | None:
    """Stats of one layer, or totals (layer=-1); None if the context has no expert cache."""
    s = llama_vis_moe_stats()
    if _moe_stats(_ctx_ptr(ctx), layer, ctypes.byref(s)) != 0:
        return None
    return MoeStats(s.n_slots, bool(s.managed), s.n_routed, s.n_hits, s.n_misses, s.bytes_loaded, s.load_us,
                    s.n_calls, s.n_passes)


def moe_reset_stats(ctx) -> None:
    _moe_reset(_ctx_ptr(ctx))


def moe_n_managed(ctx) -> int:
    return int(_moe_n_managed(_ctx_ptr(ctx)))


def moe_print_stats(ctx) -> None:
    _moe_print(_ctx_ptr(ctx))


# ---------------------------------------------------------------------------
# paging tiers, memory probe and planner (src/vis-moe-store.cpp, src/vis-moe-plan.cpp)
# ---------------------------------------------------------------------------
class llama_vis_moe_tier_params(ctypes.Structure):
    _fields_ = [
        ("store", ctypes.c_int32),
        ("host_mib", ctypes.c_int64),
        ("mem_mib", ctypes.c_int64),
        ("io_threads", ctypes.c_int32),
        ("direct_io", ctypes.c_int32),
        ("unified", ctypes.c_int32),
        ("mlock", ctypes.c_int32),
    ]


class llama_vis_moe_io_stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "slab_hits", "host_hits", "file_reads", "model_copies", "bytes_read", "bytes_storage", "read_us",
        "host_bytes", "host_used", "host_evictions", "slab_bytes")] + [
        (n, ctypes.c_int32) for n in ("direct_io", "unified", "locked", "io_threads")] + [
        ("major_faults", ctypes.c_int64), ("rss_peak", ctypes.c_int64), ("streamed", ctypes.c_int64),
        ("bytes_streamed", ctypes.c_int64)]


class llama_vis_mem_info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "mem_total", "mem_available", "swap_total", "swap_free", "zram_bytes", "cgroup_limit", "cgroup_usage")] + [
        ("cgroup_version", ctypes.c_int32)] + [(n, ctypes.c_int64) for n in (
        "rss", "rss_peak", "major_faults", "limit", "available")]


class llama_vis_moe_plan_request(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("budget", "resident_bytes", "kv_bytes", "reserve_bytes", "expert_bytes")] + [
        (n, ctypes.c_int32) for n in ("n_managed_layers", "n_expert", "n_expert_used", "unified")] + [
        ("device_bytes", ctypes.c_int64), ("host_mib", ctypes.c_int64), ("n_slots", ctypes.c_int32),
        ("no_staging", ctypes.c_int32)]


class llama_vis_moe_plan(ctypes.Structure):
    _fields_ = [("ok", ctypes.c_int32), ("n_slots", ctypes.c_int32)] + [(n, ctypes.c_int64) for n in (
        "slab_bytes", "host_bytes", "budget", "fixed_bytes", "min_budget", "file_only_bytes", "tight_budget",
        "pageable_bytes")]


_tier_default = _bind("llama_vis_moe_tier_default_params", [], llama_vis_moe_tier_params)
_tier_get = _bind("llama_vis_moe_get_tier_params", [], llama_vis_moe_tier_params)
_tier_set = _bind("llama_vis_moe_set_tier_params", [ctypes.POINTER(llama_vis_moe_tier_params)], ctypes.c_int32)
_io_stats = _bind("llama_vis_moe_get_io_stats", [ctypes.c_void_p, ctypes.POINTER(llama_vis_moe_io_stats)], ctypes.c_int32)
_mem_probe = _bind("llama_vis_mem_probe", [ctypes.POINTER(llama_vis_mem_info)], ctypes.c_int32)
_plan = _bind("llama_vis_moe_plan", [ctypes.POINTER(llama_vis_moe_plan_request), ctypes.POINTER(llama_vis_moe_plan)],
              ctypes.c_int32)

_SWITCH = {-1: "auto", 0: "off", 1: "on"}
_SWITCH_IN = {"auto": -1, "off": 0, "on": 1, False: 0, True: 1, None: -1}


@dataclass(frozen=True)
class TierParams:
    """Paging-tier settings (the --moe-store/-host-mib/-mem/-io-threads/-direct-io/-unified/-mlock flags).
    See docs/paging.md."""
    store: str = "file"              # "file": managed experts read from the GGUF on demand; "model": loaded by llama.cpp
    host_mib: int = -1               # tier-2 host cache in MiB; -1 = planned by mem (else 0)
    mem: int | str = 0               # process memory budget in MiB, "auto", or 0 = off
    io_threads: int = 4
    direct_io: str = "auto"          # auto | on | off
    unified: str = "auto"            # auto | on | off
    mlock: bool = True

    def to_c(self) -> llama_vis_moe_tier_params:
        mem = -1 if self.mem == "auto" else int(self.mem)
        return llama_vis_moe_tier_params(1 if self.store == "model" else 0, int(self.host_mib), mem, int(self.io_threads),
                                         _SWITCH_IN[self.direct_io], _SWITCH_IN[self.unified], int(bool(self.mlock)))

    @staticmethod
    def from_c(c: llama_vis_moe_tier_params) -> "TierParams":
        return TierParams("model" if c.store == 1 else "file", c.host_mib, "auto" if c.mem_mib == -1 else c.mem_mib,
                          c.io_threads, _SWITCH[c.direct_io], _SWITCH[c.unified], bool(c.mlock))


def tier_params() -> TierParams:
    return TierParams.from_c(_tier_get())


def tier_default_params() -> TierParams:
    return TierParams.from_c(_tier_default())


def set_tier_params(p: TierParams | None) -> None:
    """Set the paging-tier parameters for models loaded and contexts created from now on (None: defaults)."""
    if p is not None and p.store not in ("file", "model"):
        raise VisError(f"store must be 'file' or 'model', got {p.store!r}")
    c = p.to_c() if p is not None else None
    if _tier_set(ctypes.byref(c) if c is not None else None) != 0:
        raise VisError(last_error())


def _struct_dict(s) -> dict:
    return {name: int(getattr(s, name)) for name, _ in s._fields_}


def io_stats(ctx) -> dict | None:
    """Per-tier stats of a context (slab/host hits, file reads, bytes, I/O wait, peak RSS); None without a cache."""
    s = llama_vis_moe_io_stats()
    if _io_stats(_ctx_ptr(ctx), ctypes.byref(s)) != 0:
        return None
    return _struct_dict(s)


def mem_probe() -> dict:
    """What this machine gives us: MemTotal/MemAvailable, swap, zram, cgroup v1/v2 limit and usage, RSS."""
    m = llama_vis_mem_info()
    _mem_probe(ctypes.byref(m))
    return _struct_dict(m)


def plan(**request) -> dict:
    """llama_vis_moe_plan: split a budget over resident weights, KV, compute, slabs and the host cache.
    Keys of llama_vis_moe_plan_request; returns the plan as a dict with 'ok' and, if not ok, 'error'."""
    rq = llama_vis_moe_plan_request()
    defaults = dict(reserve_bytes=-1, host_mib=-1, unified=1)
    for k, v in {**defaults, **request}.items():
        setattr(rq, k, int(v))
    out = llama_vis_moe_plan()
    if _plan(ctypes.byref(rq), ctypes.byref(out)) != 0:
        raise VisError(last_error())
    d = _struct_dict(out)
    d["ok"] = bool(d["ok"])
    if not d["ok"]:
        d["error"] = last_error()
    return d
# visual-token pruning (issue #4): encoder saliency, layer limit, routing capture
# C API: src/llama-vis.h; code: src/vis-mtmd-saliency.cpp, src/vis-moe-capture.cpp;
# semantics: docs/vlm-native-api.md
# ---------------------------------------------------------------------------
import contextlib as _contextlib  # noqa: E402

import numpy as _np  # noqa: E402

_sal_enable = _bind("llama_vis_mtmd_saliency_enable", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)
_sal_get = _bind("llama_vis_mtmd_get_saliency", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int32],
                 ctypes.c_int32)
_sal_get_raw = _bind("llama_vis_mtmd_get_saliency_raw",
                     [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int32], ctypes.c_int32)
_set_layer_limit = _bind("llama_vis_set_layer_limit", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)
_get_layer_limit = _bind("llama_vis_get_layer_limit", [ctypes.c_void_p], ctypes.c_int32)
_capture = _bind("llama_vis_moe_capture", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)
_capture_reset = _bind("llama_vis_moe_capture_reset", [ctypes.c_void_p], None)
_get_routes = _bind("llama_vis_moe_get_routes",
                    [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int32)
_routes_k = _bind("llama_vis_moe_routes_k", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)


def _mtmd_ptr(mctx):
    """An mtmd_context pointer (c_void_p / int) or an object holding one in .ctx; None stays None."""
    if mctx is None:
        return None
    return getattr(mctx, "ctx", mctx)


def saliency_enable(mctx, n_layers: int = 1) -> None:
    """Ask the vision encoder for per-token saliency ("attention received").

    mctx: an mtmd_context pointer (from ``llama_cpp.mtmd_cpp.mtmd_init_from_file``), or None
    for the process-wide default of every mtmd context. n_layers: 0 = off (encoder graph
    unchanged), k = average over the last k encoder layers. Takes effect at the next encode.
    """
    if _sal_enable(_mtmd_ptr(mctx), int(n_layers)) != 0:
        raise VisError(last_error())


def mtmd_saliency(mctx, raw: bool = False) -> "_np.ndarray":
    """Saliency of the last image chunk encoded by mctx: float32 [n_image_tokens].

    Normalised to [0, 1] (min-max), or with raw=True the mean attention each token
    receives (sums to 1 / merge factor). Raises VisError when the last encode had
    saliency off, failed, or its projector has no saliency support.
    """
    fn = _sal_get_raw if raw else _sal_get
    p = _mtmd_ptr(mctx)
    n = fn(p, None, 0)
    if n < 0:
        raise VisError(last_error())
    out = _np.zeros(n, dtype=_np.float32)
    if n:
        fn(p, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
    return out


def set_layer_limit(ctx, n_layers: int) -> None:
    """Evaluate only the first n_layers layers in the following llama_decode calls (0 = off).

    No logits are produced under a limit, and the KV cells of the decoded tokens stay taken:
    remove them with ``llama_memory_seq_rm`` before the real decode. Raises VisError for a
    bad n_layers or an unsupported architecture.
    """
    if _set_layer_limit(_ctx_ptr(ctx), int(n_layers)) != 0:
        raise VisError(last_error())


def get_layer_limit(ctx) -> int:
    return int(_get_layer_limit(_ctx_ptr(ctx)))


@_contextlib.contextmanager
def layer_limit(ctx, n_layers: int):
    """``with layer_limit(ctx, L): llama_decode(...)`` - the limit is restored to its old value after."""
    old = get_layer_limit(ctx)
    set_layer_limit(ctx, n_layers)
    try:
        yield
    finally:
        set_layer_limit(ctx, old)


def moe_capture(ctx, on: bool = True) -> None:
    """Start (clearing earlier captures) or stop (freeing them) the in-memory routing capture."""
    if _capture(_ctx_ptr(ctx), int(bool(on))) != 0:
        raise VisError(last_error())


def moe_capture_reset(ctx) -> None:
    """Drop the captured routes; capture stays on."""
    _capture_reset(_ctx_ptr(ctx))


def moe_routes(ctx, layer: int) -> "_np.ndarray":
    """Routed expert ids of one layer since the last reset: int32 [n_rows, k], rows in ubatch order.

    Empty ([0, 0]) for a layer without experts or not evaluated. In a full decode the last
    layer only routes the output rows.
    """
    p = _ctx_ptr(ctx)
    k = _routes_k(p, int(layer))
    if k < 0:
        raise VisError(last_error())
    n = _get_routes(p, int(layer), None, 0)
    if n < 0:
        raise VisError(last_error())
    out = _np.zeros((n, k), dtype=_np.int32)
    if n and k:
        _get_routes(p, int(layer), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n * k)
    return out


__all__ += ["saliency_enable", "mtmd_saliency", "set_layer_limit", "get_layer_limit", "layer_limit",
            "moe_capture", "moe_capture_reset", "moe_routes", "VisError"]
