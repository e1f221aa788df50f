"""Precision rules in ``pyvis substitute-sweep`` (issue #14; docs/precision.md, docs/precision-study.md).

A configuration ``prec:RULE[:KEY=VALUE[,KEY=VALUE...]]`` runs the model with a shadow sidecar
(``--moe-shadow FILE``) and the precision policy ``--moe-precision RULE``: a miss the rule allows runs from its
low-bit shadow while the full-precision expert is read in the background.  Grammar (strict):

    RULE   all | vision | gate[=W] | auto        (gate: W is --moe-prec-gate, default 0.1)
    KEY    type=T         the shadow type (required): Q4_0, IQ4_NL, Q5_0, Q8_0, Q2_K, ...
           gate=W         auto only: --moe-prec-gate W (0..1; gate takes it in the rule: gate=W)
           target=S       auto only: --moe-prec-target S (0..1)
           vision=S       vision and auto: --moe-prec-vision S (0..1)
           slots=auto|N   --moe-shadow-slots
           refetch=on|off --moe-prec-refetch

e.g. ``prec:all:type=Q4_0``, ``prec:gate=0.05:type=Q8_0``, ``prec:auto:type=Q4_0,target=0.1``.

The shadow of (model, type) is made once with :func:`pyvis.runtime.shadow.write_shadow` (what ``pyvis shadow``
runs) and cached under ``models/testbed/shadows/`` (or ``$VIS_SHADOW_DIR``) as ``MODEL.shadow-TYPE.gguf``; a file
there is reused while it reads as a shadow of that model (fingerprint and shapes) and is not older than the model,
so ``pyvis shadow MODEL --type T --out models/testbed/shadows/MODEL.shadow-T.gguf`` fills the cache too.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .sweep_parse import SweepError

PREC_RULES = ("all", "vision", "gate", "auto")
PREC_KEYS = ("type", "gate", "target", "vision", "slots", "refetch")
DEFAULT_PREC_GATE = "0.1"          # --moe-prec-gate's default
_REAL = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?")


@dataclass(frozen=True)
class PrecConfig:
    """One precision rule (see the module docstring).  Has the interface of
    :class:`pyvis.testbed.sweep_grid.SubConfig` that the sweep uses: ``spec``, ``mode`` (``"prec"``),
    ``options``, ``needs_profile``, ``side_key`` (the shadow it needs) and ``flags``."""
    spec: str
    rule: str
    type: str
    opts: tuple = ()          # ((key, value), ...) in the order given, the gate of gate=W included
    mode: str = "prec"

    @property
    def options(self) -> dict:
        return dict(self.opts)

    def needs_profile(self) -> bool:
        return False

    def side_key(self, point) -> tuple:
        return ("shadow", point.model, self.type)

    def flags(self, k: int, shadow: str | None = None) -> list[str]:
        """The flags of this rule (``shadow``: the sidecar of the model in this type); substitution stays off."""
        if not shadow:
            raise SweepError(f"{self.spec}: needs a shadow sidecar (--moe-shadow) of type {self.type}")
        o = self.options
        a = ["--moe-substitute", "off", "--moe-shadow", str(shadow), "--moe-precision", self.rule]
        if self.rule in ("gate", "auto"):
            a += ["--moe-prec-gate", o.get("gate", DEFAULT_PREC_GATE)]
        for key, flag in (("target", "--moe-prec-target"), ("vision", "--moe-prec-vision"),
                          ("slots", "--moe-shadow-slots"), ("refetch", "--moe-prec-refetch")):
            if key in o:
                a += [flag, o[key]]
        return a


def is_prec(cfg) -> bool:
    """A precision rule (a PrecConfig or its spec)?"""
    return (cfg.mode if hasattr(cfg, "mode") else str(cfg).split(":", 1)[0]) == "prec"


def _real01(spec: str, key: str, val: str) -> str:
    if not _REAL.fullmatch(val) or not 0 <= float(val) <= 1:
        raise SweepError(f"configuration {spec!r}: {key} must be a number in 0..1, got {val!r}")
    return val


def parse_prec_config(spec: str) -> PrecConfig:
    """``prec:RULE[:KEY=VALUE,...]`` (module docstring); SweepError naming the part that is wrong."""
    from ..runtime.ggml_quant import QUANT_TYPES
    spec = spec.strip()
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] != "prec" or not parts[1]:
        raise SweepError(f"configuration {spec!r}: expected prec:RULE[:KEY=VALUE,...] with RULE in "
                         f"{', '.join(PREC_RULES)} (gate=W for a gate threshold), e.g. prec:gate=0.1:type=Q4_0")
    rule, eq, w = parts[1].partition("=")
    if rule not in PREC_RULES:
        raise SweepError(f"configuration {spec!r}: precision rule must be one of {', '.join(PREC_RULES)}, got {rule!r}")
    opts: list[tuple[str, str]] = []
    if eq:
        if rule != "gate":
            raise SweepError(f"configuration {spec!r}: only gate takes a value in the rule (gate=W), not {rule}")
        opts.append(("gate", _real01(spec, "gate", w)))
    items = parts[2].split(",") if len(parts) == 3 else []
    for item in items:
        key, eq, val = (x.strip() for x in item.partition("="))
        if not eq or key not in PREC_KEYS or not val:
            raise SweepError(f"configuration {spec!r}: expected KEY=VALUE with KEY in {', '.join(PREC_KEYS)}, "
                             f"got {item!r}")
        if key in (k for k, _ in opts):
            raise SweepError(f"configuration {spec!r}: {key} is given twice")
        if key == "type":
            val = val.upper()
            if val not in QUANT_TYPES:
                raise SweepError(f"configuration {spec!r}: type must be a quantized ggml type "
                                 f"({', '.join(QUANT_TYPES)}), got {val!r}")
        elif key == "gate":
            if rule != "auto":
                raise SweepError(f"configuration {spec!r}: the gate key is for auto; write the gate rule as "
                                 "prec:gate=W:type=T")
            _real01(spec, key, val)
        elif key == "target":
            if rule != "auto":
                raise SweepError(f"configuration {spec!r}: target is for the auto rule only")
            _real01(spec, key, val)
        elif key == "vision":
            if rule not in ("vision", "auto"):
                raise SweepError(f"configuration {spec!r}: vision is for the vision and auto rules only")
            _real01(spec, key, val)
        elif key == "slots":
            if val != "auto" and not (val.isdigit() and int(val) >= 1):
                raise SweepError(f"configuration {spec!r}: slots is auto or an integer >= 1, got {val!r}")
        elif key == "refetch" and val not in ("on", "off"):
            raise SweepError(f"configuration {spec!r}: refetch is on or off, got {val!r}")
        opts.append((key, val))
    typ = dict(opts).get("type")
    if not typ:
        raise SweepError(f"configuration {spec!r}: say which shadow to run from: add type=T, e.g. "
                         f"prec:{parts[1]}:type=Q4_0")
    return PrecConfig(spec, rule, typ, tuple((k, v) for k, v in opts if k != "type"))


# --------------------------------------------------------------------------
# the shadow cache
# --------------------------------------------------------------------------
def shadow_dir() -> Path:
    env = os.environ.get("VIS_SHADOW_DIR")
    if env:
        return Path(env)
    from .moefy import default_out_dir
    return default_out_dir() / "shadows"


def shadow_path(model: str, type_name: str) -> Path:
    return shadow_dir() / f"{Path(model).stem}.shadow-{type_name}.gguf"


def ensure_shadow(model: str, type_name: str, threads: int | None = None, progress=None) -> tuple[Path, dict]:
    """The shadow of ``model`` in ``type_name`` (made with pyvis shadow's writer unless a valid one is cached);
    returns (file, info: sizes, ratio, seconds, whether it was made now).  SweepError with the writer's message
    when the type does not fit the model (e.g. Q2_K on rows of 576 values)."""
    from ..runtime import ggml_quant as gq
    from ..runtime import profile as prof
    from ..runtime import shadow as sh
    if not Path(model).is_file():
        raise SweepError(f"model not found: {model}")
    out = shadow_path(model, type_name)
    made, t0 = False, time.monotonic()
    sf = None
    if out.is_file() and out.stat().st_mtime >= Path(model).stat().st_mtime:
        try:
            sf = sh.read_shadow(out, model)
        except prof.ProfileError as e:
            # moved aside, not deleted (the writer never overwrites a file that is not a vis profile)
            bad = out.with_name(out.name + ".bad")
            if progress:
                progress(f"cached shadow {out} is not usable ({str(e).splitlines()[0]}): moved to {bad.name}, "
                         "writing it again")
            os.replace(out, bad)
            sf = None
        if sf is not None and sf.type != type_name:
            sf = None
    if sf is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if progress:
            progress(f"writing the {type_name} shadow of {Path(model).name} to {out}")
        try:
            sh.write_shadow(model, type_name, out, "all", 0, max(1, threads or os.cpu_count() or 1))
        except (prof.ProfileError, gq.QuantError) as e:
            raise SweepError(f"no {type_name} shadow of {Path(model).name}: {e}") from None
        sf = sh.read_shadow(out, model)
        made = True
    mib = float(1 << 20)
    info = {"shadow": str(out), "type": sf.type, "layers": len(sf.layers), "shadow_mib": sf.shadow_bytes / mib,
            "model_mib": sf.model_bytes / mib, "ratio": sf.shadow_bytes / max(1, sf.model_bytes), "made": made,
            "seconds": time.monotonic() - t0,
            "command": f"pyvis shadow {model} --type {type_name} --out {out} -t {threads or os.cpu_count() or 1}"}
    return out, info


# --------------------------------------------------------------------------
# table fields of a precision run
# --------------------------------------------------------------------------
def prec_fields(run: dict, prefix: str = "") -> dict:
    """From a run's parsed ``--moe-stats`` (``cache`` and ``prec``): the share of the misses that ran from
    shadows (shadow / (shadow + full-precision misses); shadow-served experts are not in the cache table), the
    share of all expert uses (full precision or shadow, per layer and ubatch; (token, expert) pairs at ``-ub 1``)
    that ran from shadows, the shadow MiB read on the critical path, the MiB saved, and the background re-reads
    (refetch, estimated in MiB at the layer's expert size).  Empty for a run without a precision table."""
    p, c = run.get("prec"), run.get("cache") or {}
    if not p:
        return {}
    missing = p.get("shadow", 0) + c.get("misses", 0)
    uses = p.get("shadow", 0) + c.get("routed", 0)       # experts run per layer and ubatch: pairs at -ub 1
    out = {"shadow_share": p.get("shadow", 0) / missing if missing else 0.0, "eligible": p.get("eligible"),
           "shadow_use_share": p.get("shadow", 0) / uses if uses else 0.0,
           "shadow": p.get("shadow"), "shadow_pairs": p.get("pairs"), "shadow_mib": p.get("mib_read"),
           "mib_saved": p.get("mib_saved"), "refetch": p.get("refetch"), "shadow_stall_ms": p.get("stall_ms")}
    if p.get("refetch") is not None and c.get("misses") and c.get("mib_loaded") is not None:
        out["refetch_mib"] = p["refetch"] * c["mib_loaded"] / c["misses"]
    return {prefix + k: v for k, v in out.items()}
