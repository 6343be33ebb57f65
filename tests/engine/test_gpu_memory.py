"""GPU memory sizing: with the KV cache sized for gpu_memory_utilization 0.9, the largest
steps the engine runs stay inside 0.9 of the GPU (needs CUDA for the GPU test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine, profile_prompt_lengths
from shoal.protocol import EngineRequest, SamplingParams

# real shapes, random weights generated on the GPU (load_format="dummy")
SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}
UTILIZATION, BUDGET_TOKENS, MAX_SEQS, MAX_MODEL_LEN = 0.9, 16384, 256, 4096
GIB = 2**30


@pytest.mark.parametrize(
    ("tokens", "seqs", "max_len", "expected"),
    [
        (16384, 256, 4096, [64] * 256),  # every sequence in the step is sampled
        (16384, 5, 4096, [3277] * 4 + [3276]),
        (16384, 3, 4096, [4095] * 3),  # three prompts under max_model_len hold no more
        (100, 256, 4096, [1] * 100),  # no more sequences than tokens
        (10, 3, 4096, [4, 3, 3]),
    ],
)
def test_profile_prompt_lengths_fill_the_largest_step(tokens, seqs, max_len, expected):
    assert profile_prompt_lengths(tokens, seqs, max_len) == expected


def used_bytes(peak: int) -> int:
    """Device memory in use with torch at `peak`: that plus everything outside torch."""
    free, total = torch.cuda.mem_get_info()
    return peak + total - free - torch.cuda.memory_reserved()


def run(engine: LLMEngine, lengths: list[int], max_tokens: int, tag: str) -> None:
    """Prompts of these lengths together, sampled with every filter and 20 logprobs."""
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20, max_tokens=max_tokens
    )
    for i, n in enumerate(lengths):
        ids = rng.integers(0, vocab, n).tolist()
        engine.add_request(EngineRequest(request_id=f"{tag}{i}", prompt_token_ids=ids, sampling=sp))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_largest_steps_stay_under_the_utilization(tmp_path, shape):
    config = {**SHAPES[shape], "torch_dtype": "bfloat16", "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=BUDGET_TOKENS,
            gpu_memory_utilization=UTILIZATION,
            enable_prefix_caching=False,
        )
    )
    try:
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        # a full-budget prefill step of 256 sampled prompts, then full decode batches
        run(engine, [BUDGET_TOKENS // MAX_SEQS] * MAX_SEQS, 4, "short")
        # a full-budget step of the longest prompts that leave room for two outputs
        longest = MAX_MODEL_LEN - 2
        run(engine, [longest] * 4 + [BUDGET_TOKENS - 4 * longest], 2, "long")
        torch.cuda.synchronize()
        limit = UTILIZATION * total
        allocated = used_bytes(torch.cuda.max_memory_allocated())
        reserved = used_bytes(torch.cuda.max_memory_reserved())
        report = f"in use {allocated / GIB:.2f} GiB allocated, {reserved / GIB:.2f} GiB reserved"
        report += f"; limit {limit / GIB:.2f} GiB"
        assert allocated <= reserved <= limit, report
        # and the cache takes the memory it was given: the sizing is not merely cautious
        assert reserved > limit - 1.5 * GIB, report
    finally:
        del engine
        torch.cuda.empty_cache()


@pytest.mark.parametrize(("max_seqs", "max_tokens"), [(1, 64), (2, 1), (2, 64)])
def test_the_profiles_sampled_steps_fit_one_step(llama_dir, max_seqs, max_tokens):
    """After its largest step the memory profile samples at 1 row and at 2 (the sampler's
    kernels load by row-count range); an engine whose step holds one sequence or one token
    runs only the first (the other could not be one step). Run on the CPU engine: the
    steps are the same there."""
    config = EngineConfig(
        model=str(llama_dir),
        device="cpu",
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens,
    )
    engine = LLMEngine(config)
    steps = []
    run_step = engine._run_profile_step
    engine._run_profile_step = lambda lengths: steps.append(lengths) or run_step(lengths)
    engine._load_sampler_kernels()
    assert steps == [[1], [1, 1]][: min(max_seqs, max_tokens)]
    assert not engine.has_unfinished_requests()
