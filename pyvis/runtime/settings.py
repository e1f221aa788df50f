"""The --moe-* settings from Python: typed, checked, and applied per call and per thread.

Two dataclasses mirror the two C settings structs: :class:`MoeParams` (expert residency, docs/residency.md)
and :class:`TierParams` (paging tiers, docs/paging.md).  A third, :class:`SubParams` (substitution on a miss,
docs/substitution.md), has no C struct: its fields are handed to the C table as flag strings
(``llama_vis_moe_thread_apply``), so the C parser checks them and names the flag.  Each field is one --moe-* flag of the C settings
table (``llama_vis_moe_get_flag``; src/vis-moe-settings.cpp): the field ``pinned_layers`` is
``--moe-pinned-layers``, ``mem`` is ``--moe-mem``, and so on (:func:`flag_of`).  Python checks that each
integer fits its C field (no silent wrap-around); the C side checks the ranges of the flags and names them.

Where settings apply, two layers, as in the C API:

* **per call, per thread** -- :func:`applied`: ``with applied(MoeParams(slots=8)): ...`` makes models
  loaded and contexts created on this thread inside the block use these settings, then gives the thread
  back exactly what it had (its own earlier override, or none).  Other threads are not affected.
  :func:`pyvis.moe.load` and :mod:`pyvis.vlm` use it.
* **process-wide** -- :func:`set_params` / :func:`set_tier_params` (the C tools' flags land here).

:func:`add_arguments` mirrors flags of the C tools as argparse options (names and help from the C table).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import numbers
import os
import threading
import typing
from dataclasses import dataclass

from . import capi
from .native import VisError, _check, fill_struct, flags

__all__ = ["VisTypeError", "MoeParams", "TierParams", "SubParams", "PredictParams", "PrecisionParams", "CapacityParams", "TopkParams", "TelemetryParams", "ModeParams", "flag_of", "get_params", "get_tier_params", "default_params",
           "tier_default_params", "set_params", "set_tier_params", "applied", "add_arguments", "from_args"]

_SWITCH = {-1: "auto", 0: "off", 1: "on"}
_SWITCH_IN = {"auto": -1, "off": 0, "on": 1}


def flag_of(field: str) -> str:
    """The --moe-* flag of a MoeParams / TierParams field: "--moe-" + field with '-' for '_'."""
    return "--moe-" + field.replace("_", "-")


def _label(py_names: dict[str, str]):
    """Error label of a C struct field: its Python field and flag ("slots (--moe-slots)")."""
    return lambda c_field: f"{py_names[c_field]} ({flag_of(py_names[c_field])})"


def _switch(field: str, v) -> int:
    """auto | on | off (or a bool) -> -1 | 1 | 0."""
    if isinstance(v, bool):
        return int(v)
    if v not in _SWITCH_IN:
        raise VisError(f"{field} ({flag_of(field)}) must be auto, on or off, got {v!r}")
    return _SWITCH_IN[v]


def _type_ok(v, ann) -> bool:
    """Does ``v`` have the annotated type?  bool is not an int or float here (``slots=True`` is a mistake), an int is
    a float, and a path-like is a str (file names)."""
    if ann is type(None):
        return v is None
    if ann is bool:
        return isinstance(v, bool)
    if ann is int:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if ann is float:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)
    if ann is str:
        return isinstance(v, (str, os.PathLike))
    return any(_type_ok(v, a) for a in typing.get_args(ann))


_TYPE_NAMES = {int: "an integer", bool: "True or False", float: "a number", str: "a string", type(None): "None"}


def _type_name(ann) -> str:
    args = typing.get_args(ann)
    if args:
        return " or ".join(_type_name(a) for a in args)
    return _TYPE_NAMES[ann]


class VisTypeError(VisError, TypeError):
    """A setting of the wrong type: a VisError like every bad setting, and a TypeError."""


class _Typed:
    """Base of the settings dataclasses: each field must have its annotated type (VisTypeError naming the field and
    its flag), so ``mlock='no'`` or ``slots=True`` is an error, not a silently different setting."""

    def __post_init__(self):
        for name, ann in typing.get_type_hints(type(self)).items():
            if name.startswith("_"):
                continue
            v = getattr(self, name)
            if not _type_ok(v, ann):
                raise VisTypeError(f"{name} ({flag_of(name)}) must be {_type_name(ann)}, got {v!r}")


@dataclass(frozen=True)
class MoeParams(_Typed):
    """Expert-residency settings (docs/residency.md)."""
    slots: int = 0            # slots per managed MoE layer (0 = off unless cache_mib)
    cache_mib: int = 0        # alternative: total slab budget in MiB
    pinned_layers: int = 0    # first N MoE layers fully resident (-1 = all)
    stats: bool = False       # print stats when the context is freed
    trace: str | None = None  # routing trace file

    _C = {"n_slots": "slots", "cache_mib": "cache_mib", "n_pinned": "pinned_layers"}   # C field -> field

    def to_c(self) -> capi.llama_vis_moe_params:
        c = fill_struct(capi.llama_vis_moe_params(), {cf: getattr(self, pf) for cf, pf in self._C.items()},
                        _label(self._C))
        c.print_stats = int(bool(self.stats))
        c.trace_path = str(self.trace).encode() if self.trace else None
        return c

    @classmethod
    def from_c(cls, c: capi.llama_vis_moe_params) -> "MoeParams":
        return cls(c.n_slots, c.cache_mib, c.n_pinned, bool(c.print_stats),
                   c.trace_path.decode() if c.trace_path else None)


@dataclass(frozen=True)
class TierParams(_Typed):
    """Paging-tier settings (docs/paging.md)."""
    store: str = "file"              # "file": managed experts read from the GGUF on demand; "model": loaded by llama.cpp
    host_mib: int = -1               # tier-2 host cache in MiB; -1 = planned by mem (else 0)
    mem: int | str = 0               # process memory budget in MiB, "auto", or 0 / "off"
    io_threads: int = 4
    direct_io: str = "auto"          # auto | on | off
    unified: str = "auto"            # auto | on | off
    mlock: bool = True

    _C = {"host_mib": "host_mib", "mem_mib": "mem", "io_threads": "io_threads"}              # C field -> field

    def to_c(self) -> capi.llama_vis_moe_tier_params:
        if self.store not in ("file", "model"):
            raise VisError(f"store ({flag_of('store')}) must be 'file' or 'model', got {self.store!r}")
        mem = {"auto": -1, "off": 0}.get(self.mem, self.mem) if isinstance(self.mem, str) else self.mem
        c = fill_struct(capi.llama_vis_moe_tier_params(),
                        {"host_mib": self.host_mib, "mem_mib": mem, "io_threads": self.io_threads}, _label(self._C))
        c.store = int(self.store == "model")
        c.direct_io, c.unified = _switch("direct_io", self.direct_io), _switch("unified", self.unified)
        c.mlock = int(bool(self.mlock))
        return c

    @classmethod
    def from_c(cls, c: capi.llama_vis_moe_tier_params) -> "TierParams":
        return cls("model" if c.store == 1 else "file", c.host_mib, "auto" if c.mem_mib == -1 else c.mem_mib,
                   c.io_threads, _SWITCH[c.direct_io], _SWITCH[c.unified], bool(c.mlock))


@dataclass(frozen=True)
class SubParams(_Typed):
    """Substitution on a miss (lossy; docs/substitution.md).  Values as the flags take them."""
    substitute: str | None = None    # off | router | buddy | drop | auto; None = not given (off, or --moe-mode's)
    sub_profile: str | None = None   # buddy lists (pyvis calibrate buddies)
    sub_tae: str = "off"             # off | TAU in 0..1 | pN
    sub_margin: str = "off"          # off | G in 0..1
    sub_beta: float = 1.0
    sub_budget: int = 1
    sub_weight: float = 1.0
    sub_rank: int = 0                # only the token's N lowest-ranked experts (0 = any)
    sub_prefill: bool = False
    sub_drop_share: float = 0.5      # drop: only experts whose share is < this x 1/k
    sub_renorm: bool = False         # drop: scale the remaining weights back to their sum
    sub_drop_read: bool = True       # drop: read the dropped expert in the background

    def flags(self) -> list[tuple[str, str]]:
        """(flag, value) pairs for the C table; every field (substitute and the profile only when given), so a
        block's settings replace the thread's."""
        return _table_flags(self, optional=("sub_profile", "substitute"))


@dataclass(frozen=True)
class PredictParams(_Typed):
    """Lookahead prediction and prefetch (exact; docs/prediction.md).  Values as the flags take them."""
    predict: str = "off"                 # off | next-router | coact | freq | mlp | random | auto
    lookahead: int = 1                   # W: layers l+1 .. l+W
    prefetch_budget: int | str = "auto"  # B: experts read ahead per layer and step (auto = top-k)
    prefetch_tune: bool = True           # self-tuning: a layer that wastes more than it uses pauses
    predict_profile: str | None = None   # seeds coact / freq; mlp needs one fitted with --mlp (pyvis calibrate predictor)

    def flags(self) -> list[tuple[str, str]]:
        """(flag, value) pairs for the C table; every field, so a block's settings replace the thread's."""
        return _table_flags(self, optional=("predict_profile",))


@dataclass(frozen=True)
class PrecisionParams(_Typed):
    """Shadow experts and the precision policy (lossy; docs/precision.md): the sidecar of ``pyvis shadow`` and when a
    miss may run from it.  Values as the flags take them."""
    shadow: str | None = None            # --moe-shadow FILE
    precision: str = "off"               # off | vision | gate | all | auto
    prec_vision: float = 0.5             # image-token share at which a ubatch is vision-dominated
    prec_gate: float = 0.1               # gate rule: largest gate weight below which a decode miss may
    prec_target: float = 0.25            # auto: the stall share the controller aims below
    prec_refetch: bool = True            # read the full expert of a shadow-served miss in the background
    shadow_slots: int | str = "auto"     # shadow slots per managed layer (auto = as many as full slots)

    def flags(self) -> list[tuple[str, str]]:
        """(flag, value) pairs for the C table; every field (the sidecar only when given), so a block's settings
        replace the thread's."""
        return _table_flags(self, optional=("shadow",))


