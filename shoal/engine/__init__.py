"""The inference engine: paged KV cache, scheduler, model runner, sampler, offline API."""

from shoal.engine.config import EngineConfig
from shoal.engine.llm import LLM
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.protocol import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
