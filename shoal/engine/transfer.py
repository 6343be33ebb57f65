"""Host-device copies that do not wait for the device.

A plain `tensor.to("cuda")` from pageable memory, or `.tolist()` of a device tensor,
synchronizes the stream: with async scheduling that would wait for the step in flight.
These helpers go through pinned memory with asynchronous copies instead; PyTorch's
pinned-memory cache keeps each host buffer alive until its copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied asynchronously."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, valid once the stream reaches this point (record an event)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
