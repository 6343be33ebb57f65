"""benchmarks/nixl_probe.py on host memory (its dry run on a CPU machine): two processes READ
and WRITE each other's registered memory with the bytes checked, and the UCX lines it
prints hold the table of the protocols a ucp_get took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.disagg.nixl import load_nixl

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(load_nixl() is None, reason="no NIXL wheel imports")
def test_probe_moves_checked_bytes_and_names_the_get_protocol(tmp_path):
    argv = [sys.executable, str(ROOT / "benchmarks" / "nixl_probe.py"), "--device", "cpu"]
    argv += ["--rounds", "shoal", "--mb", "4", "--chunks", "4", "--reps", "1", "--no-record"]
    argv += ["--log-dir", str(tmp_path), "--ucx-log-level", "info", "--timeout", "60"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["read_ok"] and row["write_ok"] and row["read_gbps"] > 0
    lines = out.splitlines()
    get = next(i for i, line in enumerate(lines) if "remote memory read by ucp_get" in line)
    assert "| Range" in lines[get + 1]
    assert lines[get + 2].strip().startswith("| 0..")  # the first row: from 0 bytes, by a transport
