"""Compute kernels: Triton kernels for the GPU and their pure-torch references (the oracle)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


@functools.cache
def triton_kernels(module: str) -> ModuleType:
    """A Triton kernel module, imported on first GPU use (CPU-only installs lack triton)."""
    return importlib.import_module(f"shoal.kernels.{module}")


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: full float32 products for float32 inputs (the tests' exact
    mode), tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
