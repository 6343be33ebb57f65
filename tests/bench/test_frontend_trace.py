"""benchmarks/frontend_trace.py wraps functions that still exist under the names it uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHECK = """
import sys
sys.path.insert(0, {benchmarks!r})
import frontend_trace
frontend_trace.install({out!r}, {role!r})
from shoal.runtime.zmq_loop import LoopSocket
assert LoopSocket.send.__name__ == "traced_send"
if {role!r} == "worker":
    from shoal.engine.async_llm import AsyncLLM
    names = [AsyncLLM._apply, AsyncLLM._step, AsyncLLM._deliver, AsyncLLM._dispatch]
    assert [f.__name__ for f in names] == [
        "traced_apply", "traced_step", "traced_deliver", "traced_dispatch"
    ]
else:
    import fastapi.routing
    assert fastapi.routing.run_endpoint_function.__name__ == "traced_endpoint"
"""


def test_install_wraps_every_hand_off(tmp_path: Path) -> None:
    for role in ("worker", "frontend"):
        code = CHECK.format(benchmarks=str(BENCHMARKS), out=str(tmp_path), role=role)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