@dataclass(frozen=True)
class CapacityParams(_Typed):
    """Entropy-weighted capacity (lossy; docs/precision.md): image pairs over a layer's capacity of missing experts
    rerouted to experts in memory.  Values as the flags take them."""
    capacity: int | str = "off"          # off | auto | N
    cap_rho: float = 1.0                 # adaptation strength
    cap_delta: float = 1.0               # entropy sensitivity of the image tokens' weights
    cap_drop: bool = True                # drop a pair without a reroute target (CPU), else load its expert
    cap_profile: str | None = None       # modality profile (pyvis calibrate modality)

    def flags(self) -> list[tuple[str, str]]:
        """(flag, value) pairs for the C table; every field (the profile only when given)."""
        return _table_flags(self, optional=("cap_profile",))


@dataclass(frozen=True)
class TopkParams(_Typed):
    """Fewer experts per token (lossy; docs/topk.md): each token runs its ``topk`` highest-weighted experts instead
    of the model's k (0 = off), exactly as upstream with ``expert_used_count`` overridden."""
    topk: int = 0

    def flags(self) -> list[tuple[str, str]]:
        return _table_flags(self)


@dataclass(frozen=True)
class TelemetryParams(_Typed):
    """Telemetry (docs/telemetry.md): ``csv``, a file that gets one row per ubatch (time, compute and read-wait ms,
    hits, misses by tier, bytes read, lossy events), as --moe-csv; never a model or another input."""
    csv: str | None = None

    def flags(self) -> list[tuple[str, str]]:
        return _table_flags(self, optional=("csv",))


