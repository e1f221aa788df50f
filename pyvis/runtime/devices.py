"""Jetson Orin SKUs: the memory a service may use on each, and the systemd unit that runs llama-server there.

One table (SKUS) feeds `pyvis plan --device SKU`, `jetson/install.sh` and the unit it installs, so the budget a
plan shows is the one the service runs with.  On Orin the CPU and the iGPU share one LPDDR5 pool (unified memory):
the service gets the board's memory less what JetPack (kernel, CUDA driver, carveouts; no desktop) keeps, as a
cgroup limit (`MemoryMax=`), and `--moe-mem` is that limit less a small slack for the process outside the plan.

    python -m pyvis.runtime.devices list
    python -m pyvis.runtime.devices detect
    python -m pyvis.runtime.devices unit --sku orin-nano-8g --model /opt/models/m.gguf [--prefix /opt/vis-moe]
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SLACK_MIB = 256  # inside MemoryMax, outside the --moe-mem plan: binary text, libc arenas, page-table growth


@dataclass(frozen=True)
class Sku:
    name: str
    board: str          # /proc/device-tree/model contains this
    memory_gb: int      # LPDDR5 on the module
    reserve_mib: int    # kept for JetPack: kernel, CUDA driver and firmware carveouts (headless)

    @property
    def total_mib(self) -> int:
        return self.memory_gb * 1000 * 1000 * 1000 // (1 << 20)   # GB on the label, MiB in the kernel

    @property
    def memory_max_mib(self) -> int:
        return self.total_mib - self.reserve_mib

    @property
    def moe_mem_mib(self) -> int:
        return self.memory_max_mib - SLACK_MIB


SKUS = {s.name: s for s in [
    Sku("orin-nano-8g", "Orin Nano", 8, 1536),
    Sku("orin-nx-8g", "Orin NX", 8, 1536),
    Sku("orin-nx-16g", "Orin NX", 16, 2048),
    Sku("agx-orin-32g", "AGX Orin", 32, 3072),
    Sku("agx-orin-64g", "AGX Orin", 64, 3072),
]}


def get(name: str) -> Sku:
    try:
        return SKUS[name]
    except KeyError:
        raise ValueError(f"unknown device '{name}'; valid: {', '.join(SKUS)}") from None


def detect(model_file: str = "/proc/device-tree/model", meminfo: str = "/proc/meminfo") -> Sku:
    """The SKU of this board, from the device-tree model and MemTotal; ValueError when it is not a known Orin."""
    try:
        model = Path(model_file).read_text(errors="replace").strip("\x00\n ")
    except OSError:
        raise ValueError(f"not a Jetson ({model_file} unreadable); give --sku ({', '.join(SKUS)})") from None
    m = re.search(r"MemTotal:\s+(\d+) kB", Path(meminfo).read_text())
    total_gb = int(m.group(1)) * 1024 / 1e9 if m else 0
    cands = [s for s in SKUS.values() if s.board.lower() in model.lower()]
    # AGX before NX/Nano names cannot clash; memory picks among one board's variants (MemTotal is a bit below the label)
    cands = [s for s in cands if s.memory_gb * 0.8 <= total_gb <= s.memory_gb * 1.05] or cands
    if len(cands) != 1:
        raise ValueError(f"cannot tell the SKU of '{model}' with {total_gb:.1f} GB; give --sku ({', '.join(SKUS)})")
    return cands[0]


UNIT = """\
# vis-moe: llama-server with SSD/swap-aware expert paging on a Jetson {board} {gb} GB ({sku}).
# Written by jetson/install.sh from pyvis.runtime.devices; see jetson/README.md.
[Unit]
Description=vis-moe llama-server on {sku} (MoE model larger than memory, experts paged from NVMe)
After=network.target

[Service]
Type=simple
User={user}
WorkingDirectory={prefix}
# CUDA buffers in managed memory: the expert slabs are filled straight from the GGUF (one copy)
Environment=GGML_CUDA_ENABLE_UNIFIED_MEMORY=1
# the board's {total} MiB less {reserve} MiB kept for JetPack; --moe-mem plans inside it ({slack} MiB slack)
MemoryMax={memory_max}M
MemorySwapMax=0
# slabs and resident weights are mlocked so the kernel cannot page them out
LimitMEMLOCK=infinity
ExecStart={prefix}/build-jetson/bin/llama-server -m {model} -ngl 99 -lm mmap -c {ctx} --moe-mem {moe_mem} --moe-unified on --moe-pinned-layers 1 --host 127.0.0.1 --port {port}
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


def unit(sku: Sku, model: str, prefix: str = "/opt/vis-moe", user: str = "jetson", ctx: int = 4096,
         port: int = 8080) -> str:
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    if not 1 <= ctx <= 1 << 20:
        raise ValueError(f"-c must be in 1..1048576, got {ctx}")
    for what, v in (("--model", model), ("--prefix", prefix), ("--user", user)):
        if not v or any(c in v for c in "\n\"'\\ "):
            raise ValueError(f"{what} must be a plain path/name without spaces or quotes, got {v!r}")
    return UNIT.format(board=sku.board, gb=sku.memory_gb, sku=sku.name, user=user, prefix=prefix, model=model,
                       total=sku.total_mib, reserve=sku.reserve_mib, slack=SLACK_MIB, memory_max=sku.memory_max_mib,
                       moe_mem=sku.moe_mem_mib, ctx=ctx, port=port)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyvis.runtime.devices", description="Jetson Orin SKUs and their unit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every SKU with its memory budget")
    sub.add_parser("detect", help="the SKU of this board")
    u = sub.add_parser("unit", help="the systemd unit for a SKU, on stdout")
    u.add_argument("--sku", required=True, help=f"one of {', '.join(SKUS)}")
    u.add_argument("--model", required=True)
    u.add_argument("--prefix", default="/opt/vis-moe")
    u.add_argument("--user", default="jetson")
    u.add_argument("-c", "--ctx-size", type=int, default=4096)
    u.add_argument("--port", type=int, default=8080)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "list":
            for s in SKUS.values():
                print(f"{s.name:14s} {s.board:10s} {s.memory_gb:3d} GB  MemoryMax={s.memory_max_mib}M  "
                      f"--moe-mem {s.moe_mem_mib}")
        elif a.cmd == "detect":
            print(detect().name)
        else:
            sys.stdout.write(unit(get(a.sku), a.model, a.prefix, a.user, a.ctx_size, a.port))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
