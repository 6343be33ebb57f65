"""The mocker's KV transfer model: how long moving a prompt's KV between two simulated
workers takes, from a bandwidth figure (disaggregated prefill/decode, docs/disagg.md).

    transfer = latency + tokens x kv_bytes_per_token / bandwidth

The default bytes per token are Llama-3.1-8B's in bf16: 32 layers x 8 KV heads x 128 dims
x (K, V) x 2 bytes = 128 KiB. The default bandwidth, 50 GB/s, is one 400 Gb/s RDMA NIC
(NIXL between nodes); CUDA IPC on one H100 node runs far faster (docs/disagg.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.protocol import KVLayout

LLAMA_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


@dataclass(frozen=True)
class TransferModel:
    bandwidth_gbps: float = 50.0  # GB/s (1e9 bytes) of one transfer
    latency_ms: float = 1.0  # fixed cost of a transfer (handshake, descriptors, notification)
    kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be positive (got {self.bandwidth_gbps})")

    def seconds(self, num_tokens: int) -> float:
        """Modelled time to move the KV of `num_tokens` tokens (0 tokens: nothing to move)."""
        if num_tokens <= 0:
            return 0.0
        nbytes = num_tokens * self.kv_bytes_per_token
        return self.latency_ms * 1e-3 + nbytes / (self.bandwidth_gbps * 1e9)


def placeholder_blocks(layout: KVLayout, count: int) -> torch.Tensor:
    """KV of `count` blocks as the mocker moves it: the transfer shape with no bytes."""
    return torch.empty((layout.num_layers, 2, count, 0, 0, 0))
