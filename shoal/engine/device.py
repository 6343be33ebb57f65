"""Which device an engine (or one tensor-parallel rank of it) runs on."""

from __future__ import annotations

import torch


def engine_device(device: str | None) -> torch.device:
    """The device an engine runs on: the one given, else CUDA when present, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
