"""What ``pyvis moefy`` builds (:mod:`pyvis.testbed.moefy`): :class:`MoefySpec`, its presets and its checks
against a dense model.  The builder's steps (:mod:`.partition`, :mod:`.writer`) take a spec; this module
depends on none of them."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from .dense import MoefyError

BUILDER_VERSION = 1


# --------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------
@dataclass
class MoefySpec:
    n_expert: int = 16
    n_shared: int = 512              # shared (always-on) neurons; 0: none
    n_expert_used: int = 8           # default k written into the file
    dense_layers: int = 1            # leading layers kept dense
    partition: str = "kmeans"        # kmeans | random
    top_frac: float = 0.10           # "top 10 % contributions" for shared selection
    calib_tokens: int = 24576        # calibration tokens (chunks of calib_ctx)
    calib_ctx: int = 512
    profile_tokens: int = 8192       # tokens used for the clustering profiles
    kmeans_iters: int = 30
    ridge: float = 1e-2              # ridge strength, relative to mean eigenvalue of X^T X
    router_scale: float = 1e-4       # 99th percentile of the per-token spread of router logits
    router_target: str = "lognorm"   # what the router predicts: lognorm | norm (of each expert's output)
    outtype: str = "F32"             # weights: F32 | F16 (norms stay F32)
    keep_quant: bool = False         # copy non-FFN quantised tensors as they are (not exact vs dense)
    n_layers: int | None = None      # keep only the first n layers (tests); None: all
    val_frac: float = 0.125          # share of calibration chunks held out for the FFN-error stats
    seed: int = 0

    def key(self) -> str:
        d = asdict(self)
        d["_v"] = BUILDER_VERSION
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


PRESETS: dict[str, dict] = {
    # 512 always-on neurons + 16 routed experts of 64 neurons (1024/16)
    "shared+16": dict(n_expert=16, n_shared=512, n_expert_used=8),
    # finer grained, closer to modern MoEs: 512 shared + 64 experts of 16 neurons.  Default top-24:
    # stock llama.cpp's graph (2 nodes per selected expert, max(1024, 8 * n_tensors) nodes) aborts
    # at k >= 32 for this 30-layer model
    "shared+64": dict(n_expert=64, n_shared=512, n_expert_used=24),
    # coarse Mixtral-style: no shared neurons, 8 experts of 192 neurons (written with one all-zero
    # shared expert, because llama.cpp's deepseek loader requires the shared tensors)
    "mixtral8": dict(n_expert=8, n_shared=0, n_expert_used=2),
}


def preset(name: str, **overrides) -> MoefySpec:
    if name not in PRESETS:
        raise MoefyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return MoefySpec(**kw)


def check_spec(spec: MoefySpec, n_ff: int, n_layer: int) -> None:
    if spec.n_expert < 1:
        raise MoefyError(f"n_expert must be >= 1 (got {spec.n_expert})")
    if not 0 <= spec.n_shared < n_ff:
        raise MoefyError(f"n_shared must be in [0, {n_ff}) (got {spec.n_shared})")
    routed = n_ff - spec.n_shared
    if routed % spec.n_expert:
        raise MoefyError(f"{routed} routed neurons ({n_ff} - {spec.n_shared} shared) do not divide into "
                         f"{spec.n_expert} equal experts (llama.cpp needs equal expert sizes)")
    m = routed // spec.n_expert
    if spec.n_shared % m:
        raise MoefyError(f"{spec.n_shared} shared neurons are not a multiple of the expert size {m}: the "
                         "deepseek layout stores the shared block as n_expert_shared experts of that size")
    if not 1 <= spec.n_expert_used <= spec.n_expert:
        raise MoefyError(f"n_expert_used must be in [1, {spec.n_expert}] (got {spec.n_expert_used})")
    nl = spec.n_layers or n_layer
    if not 1 <= nl <= n_layer:
        raise MoefyError(f"n_layers must be in [1, {n_layer}] (got {spec.n_layers})")
    if not 0 <= spec.dense_layers < nl:
        raise MoefyError(f"dense_layers must be in [0, {nl}) so that at least one layer is MoE")
    if spec.partition not in ("kmeans", "random"):
        raise MoefyError(f"partition must be kmeans or random (got {spec.partition!r})")
    if spec.outtype.upper() not in ("F32", "F16"):
        raise MoefyError(f"outtype must be F32 or F16 (got {spec.outtype!r})")
