"""shoal: distributed LLM inference serving with a paged-attention engine of its own."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    """`shoal.LLM` and `shoal.SamplingParams`, imported on first use: the frontend and the
    runtime import shoal without loading torch."""
    if name == "LLM":
        from shoal.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shoal.protocol import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