@dataclass(frozen=True)
class ModeParams(_Typed):
    """One switch (docs/mode.md): ``exact`` (the model's output) or ``fast`` (lossy: the measured set of lossy
    mechanisms, each unless chosen explicitly; the run logs what it turned on)."""
    mode: str = "exact"

    def flags(self) -> list[tuple[str, str]]:
        return _table_flags(self)


def _table_flags(params, optional: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """The fields of a settings class without a C struct as (flag, value) strings for llama_vis_moe_thread_apply;
    `optional` fields are left out when None."""
    out = []
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if f.name in optional:
            if v is None:
                continue
            v = str(v)
        elif isinstance(v, bool):
            v = "on" if v else "off"
        elif isinstance(v, (int, float)):
            v = repr(v)
        out.append((flag_of(f.name), str(v)))
    return out


# ---------------------------------------------------------------------------
# getters and process-wide setters
# ---------------------------------------------------------------------------
def get_params() -> MoeParams:
    """Residency settings in force on the calling thread (its override, else the process-wide ones)."""
    return MoeParams.from_c(capi.llama_vis_moe_get_params())


def get_tier_params() -> TierParams:
    """Tier settings in force on the calling thread (its override, else the process-wide ones)."""
    return TierParams.from_c(capi.llama_vis_moe_get_tier_params())


def default_params() -> MoeParams:
    """The environment's residency settings (VIS_MOE_*), else everything off."""
    return MoeParams.from_c(capi.llama_vis_moe_default_params())


def tier_default_params() -> TierParams:
    return TierParams.from_c(capi.llama_vis_moe_tier_default_params())


def _ref(c):
    return ctypes.byref(c) if c is not None else None


def set_params(p: MoeParams | None) -> None:
    """Process-wide residency settings for contexts created from now on (None: the environment's)."""
    _check(capi.llama_vis_moe_set_params(_ref(p.to_c() if p is not None else None)), "llama_vis_moe_set_params")


def set_tier_params(p: TierParams | None) -> None:
    """Process-wide tier settings for models loaded and contexts created from now on (None: the environment's)."""
    _check(capi.llama_vis_moe_set_tier_params(_ref(p.to_c() if p is not None else None)),
           "llama_vis_moe_set_tier_params")


# ---------------------------------------------------------------------------
# per call and thread
# ---------------------------------------------------------------------------
def _set_thread(moe: MoeParams | None, tier: TierParams | None) -> None:
    m, t = (moe.to_c() if moe else None), (tier.to_c() if tier else None)
    _check(capi.llama_vis_moe_set_thread_params(_ref(m), _ref(t)), "llama_vis_moe_set_thread_params")


_thread_table = threading.local()  # this thread's innermost applied() block's SubParams / PredictParams (C has no getter)


def _apply_table(params) -> None:
    for flag, value in params.flags():
        _check(capi.llama_vis_moe_thread_apply(flag.encode(), value.encode()), "llama_vis_moe_thread_apply")


@contextlib.contextmanager
def applied(moe: MoeParams | None = None, tier: TierParams | None = None, sub: SubParams | None = None,
            predict: PredictParams | None = None, precision: PrecisionParams | None = None,
            capacity: CapacityParams | None = None, topk: TopkParams | None = None,
            telemetry: TelemetryParams | None = None, mode: ModeParams | None = None):
    """Within the block, models loaded and contexts created on this thread use ``moe``, ``tier``, ``sub``,
    ``predict``, ``precision``, ``capacity``, ``topk`` and ``mode`` (None: the settings in force on the thread now).  After it the thread has exactly what it had
    before: its own override if it had one, else none (it follows the process-wide settings again, including
    changes made meanwhile).  The settings are checked on entry (VisError); on success the thread's last error is
    clear, so an error read after a failed load or context creation inside the block belongs to it."""
    previous = (get_params(), get_tier_params()) if capi.llama_vis_moe_thread_params_active() else None
    prev = getattr(_thread_table, "value", None) or {}
    now = dict(prev)
    for cls, p in ((SubParams, sub), (PredictParams, predict), (PrecisionParams, precision), (CapacityParams, capacity),
                   (TopkParams, topk), (TelemetryParams, telemetry), (ModeParams, mode)):
        if p is not None:
            now[cls] = p
    _set_thread(moe or get_params(), tier or get_tier_params())
    try:
        for p in now.values():   # a kind not given inside a block that set one: the outer block's
            _apply_table(p)
        _thread_table.value = now
        yield
    finally:
        _thread_table.value = prev
        if previous is not None:
            _set_thread(*previous)
            for p in prev.values():
                _apply_table(p)
        else:
            _set_thread(None, None)


# ---------------------------------------------------------------------------
# command-line options mirrored from the C tools
# ---------------------------------------------------------------------------
_BOOL_IN = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False}


