"""Reference outputs from transformers and small helpers shared by the engine tests."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal import LLM, SamplingParams


@functools.cache
def hf_model(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare whole sequences, EOS included
    return model.eval()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, EOS ignored."""
    import transformers

    model = hf_model(path)
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=4
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab, n).tolist() for n in lengths]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_no_leaks(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.rows and not kv.block_table.table.any()


def outputs(llm: LLM, prompts, params):
    """Each sequence's tokens, finish and stop reasons, logprob ids and ranks, and the
    logprob values apart (see assert_same)."""
    seqs = [c for o in llm.generate(prompts, params) for c in o.outputs]
    exact = [(c.token_ids, c.finish_reason, c.stop_reason) for c in seqs]
    lps = [c.logprobs or [] for c in seqs]
    exact.append([[(lp.token_ids, lp.ranks) for lp in seq] for seq in lps])
    return exact, [x for seq in lps for lp in seq for x in lp.logprobs]


def assert_same(got, expected) -> None:
    """Equal but for logprob values within 1e-4: a batch that still holds a stopped
    sequence's extra row can move float sums in the 6th digit."""
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-4)
