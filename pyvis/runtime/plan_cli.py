"""`pyvis plan`'s command line: the options, the printed plan and its JSON (the planning itself: plan.py).

    pyvis plan MODEL.gguf [--budget auto|MIB] [-c N] [--pinned L] [--slots N] [--host-mib N] [--device-mib N]

See docs/paging.md and docs/planning.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .plan import (BORROW_SMALL, MIB, ModelShape, _max_slots, _option, configure_mode, configure_plan,
                   image_max_tokens, make_plan, read_shape, refusal_hint, shadow_expert_bytes)
from .profile import ProfileError


def _fmt(b: int) -> str:
    return f"{b / MIB:10.1f} MiB"


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import native as _native
    try:
        shape = read_shape(args.model)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    budget = None if args.budget == "auto" else args.budget
    mem = _native.mem_probe()
    sku = None
    try:
        if args.device is not None:
            from .devices import get
            sku = get(args.device)
            if args.budget != "auto" or args.device_mib is not None:
                raise ValueError("--device sets the budget (the unit's --moe-mem): drop --budget / --device-mib")
            budget = sku.moe_mem_mib
        sh_bytes = shadow_expert_bytes(args.shadow, args.model) if args.shadow else 0
        enc = (_native.encoder_estimate(args.mmproj, args.image_max_tokens, warmup=not args.no_warmup)
               if args.mmproj else None)
        kw = dict(budget_mib=budget, n_ctx=args.ctx_size, pinned=args.pinned, slots=args.slots,
                  host_mib=args.host_mib, device_mib=args.device_mib, gpu=True if sku else None,
                  shadow_expert=sh_bytes, shadow_slots=-1 if args.shadow_slots == "auto" else args.shadow_slots,
                  encoder_bytes=enc["total_bytes"] if enc else 0)
        conf = None
        if configure_mode() != "off":
            conf = configure_plan(shape, n_ubatch=args.ubatch_size, profile=args.profile, n_threads=args.threads, **kw)
            p = conf["plan"]
        else:
            if args.profile:
                raise ValueError("--profile prices plans for the configurator, which VIS_MOE_CONFIGURE=off turns off")
            p = make_plan(shape, n_ubatch=args.ubatch_size, **kw)
        p["layer_slots"] = _layer_slots(shape, p, args)
        if p["borrow"]:
            from . import slot_split
            p["borrow"]["layer_slots"] = slot_split.for_plan(shape, p["borrow"], _split_path(args))
    except (ValueError, ProfileError, OSError, _native.VisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    p["encoder"] = enc
    if args.json:
        extra = {} if conf is None else {"configuration": conf["configuration"], "cost": conf["cost"],
                                         "asked_plan": conf["asked"]}
        print(json.dumps({"model": shape.__dict__ | {"expert_bytes": {str(k): v for k, v in shape.expert_bytes.items()}},
                          "machine": mem, "plan": p} | extra, indent=2))
        return 0 if p["ok"] else 2
    cg = (f"cgroup v{mem['cgroup_version']} limit {mem['cgroup_limit'] / MIB:.0f} MiB (usage {mem['cgroup_usage'] / MIB:.0f} MiB)"
          if mem["cgroup_limit"] > 0 else "no cgroup memory limit")
    print(f"machine: MemTotal {mem['mem_total'] / MIB:.0f} MiB, MemAvailable {mem['mem_available'] / MIB:.0f} MiB, "
          f"swap {mem['swap_total'] / MIB:.0f} MiB ({mem['swap_free'] / MIB:.0f} free), zram {mem['zram_bytes'] / MIB:.0f} MiB, {cg}")
    print(f"model:   {shape.path}: {shape.arch}, {shape.n_layer} layers, {len(shape.moe_layers)} MoE layers x "
          f"{shape.n_expert} experts (top-{shape.n_expert_used}), {shape.file_bytes / MIB:.0f} MiB file, "
          f"{max(shape.expert_bytes.values(), default=0) / MIB:.2f} MiB per expert")
    src = ("the machine's limit (auto)" if budget is None else
           f"{sku.name}: {sku.memory_gb} GB board, MemoryMax={sku.memory_max_mib}M, --moe-mem {sku.moe_mem_mib}"
           if sku else "--budget")
    print(f"budget:  {p['budget'] / MIB:.0f} MiB from {src}; context {args.ctx_size} tokens")
    if budget is not None and p["budget"] < budget * MIB:
        lim = "cgroup limit" if 0 < mem["cgroup_limit"] <= mem["mem_total"] else "MemTotal"
        print(f"         --budget {budget} MiB exceeds what this process may hold ({lim}): planned for "
              f"{p['budget'] / MIB:.0f} MiB instead, as the runtime does")
    print()
    rq = p["request"]
    rows = [("resident weights (backbone, shared experts, pinned layers)", rq["resident_bytes"]),
            ("KV cache", rq["kv_bytes"]),
            ("compute buffers + runtime (estimate)", rq["reserve_bytes"]),
            *([(f"expert reads' bounce buffers (VIS_MOE_IO_THREADS)", rq["io_bytes"])] if rq.get("io_bytes") else []),
            *([(f"vision encoder (--mmproj, {enc['projector']}): weights", enc["weight_bytes"]),
               (f"  + compute at {max(enc['image_tokens'], enc['warmup_tokens'])} image tokens"
                f"{' (warmup)' if enc['warmup_tokens'] > enc['image_tokens'] else ''} + runtime (estimate)",
                enc["compute_bytes"]),
               ("  + image copies (f32 image, output embeddings)", enc["image_bytes"])] if enc else []),
            (f"tier 1  slabs: {p['n_slots']} slot{'s' if p['n_slots'] != 1 else ''}"
             f"{'' if rq['no_staging'] else ' (+1 staging)'} x "
             f"{p['managed_layers']} layers{f' + 1 in {x}' if (x := p.get('extra_slots', 0)) else ''}",
             p["slab_bytes"]),
            *([(f"tier 1  shadow slabs: {p['shadow_slots']} x {p['managed_layers']} layers "
                f"(--moe-precision)", p["shadow_bytes"])] if p["shadow_slots"] else []),
            ("tier 2  host expert cache", p["host_bytes"]),
            ("tier 3  GGUF file only (read on demand)", p["file_only_bytes"])]
    for label, b in rows:
        print(f"  {label:<62s} {_fmt(b)}")
    if p["layer_slots"]:
        why = [w for w, on in (("VIS_MOE_SLOT_SPLIT", _split_path(args)),
                               ("the bytes left after whole rows", p.get("extra_slots"))) if on]
        print(f"  per-layer slots ({' + '.join(why)}): "
              f"{','.join(map(str, p['layer_slots'].values()))} (layers {min(p['layer_slots'])}..{max(p['layer_slots'])})")
    if b := p["borrow"]:
        x = f" + 1 in {b['extra_slots']}" if b.get("extra_slots") else ""
        print(f"  borrowed slots (VIS_MOE_BORROW, default auto): the slabs hold {b['n_slots']} slots x "
              f"{b['managed_layers']} layers{x} ({b['slab_bytes'] / MIB:.1f} MiB, the plan at a {BORROW_SMALL}-token "
              f"ubatch); decode steps run them all, ubatches of more than {BORROW_SMALL} tokens the tiers above "
              f"and what the compute buffer leaves")
        if b.get("layer_slots"):
            print(f"  per-layer slots of the borrowed slabs: {','.join(map(str, b['layer_slots'].values()))}")
    if args.device_mib is not None:
        print(f"  (slabs on the discrete GPU: {args.device_mib} MiB of device memory)")
    if enc and enc["image_tokens"] and not enc["limit_known"]:
        print(f"  (the encoder is planned at its image_size, {enc['image_tokens']} tokens: {enc['projector']} may take "
              f"larger images; give --image-max-tokens, and the same to the tool)")
    print()
    if conf is not None:
        _print_configuration(conf, args.ubatch_size)
    if not p["ok"]:
        print(f"does not fit: {p['error']}", file=sys.stderr)
        print(refusal_hint(p, args.ctx_size), file=sys.stderr)
        return 2
    if shape.row_gathered_bytes:
        print(f"  (token embeddings, {shape.row_gathered_bytes / MIB:.1f} MiB, are read one row per token and not counted)")
    if p["pageable_bytes"] > 0:
        print(f"note: {p['pageable_bytes'] / MIB:.0f} MiB of the resident weights do not fit next to one slot per layer: "
              f"they stay unlocked and are re-read from the file when the kernel drops them (slow). "
              f"{p['tight_budget'] / MIB:.0f} MiB or more gives top-k slots with everything resident locked.")
    elif p["n_slots"] < shape.n_expert_used:
        print(f"note: {p['n_slots']} slot{'s' if p['n_slots'] > 1 else ''} per layer, below top-{shape.n_expert_used}: "
              f"exact, but each decode step runs "
              f"{-(-shape.n_expert_used // p['n_slots'])} passes per layer and reads most experts again. "
              f"{p['tight_budget'] / MIB:.0f} MiB or more gives top-k slots.")
    if p["whole_model_fits"]:
        print(f"whole model fits: {shape.total_bytes / MIB:.0f} MiB of weights"
              f"{' and the vision encoder' if enc else ''} in a {p['budget'] / MIB:.0f} MiB budget, "
              "so --moe-mem alone runs upstream's path (nothing deferred or paged; the tiers above are what "
              "explicit --moe-slots would give)")
    print(f"fits: run with --moe-mem {budget if sku else args.budget}" + (f" --moe-pinned-layers {args.pinned}" if args.pinned else "")
          + f"  (minimum budget {p['min_budget'] / MIB:.0f} MiB)")
    return 0


def _layer_slots(shape: ModelShape, p: dict, args) -> dict:
    """--write-split FILE (written from --profile), or VIS_MOE_SLOT_SPLIT, and the plan's extra slots: the per-layer
    slots the runtime runs."""
    from . import policies, slot_split
    if args.write_split:
        if not args.profile:
            raise ValueError("--write-split needs --profile TRACE (the routing whose miss curves it holds)")
        slot_split.write_for_model(shape, args.profile, args.write_split, policies.DEFAULT)
        print(f"wrote {args.write_split}: run with VIS_MOE_SLOT_SPLIT={args.write_split}", file=sys.stderr)
    return slot_split.for_plan(shape, p, _split_path(args))


def _split_path(args) -> str | None:
    """The split file the runtime will run with: VIS_MOE_SLOT_SPLIT, else the one --write-split writes."""
    return os.environ.get("VIS_MOE_SLOT_SPLIT") or args.write_split


def _print_configuration(conf: dict, asked_ub: int) -> None:
    c, cost, a = conf["configuration"], conf["cost"], conf["asked"]
    if not c["ok"]:
        print(f"configurator: nothing fits even at -ub {c['n_ubatch']} (the smallest it tries); the numbers below "
              f"are that ubatch's")
        return
    ub = c["advised_n_ubatch"]
    if c.get("resident"):
        print(f"configurator: -ub {asked_ub} lowered to {ub}: the whole model is resident, and -ub {asked_ub}'s "
              f"compute buffer does not fit next to it and the KV cache (VIS_MOE_CONFIGURE=off keeps -ub; "
              f"docs/planning.md)\n")
        return
    def more(p):  # the layers the bytes left after whole rows give one more slot, as llama-cli's line says
        return f" (+ 1 in {x} layer{'s' if x > 1 else ''})" if (x := p.get("extra_slots", 0)) else ""
    change = (f"-ub {asked_ub} {'lowered' if c['applied'] else 'could be lowered'} to {ub}: its compute buffer buys "
              f"{c['plan']['n_slots']} slot(s) per layer{more(c['plan'])} instead of "
              f"{str(a['n_slots']) + more(a) if a['ok'] else 'none (it does not fit)'}"
              if ub < asked_ub else f"-ub {asked_ub} kept: a smaller one buys too little")
    if ub < asked_ub and not c["applied"]:
        change += ("; not applied: the weights are not all F32, and on them outputs differ in the last bits at "
                   "another -ub; VIS_MOE_CONFIGURE=on applies it (the tiers above are the asked -ub's)")

    print(f"configurator: {change} (VIS_MOE_CONFIGURE=off keeps -ub; docs/planning.md)")
    print(f"  predicted for a request of {cost['prompt_tokens']} prompt + {cost['gen_tokens']} generated tokens: "
          f"decode {c['decode_tps']:.2f} tok/s, prefill {c['prefill_tps']:.1f} tok/s"
          + (f" (the plan at -ub {asked_ub}: {c['asked_decode_tps']:.2f} and {c['asked_prefill_tps']:.1f})"
             if c["asked_decode_tps"] and ub < asked_ub else ""))
    print(f"  cost model: expert reads {cost['read_bps'] / MIB:.0f} MiB/s (probed once, ~/.cache/vis-moe/bandwidth; "
          f"VIS_MOE_READ_MBPS); {'timed once, ~/.cache/vis-moe/compute' if cost['probed'] else 'the knobs'}: "
          f"weights at one token {cost['mem_bps'] / MIB:.0f} MiB/s (VIS_MOE_MEM_MBPS), prefill compute "
          f"{cost['token_byte_s'] * 1e9 * MIB:.0f} ns per token per MiB (VIS_MOE_TOKEN_NS_PER_MIB), "
          f"{cost['pass_s'] * 1e6:.0f} us per extra pass + {cost['pass_token_s'] * 1e6:.2f} us per token of its "
          f"ubatch (VIS_MOE_PASS_US, VIS_MOE_PASS_TOKEN_US)")
    print(f"  marginal values at the optimum, seconds saved per request per MiB: last slot row {c['mv_slot']:.3f}, "
          f"next slot row {c['mv_next_slot']:.3f}; last ubatch doubling {c['mv_ubatch_down']:.3f}, next one "
          f"{c['mv_ubatch_up']:.3f}")
    if "layer_slots" in c:
        print(f"  per-layer split of the same slab bytes (--profile): {c['layer_slots']}, predicted decode "
              f"{c['layer_decode_tps']:.2f} tok/s; pinned prefix {c['n_pinned']} layer(s) "
              f"(VIS_MOE_SLOT_SPLIT=FILE from --write-split FILE runs it: docs/planning.md)")
    print()


def _shadow_slots(s: str):
    if s == "auto":
        return s
    v = int(s)
    if not 1 <= v <= _max_slots():
        raise ValueError(s)
    return v


def register(sub) -> None:
    s = sub.add_parser("plan", help="show how a model would be split over slabs, host cache and file on this machine",
                       description="Plan the memory tiers for MODEL on this machine: the budget (the cgroup v1/v2 "
                       "limit or MemAvailable with --budget auto), resident weights, KV cache, compute, tier-1 "
                       "slabs, tier-2 host cache and what stays on the file. Same planner as `--moe-mem`.")
    s.add_argument("model", help="GGUF model")
    s.add_argument("--budget", default="auto", type=_option("budget_mib", ("auto",)),
                   help="memory budget in MiB, or auto (default: auto)")
    s.add_argument("-c", "--ctx-size", type=_option("n_ctx"), default=4096, help="context size in tokens (default: 4096)")
    s.add_argument("-ub", "--ubatch-size", type=_option("n_ubatch"), default=512,
                   help="physical batch size (default: 512)")
    s.add_argument("-t", "--threads", type=_option("n_threads"), default=None,
                   help="threads the run uses, for the cost model's compute probe (default: the CPUs this process "
                        "may use; llama-cli's default counts physical cores, so give both the same -t)")
    s.add_argument("--pinned", type=_option("pinned"), default=0,
                   help="MoE layers kept fully resident (-1 = all; default: 0)")
    s.add_argument("--slots", type=_option("slots"), default=0, help="fixed slots per managed layer (default: planned)")
    s.add_argument("--host-mib", type=_option("host_mib"), default=-1,
                   help="fixed host-cache size in MiB (default: planned)")
    s.add_argument("--device-mib", type=_option("device_mib"), default=None,
                   help="discrete GPU: device memory for slabs in MiB (default: unified memory, CPU or Jetson)")
    s.add_argument("--device", default=None, metavar="SKU",
                   help="plan for a Jetson Orin instead of this machine: the budget the installed service gets "
                        "(orin-nano-8g, orin-nx-8g, orin-nx-16g, agx-orin-32g, agx-orin-64g; jetson/install.sh)")
    s.add_argument("--shadow", default=None, metavar="FILE",
                   help="with --moe-precision on: the --moe-shadow sidecar, whose slots share the budget")
    s.add_argument("--shadow-slots", type=_shadow_slots, default="auto", metavar="auto|N",
                   help="shadow slots per managed layer, as --moe-shadow-slots (default: auto, one per full slot)")
    s.add_argument("--profile", default=None, metavar="TRACE",
                   help="a routing trace (--moe-trace file or the shared CSV) whose per-layer miss curves price "
                        "the plans (default: the uniform prior; docs/planning.md)")
    s.add_argument("--mmproj", default=None, metavar="FILE", help="a VLM's projector GGUF: its weights, compute buffer "
                   "and image copies are planned in the same budget, as llama-mtmd-cli / llama-server --mmproj and "
                   "pyvis chat plan them (docs/planning.md#the-vision-encoder)")
    s.add_argument("--image-max-tokens", type=image_max_tokens, default=-1, metavar="N",
                   help="with --mmproj: the largest image in tokens (default: the projector's limit)")
    s.add_argument("--no-warmup", action="store_true", help="with --mmproj: the tool runs without warmup (its "
                   "--no-warmup; pyvis chat does not warm the encoder up): the compute buffer is the image's")
    s.add_argument("--write-split", default=None, metavar="FILE",
                   help="with --profile: write its per-layer miss curves to FILE, for VIS_MOE_SLOT_SPLIT=FILE "
                        "(per-layer slot counts at run time; docs/planning.md)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.set_defaults(fn=_cmd_plan)
