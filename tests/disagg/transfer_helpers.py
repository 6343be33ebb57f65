"""Running one request through an LLMEngine to its end, and the tokens it streamed."""

from __future__ import annotations

from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineOutput, EngineRequest


def run(engine: LLMEngine, request: EngineRequest) -> list[EngineOutput]:
    engine.add_request(request)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request.request_id]
    return outs


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
