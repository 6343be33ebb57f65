"""The engine's lower KV tiers end to end on the tiny Llama: a conversation evicted from a
small GPU pool comes back from host memory or disk with the big pool's greedy output."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tier_helpers import (
    BLOCK,
    FILLER,
    REPLY,
    TURN_TOKENS,
    assert_tiers_settled,
    conversation,
    engine,
    gib,
)

from shoal.engine.kv_offload import MEDIUM_CPU, MEDIUM_DISK
from shoal.kv_hash import hash_blocks
from shoal.protocol import BlockRemoved, BlockStored, EngineRequest, SamplingParams
from shoal.worker.metrics import WorkerMetrics


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Replies with a pool that never evicts, and what a small pool alone caches."""
    big = engine(llama_dir, num_gpu_blocks=256)
    replies, big_cached = conversation(big)
    _, small_cached = conversation(engine(llama_dir))
    return replies, big_cached, small_cached


def test_host_tier_serves_evicted_turns_with_identical_output(llama_dir, reference):
    replies, big_cached, small_cached = reference
    assert small_cached[1:] == [0, 0, 0]  # without a lower tier the history is recomputed
    llm = engine(llama_dir, kv_offload_cpu_gb=gib(200))
    got, cached = conversation(llm)
    assert got == replies
    # each later turn found its whole history (full blocks) cached, as the big pool did
    assert cached == big_cached and all(c >= TURN_TOKENS for c in cached[1:])
    stats = llm.engine.kv.offload.stats[MEDIUM_CPU]
    # and it came from the host tier, not the GPU pool: the GPU prefix hits were none
    assert stats.hits * BLOCK == sum(cached)
    assert stats.bytes_read == stats.hits * llm.engine.kv.offload.block_bytes
    assert stats.stored > 0 and stats.bytes_written > 0
    assert_tiers_settled(llm)
    metrics = WorkerMetrics("m")
    metrics.update(llm.engine)
    sample = metrics.registry.get_sample_value
    cpu = {"model": "m", "tier": "CPU"}
    assert sample("shoal_worker_kv_offload_hits_total", cpu) == stats.hits
    read = {**cpu, "direction": "read"}
    assert sample("shoal_worker_kv_offload_bytes_total", read) == stats.bytes_read
    assert sample("shoal_worker_kv_offload_blocks", cpu) == len(llm.engine.kv.offload.host)
    assert sample("shoal_worker_kv_offload_queue_depth", {"model": "m"}) == 0


def test_disk_tier_takes_what_the_host_evicts(llama_dir, reference, tmp_path):
    replies, big_cached, _ = reference
    llm = engine(
        llama_dir,
        kv_offload_cpu_gb=gib(4),
        kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_gb=gib(200),
    )
    got, cached = conversation(llm)
    assert got == replies and cached == big_cached
    offload = llm.engine.kv.offload
    disk = offload.stats[MEDIUM_DISK]
    assert disk.hits > 0 and disk.stored > 0 and disk.misses == 0
    assert disk.hits + offload.stats[MEDIUM_CPU].hits == sum(cached) // BLOCK
    assert_tiers_settled(llm)
    _wait_written(offload.disk)
    assert len(list(tmp_path.glob("*.kvblock"))) == len(offload.disk)


