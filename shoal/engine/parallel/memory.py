"""One rank's KV cache budget: measured on a GPU after the profile step, configured on the CPU.

Every rank (rank 0 and each follower) runs the same measurement over its own device, so
the engine can size the KV pool by the rank with the least room.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.config import CPU_KV_CACHE_BYTES, EngineConfig

# left free beyond the measured peak: what the profile cannot see, i.e. kernels first loaded
# by later batch shapes and the allocator's rounding of the real cache and activations (an
# H100 run of tests/engine/test_gpu_memory.py peaked 12 MiB above the measurement)
PROFILE_HEADROOM_BYTES = 256 * 2**20


@dataclass
class MemoryProfile:
    """What a profiled rank found: GPU bytes in all, held apart from the KV cache at the
    peak, used outside this process's torch, and left for the KV cache."""

    total: int
    held: int
    outside_torch: int
    budget: int


def profiles_memory(config: EngineConfig, device: torch.device) -> bool:
    """Whether this rank measures its KV budget (a GPU, no size given) or takes it as set."""
    return device.type == "cuda" and config.kv_cache_memory_bytes is None


def configured_kv_budget(config: EngineConfig) -> int:
    """The KV cache bytes a rank holds when it does not profile."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    return CPU_KV_CACHE_BYTES


def begin_profile(device: torch.device) -> None:
    """Start measuring this rank's peak memory (before building the scratch KV pool)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_kv_budget(
    device: torch.device, utilization: float, scratch_bytes: int
) -> MemoryProfile:
    """After the profile step: the bytes left for the KV cache on this GPU, i.e. the
    utilization share less memory used outside torch, less the peak this process reached
    apart from the scratch KV pool (scratch_bytes), less a headroom."""
    torch.cuda.synchronize(device)
    held = torch.cuda.max_memory_reserved(device) - scratch_bytes
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - held - outside_torch - PROFILE_HEADROOM_BYTES
    return MemoryProfile(total, held, outside_torch, budget)
