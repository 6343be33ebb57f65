"""The inference engine: paged KV cache, scheduler, model runner, sampler, offline API."""

from importlib import import_module

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
_HOMES = {
    "LLM": "shoal.engine.llm",
    "CompletionOutput": "shoal.engine.outputs",
    "EngineConfig": "shoal.engine.config",
    "LLMEngine": "shoal.engine.llm_engine",
    "RequestOutput": "shoal.engine.outputs",
    "SamplingParams": "shoal.protocol",
}


def __getattr__(name: str):
    """The engine's public names, imported on first use: its light modules (config,
    scheduler, block pool) load without torch."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'shoal.engine' has no attribute {name!r}")
    return getattr(import_module(home), name)
