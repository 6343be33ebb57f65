"""Layering: the commands that run no engine import no torch, and none loads numba (the KV
router's compiled table) before a kv router is built."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import contextlib, io, sys
import shoal.cli
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    shoal.cli.main({argv!r})
heavy = sorted(m for m in ("torch", "triton", "safetensors", "numba") if m in sys.modules)
print(",".join(heavy) or "none")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["bench", "--help"],
        ["bench", "run", "--help"],
        ["frontend", "--help"],
        ["serve", "--help"],
        ["bench", "compare", "/nonexistent/a.json", "/nonexistent/b.json"],
    ],
)
def test_commands_without_an_engine_import_no_torch(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "none"


def test_importing_shoal_and_the_frontend_loads_no_torch():
    code = "import sys, shoal, shoal.frontend, shoal.router, shoal.bench\n"
    code += "print('torch' in sys.modules or 'numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
