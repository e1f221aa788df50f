"""jetson/install.sh --dry-run per SKU, the SKU table behind it (pyvis.runtime.devices) and pyvis plan --device."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from pyvis.runtime import devices
from conftest import ROOT, run

INSTALL = ROOT / "jetson" / "install.sh"


@pytest.mark.parametrize("name", list(devices.SKUS))
def test_install_dry_run_per_sku(fixture_dir, name):
    sku = devices.get(name)
    model = fixture_dir / "qwen3moe.gguf"
    r = run(["bash", INSTALL, "--dry-run", "--sku", name, "--model", model, "-c", "2048"], timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    # every step shown, nothing done
    for line in ("[dry-run] env VIS_PRESET=jetson bash scripts/setup.sh",
                 "[dry-run] install -m 0644", "/etc/systemd/system/vis-moe-server.service",
                 "[dry-run] systemctl daemon-reload", "[dry-run] systemctl enable --now vis-moe-server",
                 "GGML_CUDA_NO_VMM=ON", "dry run: nothing was changed"):
        assert line in out, line
    # the unit's limit and budget are the table's, and the plan runs with that budget
    assert f"MemoryMax={sku.memory_max_mib}M" in out
    assert f"--moe-mem {sku.moe_mem_mib} " in out and f"-m {model} " in out and "-c 2048" in out
    assert f"fits: run with --moe-mem {sku.moe_mem_mib}" in out
    assert 0 < sku.moe_mem_mib < sku.memory_max_mib < sku.total_mib


def test_install_refuses_bad_input_and_non_jetson():
    r = run(["bash", INSTALL, "--dry-run", "--sku", "tx2", "--model", "m.gguf"])
    assert r.returncode == 2 and "unknown --sku 'tx2'; valid: orin-nano-8g," in r.stderr
    r = run(["bash", INSTALL, "--dry-run", "--sku", "orin-nx-8g"])
    assert r.returncode == 2 and "--model GGUF is required" in r.stderr
    r = run(["bash", INSTALL, "--dry-run", "--sku", "orin-nx-8g", "--model", "m.gguf", "--port", "80x"])
    assert r.returncode == 2 and "--port must be an integer" in r.stderr
    # without --dry-run on a machine that is not a Jetson: stops before touching anything
    r = run(["bash", INSTALL, "--sku", "orin-nx-8g", "--model", "m.gguf"])
    assert r.returncode == 2 and "not a Jetson with JetPack" in r.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze(tmp_path):
    path = tmp_path / "vis-moe-server.service"
    path.write_text(devices.unit(devices.get("agx-orin-32g"), "/opt/models/m.gguf"))
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    # off the board the only complaint may be the binary that is not built here
    problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                if ln.strip() and "build-jetson/bin/llama-server is not executable" not in ln]
    assert not problems, problems


def test_detect_reads_the_board(tmp_path):
    dt, mi = tmp_path / "model", tmp_path / "meminfo"
    dt.write_text("NVIDIA Jetson Orin NX Engineering Reference Developer Kit\x00")
    mi.write_text("MemTotal:       15655640 kB\n")
    assert devices.detect(str(dt), str(mi)).name == "orin-nx-16g"
    mi.write_text("MemTotal:        7620000 kB\n")
    assert devices.detect(str(dt), str(mi)).name == "orin-nx-8g"
    dt.write_text("NVIDIA Jetson AGX Orin Developer Kit\x00")
    mi.write_text("MemTotal:       64335836 kB\n")
    assert devices.detect(str(dt), str(mi)).name == "agx-orin-64g"
    dt.write_text("Raspberry Pi 5\x00")
    with pytest.raises(ValueError, match="give --sku"):
        devices.detect(str(dt), str(mi))
    with pytest.raises(ValueError, match="not a Jetson"):
        devices.detect(str(tmp_path / "none"), str(mi))


def test_unit_rejects_unsafe_values():
    sku = devices.get("orin-nano-8g")
    for kw in (dict(model="/a b.gguf"), dict(model='/x".gguf'), dict(port=0), dict(ctx=0), dict(user="")):
        with pytest.raises(ValueError):
            devices.unit(sku, **({"model": "/m.gguf"} | kw))
