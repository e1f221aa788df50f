"""The memory plan of `pyvis plan` (its command line: plan_cli.py): how a model would be split across the memory
tiers on this machine.

Reads only the GGUF header (no weights) and asks the same C functions the
runtime uses for `--moe-mem` (src/plan/vis-moe-plan.cpp): `llama_vis_mem_probe`
(cgroup v1/v2 limit, MemAvailable, swap, zram), `llama_vis_moe_estimate_reserve`
(compute buffers) and `llama_vis_moe_plan`, so the plan is the runtime's.
See docs/paging.md.
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
_I32 = (1 << 31) - 1
_MAX_MIB = ((1 << 63) - 1) // MIB

# the ranges of make_plan's arguments: (lo, hi, the CLI option, note); argparse checks the options with them
RANGES = {
    "budget_mib": (1, _MAX_MIB, "--budget", " MiB (or auto)"),
    "n_ctx": (1, _I32, "-c/--ctx-size", ""),
    "n_ubatch": (1, _I32, "-ub/--ubatch-size", ""),
    "pinned": (-1, _I32, "--pinned", " (-1 = all)"),
    "slots": (0, None, "--slots", " (0 = planned)"),           # None: the runtime's limit (_max_slots)
    "host_mib": (-1, _MAX_MIB, "--host-mib", " (-1 = planned)"),
    "device_mib": (1, _MAX_MIB, "--device-mib", ""),
    "image_max_tokens": (1, _I32, "--image-max-tokens", " (or -1 = the projector's limit)"),
    "n_threads": (1, 4096, "-t/--threads", ""),
}


def _max_slots() -> int:
    """The runtime's largest --moe-slots (llama_vis_moe_max_slots): one limit for the plan and the runtime."""
    from . import capi
    return capi.llama_vis_moe_max_slots()


def _bounds(key: str) -> tuple[int, int]:
    lo, hi, _, _ = RANGES[key]
    return lo, _max_slots() if hi is None else hi


def _range_text(key: str) -> str:
    lo, hi = _bounds(key)
    return f"an integer in {lo}..{hi}{RANGES[key][3]}"


def check_args(**kw) -> None:
    """ValueError naming the option and its range for an argument of make_plan outside RANGES (None: not given)."""
    for key, v in kw.items():
        (lo, hi), opt = _bounds(key), RANGES[key][2]
        if v is not None and not (isinstance(v, int) and lo <= v <= hi):
            raise ValueError(f"{opt} must be {_range_text(key)}, got {v!r}")


def _option(key: str, words: tuple[str, ...] | dict = ()):
    """argparse type of one RANGES option: an integer in its range, or one of ``words`` (a dict: the word's value)."""
    def parse(s: str):
        if s in words:
            return words[s] if isinstance(words, dict) else s
        try:
            v = int(s)
            check_args(**{key: v})
            return v
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_range_text(key)}, got {s!r}") from None
    return parse


# --image-max-tokens of `pyvis plan` and `pyvis chat`: -1 the projector's limit, else at least one token
image_max_tokens = _option("image_max_tokens", {"-1": -1})


_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")


@dataclass
class ModelShape:
    path: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_vocab: int
    n_ff_exp: int
    kv_bytes_per_token: int
    file_bytes: int
    total_bytes: int                      # all tensor bytes
    row_gathered_bytes: int = 0           # token embeddings of a model with its own output matrix (read by row)
    all_f32: bool = False                 # every tensor F32: outputs are bit-identical at any ubatch (docs/planning.md)
    expert_type: int = 0                  # ggml type of the routed experts' weights (what the compute probe times)
    expert_bytes: dict[int, int] = field(default_factory=dict)   # MoE layer -> bytes of one expert
    slice_bytes: dict[int, int] = field(default_factory=dict)    # MoE layer -> its largest expert slice (one tensor)
    expert_tensors: dict[int, int] = field(default_factory=dict) # MoE layer -> its expert tensors (one slab each)

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.expert_bytes)


