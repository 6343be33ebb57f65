"""benchmarks/frontend_trace.py wraps functions that still exist under the names it uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHECK = """
import sys
sys.path.insert(0, {benchmarks!r})
import frontend_trace
frontend_trace.install({out!r}, {role!r})
from shoal.runtime.frame_stream import FrameProtocol
assert FrameProtocol.send.__name__ == "traced_send"
if {role!r} == "worker":
    from shoal.engine.async_llm import AsyncLLM
    names = [AsyncLLM._apply, AsyncLLM._step, AsyncLLM._deliver, AsyncLLM._dispatch]
    assert [f.__name__ for f in names] == [
        "traced_apply", "traced_step", "traced_deliver", "traced_dispatch"
    ]
else:
    from shoal.frontend import app
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    assert app.parse_body.__name__ == "traced_parse_body"
    assert RequestResponseCycle.run_asgi.__name__ == "traced_run_asgi"
"""


def test_install_wraps_every_hand_off(tmp_path: Path) -> None:
    for role in ("worker", "frontend"):
        code = CHECK.format(benchmarks=str(BENCHMARKS), out=str(tmp_path), role=role)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_breakdown_follows_the_first_token_past_an_empty_hand_over(tmp_path: Path) -> None:
    """With async scheduling a prompt's first step hands over no outputs; the chain must
    wait for the hand-over that carries the token."""
    sys.path.insert(0, str(BENCHMARKS))
    from frontend_trace import breakdown

    frame = 100  # bytes: above MIN_FRAMES, a request or a response
    frontend = [
        (0.000, "http_in", 300),
        (0.0005, "asgi", 0),
        (0.001, "endpoint", 0),
        (0.002, "send", frame),
        (0.015, "recv", frame),
        (0.016, "body", 50),
    ]
    worker = [
        (0.003, "recv", frame),
        (0.004, "add", 0),
        (0.005, "step", 0),
        (0.006, "deliver", 0),  # the prompt's step: nothing sampled yet
        (0.010, "step", 0),
        (0.012, "deliver", 1),  # the next step hands over the first token
        (0.013, "dispatch", 0),
        (0.014, "send", frame),
    ]
    (tmp_path / "frontend-1.json").write_text(json.dumps(frontend))
    (tmp_path / "worker-2.json").write_text(json.dumps(worker))
    rows = breakdown(str(tmp_path), skip=0, horizon_s=1.0)["first_token"]
    at = {row.split()[0]: float(row.split()[1]) for row in rows}
    assert at["f:asgi"] == 0.5 and at["f:endpoint"] == 1.0
    assert at["w:deliver"] == 12.0
    assert at["w:dispatch"] == 13.0
    assert at["f:body"] == 16.0
