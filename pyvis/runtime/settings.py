"""The process-wide --moe-* settings from Python, and the settings sections of :mod:`pyvis.vlm`.

The configuration of one load is :class:`pyvis.moe.MoeConfig` (:mod:`.config`), applied per call and per thread by
:func:`pyvis.runtime.config.applied`.  This module holds what is not per call:

* **process-wide** -- :func:`set_params` / :func:`set_tier_params` with the two dataclasses that mirror the two C
  settings structs, :class:`MoeParams` (expert residency, docs/residency.md) and :class:`TierParams` (paging tiers,
  docs/paging.md); the C tools' flags land there too.  Python checks that each integer fits its C field (no silent
  wrap-around); the C side checks the ranges and names the flag.
* **sections** -- :class:`MoeParams`, :class:`PrecisionParams` and :class:`CapacityParams` are the parts of a
  MoeConfig that :class:`pyvis.vlm.Session` takes separately (``MoeConfig.of(moe, precision, capacity)`` joins them);
  their fields are MoeConfig's, with the same names.
* :func:`add_arguments` mirrors flags of the C tools as argparse options (names and help from the C table).
"""
from __future__ import annotations

import ctypes
import dataclasses
import typing
from dataclasses import dataclass

from . import capi
from .config import MoeConfig, VisTypeError, check_types, flag_of
from .native import VisError, _check, fill_struct, flags

__all__ = ["VisTypeError", "MoeParams", "TierParams", "PrecisionParams", "CapacityParams", "flag_of", "get_params",
           "get_tier_params", "default_params", "tier_default_params", "set_params", "set_tier_params", "add_arguments",
           "from_args"]

_SWITCH = {-1: "auto", 0: "off", 1: "on"}
_SWITCH_IN = {"auto": -1, "off": 0, "on": 1}


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


class _Typed:
    """Base of the settings dataclasses: each field must have its annotated type (VisTypeError naming the field and
    its flag), so ``mlock='no'`` or ``slots=True`` is an error, not a silently different setting."""

    def __post_init__(self):
        check_types(self)


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



@dataclass(frozen=True)
class CapacityParams(_Typed):
    """Entropy-weighted capacity (lossy; docs/precision.md): image pairs over a layer's capacity of missing experts
    rerouted to experts in memory.  Values as the flags take them."""
    capacity: int | str = "off"          # off | auto | N
    cap_rho: float = 1.0                 # adaptation strength
    cap_delta: float = 1.0               # entropy sensitivity of the image tokens' weights
    cap_drop: bool = True                # drop a pair without a reroute target (CPU), else load its expert
    cap_profile: str | None = None       # modality profile (pyvis calibrate modality)



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


USER_SWITCHES = ("mem", "mode")   # --moe-mem and --moe-mode: the C tools' user switches, on the pyvis commands that run


def add_user_switches(parser) -> None:
    """--moe-mem and --moe-mode (the C table's help text) in a group of their own, into ``args.moe_mem`` /
    ``args.moe_mode``."""
    group = parser.add_argument_group("memory budget and mode (docs/planning.md, docs/mode.md; the C tools' flags)")
    add_arguments(group, MoeConfig, list(USER_SWITCHES))


def user_switches(args) -> dict:
    """{field: value} of the switches :func:`add_user_switches` added that were given other than their defaults
    (a switch left at its default is not given: the environment's VIS_MOE_* value stays in force)."""
    default = MoeConfig()
    return {n: getattr(args, f"moe_{n}") for n in USER_SWITCHES
            if getattr(args, f"moe_{n}", getattr(default, n)) != getattr(default, n)}


def from_args(cls: type, args, names: list[str] | None = None):
    """A MoeParams / TierParams from the ``args.moe_<field>`` options :func:`add_arguments` added (others: defaults)."""
    names = names if names is not None else [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: getattr(args, f"moe_{n}") for n in names if hasattr(args, f"moe_{n}")})
