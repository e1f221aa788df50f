"""The grid of ``pyvis substitute-sweep``: configurations (``MODE[:KEY=VALUE,...]``), points (``MODEL@K``),
settings (a point at a cache size) and the llama-perplexity command line of one run.  The study itself:
:mod:`pyvis.testbed.substitute_sweep`."""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from . import quality
from .sweep_parse import SweepError

DEFAULT_POINTS = ["shared+16@4", "shared+16@8", "shared+64@16"]
DEFAULT_FRACTIONS = [0.5, 0.75]
DEFAULT_CONFIGS = ["off", "router", "router:tae=p50", "router:tae=p90", "router:tae=p99", "router:wrel=1",
                   "router:budget=2", "buddy"]
CONFIG_KEYS = {"tae", "margin", "beta", "budget", "weight", "wrel", "rank", "share", "renorm", "read"}
MODES = ("off", "router", "buddy", "drop", "auto")


# --------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class SubConfig:
    """One substitution rule. ``spec`` is ``MODE[:KEY=VALUE[,KEY=VALUE...]]``; keys: tae (off, TAU or pN),
    margin, beta, budget, rank (--moe-sub-rank), weight (the --moe-sub-weight share), wrel (the share as a
    multiple of 1/k: ``wrel=1`` substitutes only experts below the token's mean share), and for ``drop``: share
    (--moe-sub-drop-share), renorm (on|off, --moe-sub-renorm) and read (on|off,
    --moe-sub-drop-read)."""
    spec: str
    mode: str
    opts: tuple = ()          # ((key, value), ...) in the order given

    @property
    def options(self) -> dict:
        return dict(self.opts)

    def needs_profile(self) -> bool:
        return self.mode == "buddy" or str(self.options.get("tae", "")).startswith("p")

    def side_key(self, point: "Point") -> tuple | None:
        """The file this rule's flags need at a point, as a key the sweep makes or finds once: ``("profile",
        model, k)`` for a buddy profile, None for none (precision rules: a shadow, :mod:`.sweep_precision`)."""
        return ("profile", point.model, point.k) if self.needs_profile() else None

    def flags(self, k: int, profile: str | None = None) -> list[str]:
        """The --moe-sub* flags of this rule at top-k (profile: the buddy profile of the model at k)."""
        o = self.options
        a = ["--moe-substitute", self.mode]
        if self.mode == "off":
            return a
        if self.needs_profile():
            if not profile:
                raise SweepError(f"{self.spec}: needs a buddy profile (VIS_MOE_SUB_PROFILE)")
            a += ["--moe-sub-profile", str(profile)]
        if "tae" in o:
            a += ["--moe-sub-tae", o["tae"]]
        if "margin" in o:
            a += ["--moe-sub-margin", o["margin"]]
        if "beta" in o:
            a += ["--moe-sub-beta", o["beta"]]
        if "budget" in o:
            a += ["--moe-sub-budget", o["budget"]]
        if "rank" in o:
            a += ["--moe-sub-rank", o["rank"]]
        if "weight" in o:
            a += ["--moe-sub-weight", o["weight"]]
        if "wrel" in o:
            a += ["--moe-sub-weight", _fmt(min(1.0, float(o["wrel"]) / k))]
        if "share" in o:
            a += ["--moe-sub-drop-share", o["share"]]
        if "renorm" in o:
            a += ["--moe-sub-renorm", o["renorm"]]
        if "read" in o:
            a += ["--moe-sub-drop-read", o["read"]]
        return a


def _fmt(x: float) -> str:
    return f"{x:.9g}"


def parse_config(spec: str) -> SubConfig:
    """A substitution rule ``MODE[:KEY=VALUE,...]`` or a precision rule ``prec:RULE[:KEY=VALUE,...]``
    (:func:`pyvis.testbed.sweep_precision.parse_prec_config`)."""
    spec = spec.strip()
    mode, _, rest = spec.partition(":")
    if mode == "prec":
        from .sweep_precision import parse_prec_config
        return parse_prec_config(spec)
    if mode not in MODES:
        raise SweepError(f"configuration {spec!r}: mode must be one of {', '.join(MODES)}, or prec:RULE for "
                         "the precision policy (prec:all:type=Q4_0, prec:gate=0.1:type=Q4_0)")
    opts = []
    if rest:
        if mode == "off":
            raise SweepError(f"configuration {spec!r}: off takes no options")
        for item in rest.split(","):
            key, eq, val = item.partition("=")
            key, val = key.strip(), val.strip()
            if not eq or key not in CONFIG_KEYS or not val:
                raise SweepError(f"configuration {spec!r}: expected KEY=VALUE with KEY in "
                                 f"{', '.join(sorted(CONFIG_KEYS))}, got {item!r}")
            if key == "tae":
                if val != "off" and not re.fullmatch(r"p?[0-9]*\.?[0-9]+", val):
                    raise SweepError(f"configuration {spec!r}: tae is off, TAU (0..1) or pN (0..100)")
            elif key == "budget":
                if not val.isdigit() or int(val) < 1:
                    raise SweepError(f"configuration {spec!r}: budget is a positive integer")
            elif key == "rank":
                if not val.isdigit():
                    raise SweepError(f"configuration {spec!r}: rank is an integer >= 0 (0 = any)")
            elif key == "margin" and val == "off":
                pass
            elif key in ("renorm", "read"):
                if val not in ("on", "off"):
                    raise SweepError(f"configuration {spec!r}: {key} is on or off")
            else:
                try:
                    float(val)
                except ValueError:
                    raise SweepError(f"configuration {spec!r}: {key} must be a number, got {val!r}") from None
            if "weight" in (key, *(k for k, _ in opts)) and "wrel" in (key, *(k for k, _ in opts)):
                raise SweepError(f"configuration {spec!r}: give weight or wrel, not both")
            opts.append((key, val))
    return SubConfig(spec, mode, tuple(opts))


