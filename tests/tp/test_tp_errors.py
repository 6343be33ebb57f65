"""Tensor parallelism's failures: a size that does not split the model, a rank that dies."""

import os
import signal
import subprocess
import sys
import time

import pytest

from shoal import LLM, SamplingParams
from shoal.engine.parallel.executor import RankDiedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_size_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=3)


def test_killed_rank_ends_the_engine_with_a_clear_error(llama_dir):
    with LLM(str(llama_dir), device="cpu", tensor_parallel_size=2) as llm:
        assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
        (follower,) = llm.engine.followers.processes
        os.kill(follower.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankDiedError, match=r"tensor-parallel rank 1 .* exited with code -9"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - started < 10
        with pytest.raises(RankDiedError):  # and every later step
            llm.generate([[8, 9]], GREEDY)
    assert follower.exitcode == -9


ENGINE_SCRIPT = """
import sys, time
from shoal import LLM
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
print(*(p.pid for p in llm.engine.followers.processes), flush=True)
time.sleep(120)
"""


def test_followers_exit_when_rank_0_is_killed(llama_dir):
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT, str(llama_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(engine.stdout.readline())
        engine.kill()
        engine.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid)
    finally:
        engine.kill()


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
