"""The mocker's lower KV tiers: the engine's tier manager (host and disk LRU, capacity,
onboarding at admission, KV events with medium CPU/DISK, counters) with copies that take
modelled time instead of moving bytes (docs/kv-offload.md, docs/mocker.md).

Each block stands for kv_bytes_per_token x block_size bytes (Llama-3.1-8B's 128 KiB a token
by default) but holds one byte, so a tier's capacity in blocks is the engine's for that
model while its memory and its disk files stay tiny. A batch of copies takes

    copy = blocks x block bytes / bandwidth  (+ disk blocks x block bytes / disk bandwidth)

on the runner's simulated clock, queued behind the batches before it in the same direction
(host to GPU, GPU to host): a save holds its GPU blocks and an onboarding request waits
until the clock passes the copy's end; the batch does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_offload import OffloadConfig, OffloadManager
from shoal.engine.kv_offload.stats import MEDIUM_DISK
from shoal.mocker.runner import MockRunner
from shoal.mocker.transfer import LLAMA_8B_KV_BYTES_PER_TOKEN


@dataclass(frozen=True)
class TierModel:
    host_gbps: float = 44.0  # GB/s host<->GPU, block batches of 128+ on the H100 (kv-offload.md)
    disk_gbps: float = 5.0  # GB/s read from the local disk (one NVMe drive)
    kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        for name in ("host_gbps", "disk_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)})")


class ModelledJob:
    """A batch of copies that ends when the runner's simulated clock reaches `end`."""

    def __init__(self, runner: MockRunner, end: float, seconds: float) -> None:
        self.runner, self.end, self.seconds = runner, end, seconds

    def done(self) -> bool:
        return self.runner.simulated_seconds >= self.end

    def wait(self) -> None:
        """Let the simulated clock run idle to the copy's end."""
        self.runner.idle_until(self.end)


class ModelledCopier:
    """The BlockCopier's place: save and load return ModelledJobs, one link each way."""

    def __init__(self, runner: MockRunner, model: TierModel, block_bytes: int) -> None:
        self.runner, self.model, self.block_bytes = runner, model, block_bytes
        self.disk_blocks = 0  # blocks of the next load read from disk first
        self._free_at = {"save": 0.0, "load": 0.0}  # when each direction's link is free

    def _job(self, direction: str, seconds: float) -> ModelledJob:
        start = max(self.runner.simulated_seconds, self._free_at[direction])
        self._free_at[direction] = start + seconds
        return ModelledJob(self.runner, start + seconds, seconds)

    def save(self, block_ids: list[int], host: torch.Tensor, slots: list[int]) -> ModelledJob:
        """GPU to host: the blocks' bytes over the host link."""
        return self._job("save", len(block_ids) * self.block_bytes / (self.model.host_gbps * 1e9))

    def load(
        self, sources: list[torch.Tensor], block_ids: list[int], after_queued: bool = True
    ) -> ModelledJob:
        """Host (and disk, for the blocks read() found there) to GPU. The modelled steps do
        not overlap, so the copy starts when the link is free either way."""
        disk, self.disk_blocks = self.disk_blocks, 0
        nbytes = self.block_bytes
        seconds = len(block_ids) * nbytes / (self.model.host_gbps * 1e9)
        return self._job("load", seconds + disk * nbytes / (self.model.disk_gbps * 1e9))

    def order_before_steps(self, job: ModelledJob) -> None:
        """The next step starts once the copy is done: the clock runs idle to its end."""
        self.runner.idle_until(job.end)


class ModelledOffload(OffloadManager):
    """The engine's OffloadManager over one-byte blocks, copies timed by a TierModel."""

    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, runner: MockRunner, model: TierModel
    ) -> None:
        block_bytes = model.kv_bytes_per_token * kv.block_size
        tiers = OffloadConfig(
            int(config.kv_offload_cpu_gb * 2**30) // block_bytes,
            config.kv_offload_disk_path,
            int((config.kv_offload_disk_gb or 0) * 2**30) // block_bytes,
        )
        super().__init__(tiers, kv, (1,), torch.uint8, pin_memory=False)
        self.block_bytes = block_bytes  # the modelled bytes, for the counters
        self.copier = ModelledCopier(runner, model, block_bytes)

    def read(self, block_hashes: list[int], media: list[str]):
        """OffloadManager.read, telling the copier how many blocks came from disk."""
        sources, entries = super().read(block_hashes, media)
        self.copier.disk_blocks = media[: len(sources)].count(MEDIUM_DISK)
        return sources, entries

    def idle(self) -> None:
        """Nothing to schedule: let the clock run to the first pending copy's end."""
        jobs = [load.job for load in self.loads] + [job for job, _, _ in self.saves]
        if jobs:
            min(jobs, key=lambda j: j.end).wait()
