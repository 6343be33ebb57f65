"""The mocker's KV tiers: a conversation evicted from a small pool comes back from the
modelled host (or disk) tier, counted, and its TTFT in model time includes the copy."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.cli import build_parser
from shoal.engine.config import EngineConfig
from shoal.engine.kv_offload import MEDIUM_CPU, MEDIUM_DISK
from shoal.mocker.cli import mocker_options
from shoal.mocker.engine import MockEngine
from shoal.mocker.tiers import TierModel
from shoal.mocker.timing import TimingModel
from shoal.protocol import BlockStored, EngineRequest, SamplingParams
from shoal.worker.metrics import WorkerMetrics

BLOCK = 16
POOL = 24  # GPU blocks: the filler between turns evicts the conversation
TURN, REPLY, FILLER = 48, 8, 376
# prefill only: a step is 1 ms + 2 us a new prompt token
TIMING = TimingModel(1.0, 2.0, 0.0, 0.0, 0.0)
TIERS = TierModel(host_gbps=1.0, disk_gbps=0.25, kv_bytes_per_token=1024)
BLOCK_BYTES = 1024 * BLOCK


def gib(blocks: float) -> float:
    return (blocks + 0.5) * BLOCK_BYTES / 2**30


def make(mock_dir, **tiers) -> MockEngine:
    config = EngineConfig(model=str(mock_dir), num_gpu_blocks=POOL, block_size=BLOCK, **tiers)
    return MockEngine(config, TIMING, speedup=1e9, tiers=TIERS)


def generate(engine: MockEngine, rid: str, prompt: list[int], max_tokens: int):
    """The reply's tokens, the prompt tokens found cached and the TTFT in model time."""
    sampling = SamplingParams(max_tokens=max_tokens)
    engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
    start, ttft, tokens, cached = engine.runner.simulated_seconds, None, [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = engine.runner.simulated_seconds - start
            tokens += out.new_token_ids
            cached = out.num_cached_tokens if out.num_cached_tokens is not None else cached
    return tokens, cached, ttft


def conversation(engine: MockEngine, turns: int = 3):
    """Each turn's cached prompt tokens and TTFT; a filler prompt evicts the pool between."""
    rng = np.random.default_rng(0)
    history: list[int] = []
    cached, ttfts = [], []
    for turn in range(turns):
        history = history + rng.integers(5, 384, TURN).tolist()
        reply, hit, ttft = generate(engine, f"turn{turn}", history, REPLY)
        cached.append(hit)
        ttfts.append(ttft)
        history = history + reply
        generate(engine, f"filler{turn}", rng.integers(5, 384, FILLER).tolist(), 1)
    return cached, ttfts


def prefill(tokens: int) -> float:
    return 1e-3 + 2e-6 * tokens


def prompt_len(turn: int) -> int:
    return (turn + 1) * TURN + turn * REPLY


def test_host_tier_hits_are_counted_and_their_copy_is_in_the_ttft(mock_dir):
    off_cached, off_ttft = conversation(make(mock_dir))
    assert off_cached == [0, 0, 0]  # the small pool alone recomputes every turn
    assert off_ttft == pytest.approx([prefill(prompt_len(t)) for t in range(3)])

    engine = make(mock_dir, kv_offload_cpu_gb=gib(200))
    engine.enable_kv_events()
    cached, ttfts = conversation(engine)
    offload = engine.kv.offload
    stats = offload.stats[MEDIUM_CPU]
    # each later turn found its history's full blocks in the host tier
    assert cached == [0, 48, 96]
    assert stats.hits * BLOCK == sum(cached)
    for turn in (1, 2):
        copy = cached[turn] * 1024 / 1e9  # the blocks' bytes at 1 GB/s
        rest = prefill(prompt_len(turn) - cached[turn])
        assert ttfts[turn] == pytest.approx(copy + rest)
        assert ttfts[turn] < off_ttft[turn]
    assert stats.read_seconds == pytest.approx(sum(cached) * 1024 / 1e9)
    assert stats.bytes_read == stats.hits * BLOCK_BYTES
    assert stats.stored == len(offload.host) and stats.bytes_written == stats.stored * BLOCK_BYTES

    events = engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    cpu = [h for e in stored for h in e.block_hashes]
    assert sorted(cpu) == sorted(offload.host.entries)
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks and offload.queue_depth == 0
    metrics = WorkerMetrics("m")
    metrics.update(engine)
    sample = metrics.registry.get_sample_value
    assert sample("shoal_worker_kv_offload_hits_total", {"model": "m", "tier": "CPU"}) == stats.hits


def test_disk_tier_takes_what_the_host_evicts_and_reads_at_its_bandwidth(mock_dir, tmp_path):
    engine = make(
        mock_dir,
        kv_offload_cpu_gb=gib(4),
        kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_gb=gib(200),
    )
    cached, ttfts = conversation(engine, turns=2)
    offload = engine.kv.offload
    disk, host = offload.stats[MEDIUM_DISK], offload.stats[MEDIUM_CPU]
    assert cached == [0, 48] and disk.hits == 3 and host.hits == 0 and disk.misses == 0
    assert len(offload.host) <= 4
    copy = 48 * 1024 / 1e9 + 48 * 1024 / 0.25e9  # host link, then the disk read first
    assert ttfts[1] == pytest.approx(copy + prefill(prompt_len(1) - 48))
    offload.close()


def test_tier_bandwidth_flags_reach_the_mocker(monkeypatch):
    monkeypatch.setenv("SHOAL_MOCKER_DISK_GBPS", "2")
    argv = ["worker", "--model", "m", "--engine", "mocker", "--mocker-host-gbps", "20"]
    args = build_parser().parse_args([*argv, "--kv-offload-cpu-gb", "8"])
    assert mocker_options(args)["tiers"] == TierModel(host_gbps=20.0, disk_gbps=2.0)
    assert args.kv_offload_cpu_gb == 8.0