def _parse(cls, field: str):
    """argparse type of a field: its annotation decides (int; str; bool as on|off; int | str for --moe-mem)."""
    ann = typing.get_type_hints(cls)[field]
    if ann in (str, str | None):
        return str
    if ann is int:
        return int
    if ann is float:
        return float
    if ann is bool:
        def on_off(s: str) -> bool:
            if s not in _BOOL_IN:
                raise ValueError(s)
            return _BOOL_IN[s]
        return on_off

    def int_or_word(s: str):                   # --moe-mem: MIB, auto or off (TierParams checks the word)
        try:
            return int(s)
        except ValueError:
            return s
    return int_or_word


def add_arguments(group, cls: type, names: list[str]) -> None:
    """Add the --moe-* options of these fields of ``cls`` (a settings dataclass) to an argparse group, with the
    C tools' help text; the values land in ``args.moe_<field>`` (defaults: the dataclass's)."""
    rows = {f.name: f for f in flags()}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name in names:
        row = rows[flag_of(name)]
        kw = dict(dest=f"moe_{name}", default=defaults[name], help=row.help.replace("\n", " ").replace("%", "%%"))
        if row.value_hint is None:
            group.add_argument(row.name, action="store_true", **kw)
        else:
            group.add_argument(row.name, metavar=row.value_hint, type=_parse(cls, name), **kw)


def from_args(cls: type, args, names: list[str] | None = None):
    """A MoeParams / TierParams from the ``args.moe_<field>`` options :func:`add_arguments` added (others: defaults)."""
    names = names if names is not None else [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: getattr(args, f"moe_{n}") for n in names if hasattr(args, f"moe_{n}")})
