"""The mocker in disaggregated roles: a prefill MockEngine pins a prompt's blocks and hands
back transfer parameters; a decode MockEngine starts from the (byte-less) transferred
blocks at its first decode step, never prefilling; transfer time follows the bandwidth."""

from __future__ import annotations

import pytest

from shoal.engine.config import EngineConfig
from shoal.mocker.engine import MockEngine
from shoal.mocker.transfer import TransferModel, placeholder_blocks
from shoal.protocol import EngineRequest, KVTransferParams, SamplingParams


def run(engine: MockEngine, request: EngineRequest) -> list:
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_prefill_then_decode_from_transferred_blocks(llama_dir):
    prefill = MockEngine(EngineConfig(model=str(llama_dir)), speedup=1e12)
    decode = MockEngine(EngineConfig(model=str(llama_dir), seed=1), speedup=1e12)
    prompt = [(i * 7) % 300 + 3 for i in range(1000)]
    first = run(
        prefill,
        EngineRequest(
            request_id="r",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=1, ignore_eos=True),
            kv_transfer=KVTransferParams(do_remote_decode=True),
        ),
    )
    params = first[-1].kv_transfer
    assert params is not None and len(params.block_ids) == 63  # 1000 tokens in blocks of 16
    assert prefill.kv.num_pinned_blocks == 63
    decode.stage_kv("r~d", 0, placeholder_blocks(decode.kv_layout, len(params.block_ids)))
    before = decode.runner.simulated_seconds
    outputs = run(
        decode,
        EngineRequest(
            request_id="r~d",
            prompt_token_ids=prompt + first[-1].new_token_ids,
            sampling=SamplingParams(max_tokens=4, ignore_eos=True),
            num_output_tokens_before=1,
        ),
    )
    assert sum(len(o.new_token_ids) for o in outputs) == 4
    assert decode.num_kv_injected == 1
    # four decode steps of one sequence, no 1000-token prefill (which alone models ~30 ms)
    decode_step = decode.runner.timing.base_ms * 1e-3
    assert decode.runner.simulated_seconds - before < 4 * decode_step + 0.002
    assert prefill.release_kv("r") == 63 and prefill.kv.num_pinned_blocks == 0


def test_transfer_time_follows_the_bandwidth():
    model = TransferModel(bandwidth_gbps=50.0, latency_ms=1.0)
    assert model.seconds(0) == 0.0
    assert model.seconds(4096) == pytest.approx(1e-3 + 4096 * 131072 / 50e9)
    assert TransferModel(bandwidth_gbps=100.0).seconds(4096) < model.seconds(4096)
    with pytest.raises(ValueError, match="bandwidth"):
        TransferModel(bandwidth_gbps=0)
