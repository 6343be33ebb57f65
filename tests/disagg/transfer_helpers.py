"""Engine-level KV transfer for tests: run a request to its end, prefill for a remote decode,
move the pinned blocks in the host backend's frames, and decode from them."""

from __future__ import annotations

import torch

from shoal.disagg.blocks import BlockAssembler, to_chunk
from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineOutput, EngineRequest, KVTransferParams, SamplingParams


def run(engine: LLMEngine, request: EngineRequest) -> list[EngineOutput]:
    engine.add_request(request)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request.request_id]
    return outs


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prefill(engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams):
    first = SamplingParams(**{**_fields(sp), "max_tokens": 1, "min_tokens": min(sp.min_tokens, 1)})
    outs = run(
        engine,
        EngineRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=first,
            kv_transfer=KVTransferParams(do_remote_decode=True),
        ),
    )
    assert outs[-1].finish_reason == "length"
    return tokens(outs)[0], outs[-1].kv_transfer


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__struct_fields__}


def decode(engine: LLMEngine, rid, prompt, first_token, sp, params, first_block, data):
    engine.stage_kv(rid, first_block, data)
    rest = SamplingParams(**{**_fields(sp), "max_tokens": sp.max_tokens - 1})
    request = EngineRequest(
        request_id=rid,
        prompt_token_ids=[*prompt, first_token],
        sampling=rest,
        num_output_tokens_before=1,
        kv_transfer=params,
    )
    return [first_token, *tokens(run(engine, request))]


def transfer(src: LLMEngine, params: KVTransferParams, first: int, per_chunk: int) -> torch.Tensor:
    joined = BlockAssembler(params.layout, first, len(params.block_ids) - first)
    for start in range(first, len(params.block_ids), per_chunk):
        n = min(per_chunk, len(params.block_ids) - start)
        joined.add(to_chunk(start, src.read_kv_blocks(params.request_id, start, n)))
    return joined.tensor()