def _wait_written(disk, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while disk.pending:
        assert time.monotonic() < deadline, "disk writes did not finish"
        time.sleep(0.01)
        disk.reap()


def test_corrupt_or_missing_disk_blocks_are_misses(llama_dir, reference, tmp_path):
    replies, _, _ = reference
    llm = engine(
        llama_dir,
        kv_offload_cpu_gb=gib(2),
        kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_gb=gib(200),
    )
    disk = llm.engine.kv.offload.disk
    damaged = []

    def damage(turn: int, _history: list[int]) -> None:
        _wait_written(disk)
        files = [f for f in map(disk.file, disk.entries) if f.exists()]
        if turn == 0:  # flip a payload byte of every block file: all are corrupt
            for f in files:
                raw = bytearray(f.read_bytes())
                raw[-1] ^= 0xFF
                f.write_bytes(bytes(raw))
        elif turn == 1:  # delete them
            for f in files:
                f.unlink()
        elif turn == 2:  # truncate them
            for f in files:
                f.write_bytes(f.read_bytes()[:10])
        damaged.append(len(files))

    got, _ = conversation(llm, between=damage)
    assert got == replies
    stats = llm.engine.kv.offload.stats[MEDIUM_DISK]
    assert all(damaged[:3]) and stats.misses == 3  # one miss a turn ends each lookup
    assert stats.hits == 0
    assert_tiers_settled(llm)


def test_capacity_lru_and_move_down_per_tier(llama_dir, tmp_path):
    """Prompts A..E of two full blocks each: the host tier (4 blocks) keeps the last two,
    evicting least recently used first to the disk tier (2 blocks), which drops its own
    least recently used; a lookup refreshes a block's place."""
    llm = engine(
        llama_dir,
        num_gpu_blocks=64,
        kv_offload_cpu_gb=gib(4),
        kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_gb=gib(2),
    )
    offload = llm.engine.kv.offload
    assert (offload.host.capacity, offload.disk.capacity) == (4, 2)
    llm.engine.enable_kv_events()
    prompts = {name: [5 + i] * (2 * BLOCK + 1) for i, name in enumerate("ABCDE")}
    for prompt in prompts.values():
        llm.generate([prompt], FILLER)
    hashes = {name: hash_blocks(p, BLOCK)[:2] for name, p in prompts.items()}
    assert list(offload.host.entries) == hashes["D"] + hashes["E"]
    assert list(offload.disk.entries) == hashes["C"]
    events = llm.engine.take_kv_events()

    def by_medium(kind: type) -> dict[str, list[int]]:
        """The block hashes of the events of `kind`, in order, per lower tier."""
        return {
            m: [h for e in events if isinstance(e, kind) and e.medium == m for h in e.block_hashes]
            for m in (MEDIUM_CPU, MEDIUM_DISK)
        }

    stored, removed = by_medium(BlockStored), by_medium(BlockRemoved)
    assert stored[MEDIUM_CPU] == [h for n in "ABCDE" for h in hashes[n]]
    assert removed[MEDIUM_CPU] == [h for n in "ABC" for h in hashes[n]]
    assert stored[MEDIUM_DISK] == [h for n in "ABC" for h in hashes[n]]
    assert removed[MEDIUM_DISK] == [h for n in "AB" for h in hashes[n]]
    # D is looked up (refreshed in the host tier), so F's blocks push E out, not D
    offload.host.get(hashes["D"][0])
    offload.host.get(hashes["D"][1])
    llm.generate([[99] * (2 * BLOCK + 1)], FILLER)
    assert list(offload.host.entries)[:2] == hashes["D"]
    assert list(offload.disk.entries) == hashes["E"]
    assert_tiers_settled(llm)


def test_onboarding_is_first_come_first_served_under_pool_pressure(llama_dir):
    """A turn whose prompt does not fit in what a running request leaves of the pool is not
    overtaken: a smaller turn behind it, also in the host tier, is not onboarded into the
    room it waits for, and once the pool frees the first turn runs first."""
    llm = engine(llama_dir, kv_offload_cpu_gb=gib(200))
    eng = llm.engine
    rng = np.random.default_rng(0)
    first, second = rng.integers(5, 384, 160).tolist(), rng.integers(5, 384, 64).tolist()
    llm.generate([first, second], FILLER)
    llm.generate([rng.integers(5, 384, 376).tolist()], FILLER)  # both leave the GPU pool
    hog = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.add_request(
        EngineRequest(
            request_id="hog", prompt_token_ids=rng.integers(5, 384, 224).tolist(), sampling=hog
        )
    )
    eng.step()
    # the hog holds 15 of 24 blocks; the first turn needs 11, the second 5
    turns = {"first": first + [7] * BLOCK, "second": second + [7] * BLOCK}
    for rid, prompt in turns.items():
        eng.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=REPLY))
    first_token: dict[str, int] = {}
    hog_running, step = True, 0
    while eng.has_unfinished_requests():
        if hog_running:  # the first turn waits for room, so nobody behind it takes any
            assert "second" not in eng.kv.req_blocks
        step += 1
        for out in eng.step():
            if out.new_token_ids:
                first_token.setdefault(out.request_id, step)
            hog_running &= not (out.finished and out.request_id == "hog")
    assert first_token["first"] <= first_token["second"]
    # both histories come from the host tier, the first too though it once failed to fit
    assert eng.kv.offload.stats[MEDIUM_CPU].hits == (160 + 64) // BLOCK
    assert_tiers_settled(llm)