@dataclass(frozen=True)
class Point:
    name: str        # as given: PRESET or path
    model: str       # GGUF path
    k: int

    @property
    def label(self) -> str:
        return f"{Path(self.model).stem} k={self.k}"


def resolve_model(name: str) -> str:
    """A testbed preset name (models/testbed/NAME.gguf) or a GGUF path."""
    from .moefy import PRESETS, default_out_dir
    if name in PRESETS:
        return str(default_out_dir() / f"{name}.gguf")
    return name


def parse_point(spec: str) -> Point:
    name, at, k = spec.rpartition("@")
    if not at or not name or not k.isdigit() or int(k) < 1:
        raise SweepError(f"point {spec!r}: expected MODEL@K (a preset such as shared+16, or a GGUF path; K >= 1)")
    return Point(name, resolve_model(name), int(k))


@dataclass(frozen=True)
class Setting:
    point: Point
    n_expert: int
    fraction: float
    slots: int

    @property
    def label(self) -> str:
        return f"{self.point.label} S={self.slots}/{self.n_expert}"

    def key(self) -> str:
        return f"{self.point.model}@{self.point.k}/S{self.slots}"


def n_expert_of(model: str) -> int:
    import gguf
    if not Path(model).is_file():
        raise SweepError(f"model not found: {model}")
    r = gguf.GGUFReader(model)
    arch = str(r.fields["general.architecture"].contents())
    f = r.fields.get(f"{arch}.expert_count")
    if f is None:
        raise SweepError(f"{model}: not a MoE ({arch}.expert_count missing)")
    return int(f.contents())


def slots_for(fraction: float, n_expert: int) -> int:
    if not 0 < fraction <= 1:
        raise SweepError(f"cache fraction {fraction}: expected 0 < f <= 1")
    return max(1, int(math.floor(fraction * n_expert + 0.5)))


def expand(points: list[Point], fractions: list[float], n_expert: dict[str, int] | None = None) -> list[Setting]:
    out = []
    for p in points:
        e = (n_expert or {}).get(p.model) or n_expert_of(p.model)
        if p.k > e:
            raise SweepError(f"{p.name}@{p.k}: k is larger than the model's {e} experts")
        for f in fractions:
            out.append(Setting(p, e, f, slots_for(f, e)))
    return out


def check_scored(ctx: int, chunks: int | None) -> None:
    """llama-perplexity prints its KL statistics only over >= 100 scored tokens (the second half of each
    chunk, less the last: ctx - 1 - ctx/2 per chunk)."""
    if chunks is not None and chunks * (ctx - 1 - ctx // 2) < 100:
        raise SweepError(f"-c {ctx} x {chunks} chunks scores {chunks * (ctx - 1 - ctx // 2)} tokens; "
                         "llama-perplexity prints KL statistics only from 100: use more chunks or a larger -c")


# --------------------------------------------------------------------------
# command lines
# --------------------------------------------------------------------------
def _overrides(point: Point) -> list[str]:
    return [f"{quality.model_arch(point.model)}.expert_used_count=int:{point.k}"]


def run_args(setting: Setting, cfg: SubConfig, ctx: int, threads: int | None, store: str,
             side: str | None = None) -> list[str]:
    """llama-perplexity's arguments for one run, without the text / KL arguments: decode regime (-ub 1,
    -b CTX), --moe-slots S, --moe-store STORE, --moe-stats, and the rule's flags (``side``: the file they need,
    a buddy profile or a shadow sidecar)."""
    a = quality._base_args(quality.Config(setting.point.model, _overrides(setting.point)), ctx, threads, ctx)
    a += ["-ub", "1", "--moe-slots", str(setting.slots), "--moe-store", store, "--moe-stats"]
    return a + cfg.flags(setting.point.k, side)


def _cmdline(a: list[str]) -> str:
    root = str(Path.cwd()) + "/"
    return " ".join(shlex.quote(x[len(root):] if x.startswith(root) else x) for x in a)