def _kv(fields: dict, key: str, default=None):
    f = fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_shape(path: str | Path) -> ModelShape:
    """MoE shape and byte counts of a GGUF, from its header (every shard's, for a split model)."""
    from gguf import GGUFReader
    from .gguf_model import shard_paths, what_it_is
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    shards = shard_paths(path)
    readers = []
    for p in shards:
        try:
            readers.append(GGUFReader(str(p)))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{p}: not a readable GGUF file ({e}); re-download or re-convert the model") from e
    not_a_model = what_it_is(path, readers[0])
    if not_a_model:
        raise ValueError(not_a_model)
    r = readers[0]
    fields = r.fields
    arch = _kv(fields, "general.architecture")
    if not arch:
        raise ValueError(f"{path}: general.architecture missing; is this a model GGUF?")
    g = lambda k, d=None: _kv(fields, f"{arch}.{k}", d)  # noqa: E731
    n_layer = int(g("block_count", 0))
    n_embd = int(g("embedding_length", 0))
    n_head = g("attention.head_count", 1)
    n_head = int(n_head[0] if isinstance(n_head, list) else n_head)
    n_head_kv = g("attention.head_count_kv", n_head)
    n_head_kv = int(max(n_head_kv) if isinstance(n_head_kv, list) else n_head_kv)
    k_len = int(g("attention.key_length", n_embd // max(n_head, 1)))
    v_len = int(g("attention.value_length", n_embd // max(n_head, 1)))
    if g("attention.kv_lora_rank") is not None:  # MLA: the cache holds the compressed latent + rope part
        k_len = int(g("attention.kv_lora_rank")) + int(g("rope.dimension_count", 64))
        v_len = 0
        n_head_kv = 1
    tokens = _kv(fields, "tokenizer.ggml.tokens")
    shape = ModelShape(
        path=str(path), arch=str(arch), n_layer=n_layer, n_expert=int(g("expert_count", 0)),
        n_expert_used=int(g("expert_used_count", 0)), n_embd=n_embd,
        n_vocab=len(tokens) if tokens is not None else 0, n_ff_exp=int(g("expert_feed_forward_length", 0)),
        kv_bytes_per_token=n_layer * n_head_kv * (k_len + v_len) * 2,  # F16 K and V
        file_bytes=sum(p.stat().st_size for p in shards), total_bytes=0)
    tensors = [t for rd in readers for t in rd.tensors]
    names = {t.name for t in tensors}
    shape.all_f32 = all(t.tensor_type.name == "F32" for t in tensors)
    for t in tensors:
        nb = int(t.n_bytes)
        shape.total_bytes += nb
        if t.name == "token_embd.weight" and "output.weight" in names:
            shape.row_gathered_bytes = nb
        m = _EXPS.match(t.name)
        if m:
            il = int(m.group(1))
            n_exp = int(t.shape[-1]) if len(t.shape) else 1
            shape.expert_bytes[il] = shape.expert_bytes.get(il, 0) + nb // max(n_exp, 1)
            shape.slice_bytes[il] = max(shape.slice_bytes.get(il, 0), nb // max(n_exp, 1))
            shape.expert_tensors[il] = shape.expert_tensors.get(il, 0) + 1
            shape.expert_type = int(t.tensor_type)
    return shape


def reserve_bytes(s: ModelShape, n_ubatch: int = 512) -> int:
    """Compute buffers + runtime: the runtime's own estimate (llama_vis_moe_estimate_reserve)."""
    from . import native
    return native.estimate_reserve(n_ubatch, s.n_vocab, s.n_embd, s.n_expert_used, s.n_ff_exp)


def io_bytes(shape: ModelShape, managed: list[int], io_threads: int | None = None) -> int:
    """The expert reads' memory the runtime plans with (llama_vis_moe_io_buffer_bytes): the O_DIRECT bounce buffers
    for the largest slice of the managed layers at io_threads (None: VIS_MOE_IO_THREADS in force) and the in-page
    placement of their slabs; 0 with nothing managed."""
    from . import native
    from .settings import get_tier_params
    if not managed:
        return 0
    n = get_tier_params().io_threads if io_threads is None else io_threads
    return native.io_buffer_bytes(n, max(shape.slice_bytes.get(il, 0) for il in managed),
                                  sum(shape.expert_tensors.get(il, 0) for il in managed))


def make_plan(shape: ModelShape, *, budget_mib: int | None = None, n_ctx: int = 4096, n_ubatch: int = 512,
              pinned: int = 0, slots: int = 0, host_mib: int = -1, device_mib: int | None = None,
              gpu: bool | None = None, shadow_expert: int = 0, shadow_slots: int = -1, search: bool = True,
              encoder_bytes: int = 0, io_threads: int | None = None) -> dict:
    """The runtime's plan for `shape`.  gpu: a GPU backend is present (then each layer keeps a staging slot);
    None = whether this build has one.  shadow_expert: bytes of one shadow expert (--moe-shadow with
    --moe-precision on, :func:`shadow_expert_bytes`); its slots share the budget as the runtime shares it: one per
    full slot (shadow_slots -1, auto), or shadow_slots per layer taken off the top.  search: when it does not fit,
    also find what the runtime's refusal names: largest_ctx (tokens, 0: none) and, with none,
    min_budget_smallest_ctx (the budget a 256-token context needs).  encoder_bytes: a VLM's vision encoder
    (:func:`pyvis.runtime.native.encoder_estimate`'s total_bytes), planned next to the model as --mmproj is.
    io_threads: the I/O threads whose bounce buffers the plan holds (:func:`io_bytes`; None: VIS_MOE_IO_THREADS)."""
    from . import native as _native
    check_args(budget_mib=budget_mib, n_ctx=n_ctx, n_ubatch=n_ubatch, pinned=pinned, slots=slots, host_mib=host_mib,
               device_mib=device_mib)
    if gpu is None:
        import llama_cpp
        gpu = device_mib is not None or bool(llama_cpp.llama_supports_gpu_offload())
    moe = shape.moe_layers
    all_pinned = pinned < 0
    if pinned < 0:
        pinned = len(moe)
    if pinned > len(moe):
        raise ValueError(f"--pinned {pinned} exceeds the model's {len(moe)} MoE layers (valid: 0..{len(moe)}, -1 = all)")
    # --moe-slots >= experts: every expert has a slot and none pages (the loader loads them all, upstream's graph
    # runs): the plan with nothing to page, as with every layer pinned (src/core/vis-moe-attach-plan.cpp)
    managed = moe[pinned:] if not (slots and slots >= shape.n_expert) else []
    expert = max((shape.expert_bytes[il] for il in managed), default=0)
    managed_bytes = sum(shape.expert_bytes[il] * shape.n_expert for il in managed)
    unified = device_mib is None
    fixed_shadow = shadow_expert * shadow_slots * len(managed) if shadow_slots > 0 else 0
    if shadow_slots <= 0:
        expert += shadow_expert                                   # each slot paired with a shadow slot
    req = dict(budget=(budget_mib or 0) * MIB,
               resident_bytes=shape.total_bytes - managed_bytes - shape.row_gathered_bytes + fixed_shadow,
               kv_bytes=kv_bytes(shape, n_ctx), reserve_bytes=reserve_bytes(shape, n_ubatch),
               expert_bytes=expert, n_managed_layers=len(managed), n_expert=shape.n_expert,
               n_expert_used=shape.n_expert_used, unified=int(unified),
               device_bytes=(device_mib or 0) * MIB, host_mib=host_mib, n_slots=slots, no_staging=int(not gpu),
               encoder_bytes=encoder_bytes, io_bytes=io_bytes(shape, managed, io_threads))
    p = _native.plan(**req)
    p["request"] = req
    p["managed_layers"] = len(managed)
    p["pinned_layers"] = pinned
    p["managed_bytes"] = managed_bytes
    n_sh = 0 if not shadow_expert else (shadow_slots if shadow_slots > 0 else p["n_slots"])
    p["shadow_slots"], p["shadow_bytes"] = n_sh, n_sh * shadow_expert * len(managed)
    if shadow_expert and shadow_slots <= 0:
        # paired: the planner sized slots of expert + shadow bytes (staging slot included); split them for display
        p["shadow_bytes"] = (p["n_slots"] + (0 if req["no_staging"] else 1)) * shadow_expert * len(managed)
        p["slab_bytes"] -= p["shadow_bytes"]
    # with --moe-mem alone (no --slots) and store = file, a model that fits whole runs upstream's path
    p["whole_model_fits"] = (not slots and not all_pinned and device_mib is None
                             and _native.whole_model_fits(shape.total_bytes + encoder_bytes, p["budget"]))
    if p["whole_model_fits"]:
        # loaded whole, every expert resident: the runtime's plan has nothing to page, and all of it must fit
        whole = _native.plan(**(req | dict(resident_bytes=shape.total_bytes - shape.row_gathered_bytes,
                                           expert_bytes=0, n_managed_layers=0, io_bytes=0)))
        if not whole["ok"]:
            p.update(ok=0, min_budget=whole["min_budget"],
                     error=whole["error"] + " (the whole model fits the budget alone, so it was loaded whole)")
    p["borrow"] = _borrow_plan(shape, p, req, n_ubatch=n_ubatch, gpu=gpu, shadow=bool(shadow_expert))
    if not p["ok"] and search:
        # the largest context this budget holds, in upstream's steps of 256 cells (what the runtime's refusal names)
        kw = dict(budget_mib=budget_mib, n_ubatch=n_ubatch, pinned=-1 if all_pinned else pinned, slots=slots,
                  host_mib=host_mib, device_mib=device_mib, gpu=gpu, shadow_expert=shadow_expert,
                  shadow_slots=shadow_slots, search=False, encoder_bytes=encoder_bytes, io_threads=io_threads)
        lo, hi = 0, _ctx_cells(n_ctx) // CTX_PAD               # lo fits (0: none known), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if make_plan(shape, n_ctx=mid * CTX_PAD, **kw)["ok"] else (lo, mid)
        p["largest_ctx"] = lo * CTX_PAD
        if not lo:   # none: what the smallest context would need
            p["min_budget_smallest_ctx"] = (p["min_budget"] if _ctx_cells(n_ctx) <= CTX_PAD else
                                            make_plan(shape, n_ctx=CTX_PAD, **kw)["min_budget"])
    return p


BORROW_SMALL = 16  # the ubatch whose compute estimate the borrowed slots' slabs are planned at (vis_moe_borrow::SMALL)


def _borrow_plan(shape: ModelShape, p: dict, req: dict, *, n_ubatch: int, gpu: bool, shadow: bool) -> dict | None:
    """Borrowed slots (VIS_MOE_BORROW, auto by default; src/features/vis-moe-borrow.cpp's vis_moe_borrow_plan): the
    plan at a 16-token ubatch's compute estimate, whose slots the slabs hold and decode steps run, where it applies:
    the CPU (no GPU backend), no --slots, no shadow slots, a larger asked ubatch, a plan that pages, and a 16-token
    plan that fits with every resident weight held, no smaller host cache, and more slots.  None where it does not."""
    from . import native as _native
    if (not borrow_mode() or gpu or shadow or req["n_slots"] or n_ubatch <= BORROW_SMALL or not p["ok"]
            or not req["n_managed_layers"] or p["whole_model_fits"] or p["n_slots"] >= shape.n_expert):
        return None
    small = _native.plan(**(req | dict(reserve_bytes=reserve_bytes(shape, BORROW_SMALL))))
    if (not small["ok"] or small["pageable_bytes"] > 0 or small["host_bytes"] < p["host_bytes"]
            or small["n_slots"] <= p["n_slots"]):
        return None
    small.update(managed_layers=p["managed_layers"], pinned_layers=p["pinned_layers"])
    return small


CTX_PAD = 256   # upstream pads a context to a multiple of 256 cells (llama_context's constructor)


def _ctx_cells(n_ctx: int) -> int:
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def kv_bytes(shape: ModelShape, n_ctx: int) -> int:
    """Bytes of the F16 KV cache of an n_ctx-token context, padded as upstream pads it."""
    return shape.kv_bytes_per_token * _ctx_cells(n_ctx)


def _mib_up(b: int) -> str:
    return f"{-(-b // MIB)} MiB"


def refusal_hint(p: dict, n_ctx: int) -> str:
    """What the runtime's --moe-mem refusal names after the plan's error (src/plan/vis-moe-kv-check.cpp), for a plan
    that does not fit: the smallest budget for this context and the largest context for this budget."""
    largest = (f"-c {p['largest_ctx']}" if p["largest_ctx"] else
               f"none ({CTX_PAD} tokens need {_mib_up(p['min_budget_smallest_ctx'])})")
    enc = p["request"].get("encoder_bytes", 0)
    return (f"smallest budget for this {_ctx_cells(n_ctx)}-token context: {_mib_up(p['min_budget'])} (KV cache "
            f"{_mib_up(p['request']['kv_bytes'])}{f', vision encoder {_mib_up(enc)}' if enc else ''}); "
            f"largest context for {_mib_up(p['budget'])}: {largest}")


def default_threads() -> int:
    """`pyvis plan`'s default thread count: the CPUs this process may use (llama-cli's own default counts physical
    cores where it can tell them apart, so the two agree only without SMT; `-t` on both makes them agree)."""
    import os
    return max(1, len(os.sched_getaffinity(0)))


def configure_plan(shape: ModelShape, *, n_ubatch: int = 512, profile=None, cost: dict | None = None,
                   n_threads: int = 0, **kw) -> dict:
    """The configurator's plan (llama_vis_moe_configure, docs/planning.md), as --moe-mem runs it: the plan request
    of :func:`make_plan` (same keywords) priced at each ubatch from n_ubatch down, with the cost model the runtime
    uses (:func:`pyvis.runtime.native.cost_probe` of the model file and its experts' shape at n_threads threads,
    0: :func:`default_threads`) unless ``cost`` is given.  ``profile``: a
    routing trace for per-layer miss curves (then 'layer_slots' and 'n_pinned' advise a per-layer split).  Returns
    {'configuration': llama_vis_moe_configure's answer, 'plan': make_plan's at the chosen ubatch, 'asked':
    make_plan's at n_ubatch, 'cost': the cost model}."""
    from . import native as _native
    # upstream caps a causal context's batch, so its ubatch, at the (padded) context: the configurator starts there
    asked_ub, n_ubatch = n_ubatch, min(n_ubatch, _ctx_cells(kw.get("n_ctx", 4096)))
    asked = make_plan(shape, n_ubatch=n_ubatch, search=False, **kw)
    cost = cost or _native.cost_probe(shape.path, type_=shape.expert_type, n_embd=shape.n_embd,
                                      n_ff_exp=max(shape.n_ff_exp, 1), n_expert_used=max(shape.n_expert_used, 1),
                                      n_threads=n_threads or default_threads())
    rq = asked["request"]
    pinned = asked["pinned_layers"]
    managed = shape.moe_layers[pinned:] if asked["managed_layers"] else []
    from .slot_split import profile_curves, split_file_curves
    # the routing profile the plans are priced with: --profile's trace, else VIS_MOE_SLOT_SPLIT's curves (as
    # src/plan/vis-moe-configure-context.cpp reads them), else the uniform prior (None)
    curve, split = None, os.environ.get("VIS_MOE_SLOT_SPLIT")
    if managed and profile:
        curve = profile_curves(shape, managed, profile)
    elif managed and split:
        curve = split_file_curves(shape, managed, split)
    c = _native.configure(rq, n_vocab=shape.n_vocab, n_embd=shape.n_embd, n_ff_exp=shape.n_ff_exp, n_ubatch=n_ubatch,
                          cost=cost, miss_curve=curve, mode=configure_mode(), all_f32=shape.all_f32,
                          borrow=borrow_mode() and not rq.get("n_slots"))
    # what the runtime runs (llama_vis_moe_configure_applies' verdict, where anything is paged): the chosen ubatch;
    # nothing fits: the smallest (its refusal names the budget there)
    c["applied"] = bool(asked["managed_layers"] and not asked["whole_model_fits"] and c["verdict"] == "applied")
    ub = c["n_ubatch"] if c["applied"] else asked_ub     # not applied: the plan at -ub as given, as before
    c["advised_n_ubatch"], c["n_ubatch"] = c["n_ubatch"], ub
    fit_ub = _resident_ubatch(shape, asked, n_ubatch, kw)
    if fit_ub:   # loaded whole, the asked -ub does not fit next to it: lowered (src/plan/vis-moe-kv-check.cpp)
        c.update(applied=True, verdict="applied", resident=True, n_ubatch=fit_ub, advised_n_ubatch=fit_ub)
        ub = fit_ub
    chosen = make_plan(shape, n_ubatch=ub, **kw)
    return dict(configuration=c, plan=chosen, asked=asked, cost=cost)


def _resident_ubatch(shape: ModelShape, asked: dict, n_ubatch: int, kw: dict) -> int:
    """A model loaded whole whose context does not fit at the asked ubatch: the largest smaller one (halving down to
    16) that fits, where the runtime lowers -ub to it (VIS_MOE_CONFIGURE=on, or auto on all-F32 weights:
    vis_moe_configure_resident_ubatch); 0 where it refuses instead."""
    mode = configure_mode()
    if not asked["whole_model_fits"] or asked["ok"] or mode == "off" or (mode == "auto" and not shape.all_f32):
        return 0
    ub = n_ubatch // 2
    while ub >= 16:
        if make_plan(shape, n_ubatch=ub, search=False, **kw)["ok"]:
            return ub
        ub //= 2
    return 0


def shadow_expert_bytes(shadow_path, model_path) -> int:
    """Bytes of the largest shadow expert (all its tensors) of a ``pyvis shadow`` sidecar of this model."""
    from . import shadow as sh
    sf = sh.read_shadow(shadow_path, model_path)
    per_layer: dict[int, int] = {}
    for name, (_src, ne, t) in sf.tensors.items():
        il = int(name.split(".")[1])
        per_layer[il] = per_layer.get(il, 0) + int(t.n_bytes) // max(int(ne[2]), 1)
    return max(per_layer.values(), default=0)


def _env_switch(name: str, default: str, allow_auto: bool = True) -> str:
    """An auto|on|off engine knob as the runtime parses it (parse_switch, src/api/vis-moe-settings-table.cpp): unset
    or empty is `default`, 1/true and 0/false are on and off; anything else is an error."""
    import os
    v = os.environ.get(name) or default
    words = ("auto", "on", "off") if allow_auto else ("on", "off")
    v = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(v, v)
    if v not in words:
        raise ValueError(f"{name}: expected {', '.join(words[:-1])} or {words[-1]}, got {os.environ.get(name)!r}")
    return v


def borrow_mode() -> bool:
    """VIS_MOE_BORROW as the runtime reads it: auto (the default) or on: borrowed slots where they apply; off.  Like
    the runtime (vis_moe_borrow_off_reason), the online controller (VIS_MOE_ONLINE) turns them off."""
    return _env_switch("VIS_MOE_BORROW", "auto") != "off" and _env_switch("VIS_MOE_ONLINE", "off", False) != "on"


def configure_mode() -> str:
    """VIS_MOE_CONFIGURE as the runtime reads it: auto (unset or empty), on or off; anything else is an error."""
    return _env_switch("VIS_MOE_CONFIGURE", "auto")
