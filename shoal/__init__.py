"""shoal: distributed LLM inference serving with a paged-attention engine of its own."""

__version__ = "0.1.0"

from shoal.engine import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]
