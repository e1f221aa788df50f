"""The expert cache's configuration as one typed object: :class:`MoeConfig`, applied per call and per thread.

One field per row of the C settings table (src/api/vis-moe-settings-table.cpp; ``llama_vis_moe_get_flag``): the field
``pinned_layers`` is the flag ``--moe-pinned-layers`` and the variable ``VIS_MOE_PINNED``, and so on.  Its type
follows the row's value type (``LLAMA_VIS_MOE_VALUE_*``: a switch is a bool, ``auto|N`` is ``int | str``, a file is
``str | None``) and its default is the table's built-in default; tests/test_config.py holds the class to the table.

    from pyvis.moe import MoeConfig, load
    llm = load("model.gguf", MoeConfig(mem="auto", pinned_layers=1), n_ctx=2048)

The fields you pass are applied; the others keep the value in force, as a tool's flags do: the VIS_MOE_* variable if
one is set (docs/knobs.md), else the default shown here.  Values are checked strictly: an unknown field is a
TypeError, a value of the wrong type a :class:`VisTypeError` and a value the C parser refuses a :class:`VisError`,
each naming the field and its flag.

:func:`applied` is the one way a configuration reaches C: ``with applied(MoeConfig(slots=8)): ...`` makes models
loaded and contexts created on this thread inside the block use it (``llama_vis_moe_thread_set``), then gives the
thread back exactly what it had, read back through ``llama_vis_moe_get_value`` (no copy kept here).  Other threads are
not affected.  :func:`pyvis.moe.load` and :mod:`pyvis.vlm` use it.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import numbers
import os
import re
import typing
from dataclasses import dataclass

from . import capi
from .native import VisError, last_error


def flag_of(field: str) -> str:
    """The --moe-* flag of a field: "--moe-" + field with '-' for '_'."""
    return "--moe-" + field.replace("_", "-")


def field_of(flag: str) -> str:
    return flag.removeprefix("--moe-").replace("-", "_")


class VisTypeError(VisError, TypeError):
    """A setting of the wrong type: a VisError like every bad setting, and a TypeError."""


_TYPE_NAMES = {int: "an integer", bool: "True or False", float: "a number", str: "a string", type(None): "None"}


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


def _type_name(ann) -> str:
    args = typing.get_args(ann)
    return " or ".join(_type_name(a) for a in args) if args else _TYPE_NAMES[ann]


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_types(obj) -> None:
    """VisTypeError naming the field and its flag for a field of a settings dataclass without its annotated type."""
    for name, ann in _hints(type(obj)).items():
        if not name.startswith("_") and not _type_ok(getattr(obj, name), ann):
            raise VisTypeError(f"{name} ({flag_of(name)}) must be {_type_name(ann)}, got {getattr(obj, name)!r}")


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """Every --moe-* setting (docs/knobs.md, docs/residency.md, docs/paging.md and the pages named below)."""
    # ---- user flags: what the tools' --help lists ----
    slots: int = 0                       # expert slots per managed MoE layer (0 = off unless mem / cache_mib)
    pinned_layers: int = 0               # first N MoE layers fully resident (-1 = all)
    mem: int | str = "off"               # process memory budget: MiB, "auto" (the real limit) or "off"
    stats: bool = False                  # print per-layer cache stats when the context is freed
    trace: str | None = None             # routing trace file
    csv: str | None = None               # one telemetry row per ubatch (docs/telemetry.md)
    mode: str = "exact"                  # exact | fast (lossy; docs/mode.md)
    substitute: str | None = None        # off | router | buddy | drop | auto; None = not given (docs/substitution.md)
    predict: str = "off"                 # off | next-router | coact | freq | mlp | random | auto (docs/prediction.md)
    predict_profile: str | None = None   # pyvis calibrate predictor
    shadow: str | None = None            # shadow-expert sidecar (pyvis shadow; docs/precision.md)
    precision: str = "off"               # off | vision | gate | all | auto
    topk: int = 0                        # experts each token runs (lossy; 0 = the model's k; docs/topk.md)
    capacity: int | str = "off"          # off | auto | N (lossy, image tokens; docs/precision.md)
    # ---- engine knobs (docs/knobs.md) ----
    policy: str = "lfu-adapt"            # lru | lfu | lfu-adapt
    cache_mib: int = 0                   # slab budget in MiB instead of a slot count
    store: str = "file"                  # file | model
    host_mib: int | str = "auto"         # tier-2 host cache, MiB (auto = planned by mem, else 0)
    io_threads: int = 4
    direct_io: str = "auto"              # auto | on | off
    unified: str = "auto"                # auto | on | off
    mlock: bool = True
    pin_mib: int | str = "auto"          # discrete GPU: pinned host memory cap, MiB, auto or off
    stream_passes: int = 8               # prefill streaming threshold (0 = never)
    stream_ahead: bool = False
    stream_lend: str = "auto"            # auto | on | off
    stream_stage: bool = True
    overlap: int | str = "on"            # on | off | N: decode misses read while the layer computes (docs/paging.md)
    sub_profile: str | None = None       # buddy lists (pyvis calibrate buddies)
    sub_tae: str = "off"                 # off | TAU in 0..1 | pN
    sub_margin: float | str = "off"      # off | G in 0..1
    sub_beta: float = 1.0
    sub_budget: int = 1
    sub_weight: float = 1.0
    sub_rank: int = 0                    # only the token's N lowest-ranked experts (0 = any)
    sub_drop_share: float = 0.5          # drop: only experts whose share is < this x 1/k
    sub_renorm: bool = False
    sub_drop_read: bool = True
    sub_prefill: bool = False
    prec_vision: float = 0.5
    prec_gate: float = 0.1
    prec_target: float = 0.25
    prec_refetch: bool = True
    shadow_slots: int | str = "auto"     # shadow slots per managed layer (auto = as many as full slots)
    cap_rho: float = 1.0
    cap_delta: float = 1.0
    cap_drop: bool = True
    cap_profile: str | None = None       # modality profile (pyvis calibrate modality)
    lookahead: int = 1
    prefetch_budget: int | str = "auto"  # experts read ahead per layer and step (auto = top-k)
    prefetch_tune: bool = True

    def __init__(self, **kw):
        unknown = sorted(set(kw) - set(_FIELDS))
        if unknown:
            raise TypeError(f"MoeConfig has no field {', '.join(map(repr, unknown))} (fields: {', '.join(_FIELDS)})")
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, kw.get(f.name, f.default))
        object.__setattr__(self, "_given", frozenset(kw))
        check_types(self)

    @property
    def given(self) -> frozenset:
        """The fields given when the config was made: those applied (the others keep the value in force).
        ``dataclasses.replace`` gives every field; :meth:`replace` only the old ones and the new."""
        return self._given

    def replace(self, **kw) -> "MoeConfig":
        """A copy with these fields changed (and given)."""
        return MoeConfig(**{**{n: getattr(self, n) for n in self.given}, **kw})

    def flags(self, every: bool = False) -> list[tuple[str, str | None]]:
        """(flag, value as the flag takes it) of each given field (``every``: of every field); value None: unset (no
        file, --moe-substitute not given)."""
        return [(flag_of(n), spell(getattr(self, n))) for n in _FIELDS if every or n in self.given]

    @classmethod
    def of(cls, *sections) -> "MoeConfig":
        """A config giving every field of these settings dataclasses, whose fields are MoeConfig's (the sections of
        :mod:`pyvis.vlm`: MoeParams, PrecisionParams, CapacityParams); None is skipped."""
        return cls(**{f.name: getattr(s, f.name) for s in sections if s is not None for f in dataclasses.fields(s)})

    @classmethod
    def current(cls) -> "MoeConfig":
        """The settings in force on the calling thread (its override, else the process-wide ones: the environment and
        the tools' flags), every field given."""
        return cls(**{n: _read(n, 0) for n in _FIELDS})

    @classmethod
    def builtin(cls) -> "MoeConfig":
        """The C table's built-in defaults (every field given): equal to ``MoeConfig()``."""
        return cls(**{n: _read(n, 1) for n in _FIELDS})


_FIELDS = [f.name for f in dataclasses.fields(MoeConfig)]


def spell(v) -> str | None:
    """A field's value as its flag takes it: True -> "on", 8 -> "8", 0.5 -> "0.5", a path -> str; None -> None."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Real):
        return repr(float(v))
    return os.fspath(v)


def _read(field: str, builtin: int):
    """A field's value from C (llama_vis_moe_get_value), typed as the field: "" -> None, "on" -> True, "8" -> 8."""
    raw = capi.llama_vis_moe_get_value(flag_of(field).encode(), builtin)
    if raw is None:
        raise VisError(last_error())
    text = raw.decode()
    ann = _hints(MoeConfig)[field]
    kinds = set(typing.get_args(ann)) or {ann}
    if text == "":
        return None
    if bool in kinds:
        return text == "on"
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                pass
    return text


def _raise_named(msg: str, fields: list[str]):
    """VisError naming the fields (and flags) the C message names."""
    named = [field_of(f) for f in dict.fromkeys(re.findall(r"--moe-[a-z-]+", msg)) if field_of(f) in _FIELDS]
    names = ", ".join(named or fields)
    raise VisError(f"MoeConfig {names}: {msg}")


def _set_thread(config: MoeConfig, every: bool = False) -> None:
    pairs = config.flags(every)
    flags = (ctypes.c_char_p * len(pairs))(*[f.encode() for f, _ in pairs])
    values = (ctypes.c_char_p * len(pairs))(*[None if v is None else v.encode() for _, v in pairs])
    if capi.llama_vis_moe_thread_set(len(pairs), flags, values) != 0:
        _raise_named(last_error() or "llama_vis_moe_thread_set failed", sorted(config.given))


@contextlib.contextmanager
def applied(config: MoeConfig):
    """Within the block, models loaded and contexts created on this thread use ``config`` (its given fields; the
    others as in force before).  After it the thread has exactly what it had before: its own override if it had one
    (read back from C), else none (it follows the process-wide settings again, including changes made meanwhile).
    The config is checked on entry (VisError naming the field); on success the thread's last error is clear, so an
    error read after a failed load or context creation inside the block belongs to it."""
    if not isinstance(config, MoeConfig):
        raise VisTypeError(f"expected a pyvis.moe.MoeConfig, got {type(config).__name__}")
    previous = MoeConfig.current() if capi.llama_vis_moe_thread_params_active() else None
    if previous is not None:
        # the outer block's values for the fields this one does not give
        config = previous.replace(**{n: getattr(config, n) for n in config.given})
    _set_thread(config)
    try:
        yield
    finally:
        if previous is not None:
            _set_thread(previous, every=True)
        else:
            capi.llama_vis_moe_set_thread_params(None, None)
