"""scripts/page_runs.py (docs/planning.md#stop-42-the-borrowed-slots-pages-were-physically-scattered-found-and-fixed):
pages per physically contiguous run of a process's anonymous memory, from /proc/PID/pagemap.

- a process whose pages are known: a child that faults one 64 MiB mapping, read by the script, shows it resident
  (as root: with page frame numbers; otherwise the script says it needs root and exits 1);
- a bad PID or a process that is gone is an error naming it, not a traceback.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "page_runs.py"
CHILD = ("import mmap, sys\n"
         "m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
         "for i in range(0, len(m), 4096):\n"
         "    m[i] = 1\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n")


def test_it_reads_a_process_it_can_see():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        r = subprocess.run([sys.executable, SCRIPT, str(child.pid)], capture_output=True, text=True, timeout=60)
    finally:
        child.communicate("", timeout=30)
    if os.geteuid() != 0:
        assert r.returncode == 1 and "root" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    # the 64 MiB mapping is one of the unlocked ones of 8 MiB or more, all resident
    m = re.search(r"unlocked >= 8 MiB\s+\d+ mappings\s+(\d+) MiB,\s+(\d+) MiB resident,\s+([\d.]+) pages", r.stdout)
    assert m, r.stdout
    assert int(m[2]) >= 64 and float(m[3]) >= 1.0, r.stdout


def test_a_bad_pid_is_a_clear_error():
    r = subprocess.run([sys.executable, SCRIPT, "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "PID must be positive" in r.stderr
    r = subprocess.run([sys.executable, SCRIPT, str(2 ** 22 + 12345)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot read process" in r.stderr and "Traceback" not in r.stderr
