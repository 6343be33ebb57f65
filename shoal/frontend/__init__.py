"""The OpenAI-compatible HTTP frontend: tokenize, validate, stream, detokenize, measure."""

from shoal.frontend.app import build_app
from shoal.frontend.engine_client import EngineClient, NoWorkerAvailable, WorkerFailed

__all__ = ["EngineClient", "NoWorkerAvailable", "WorkerFailed", "build_app"]
