"""A request inside the engine: its tokens, progress, sampling state and KV block hashes."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from shoal.kv_hash import hash_blocks
from shoal.protocol import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from shoal.engine.structured import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    """One sequence being generated (a request with n > 1 becomes n of these)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        *,
        output_id: str | None = None,
        index: int = 0,
        extra_key: bytes = b"",
        lora_id: int | None = None,
        seed: int | None = None,
        leader: Request | None = None,
        num_output_tokens_before: int = 0,
    ) -> None:
        """num_output_tokens_before: the last tokens of the prompt that were this sequence's
        own output before it migrated here (see EngineRequest)."""
        self.request_id = request_id
        self.output_id = output_id or request_id  # the id its outputs are reported under
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else eos_token_ids
        )
        self.extra_key = extra_key
        self.lora_id = lora_id
        self.leader = leader  # a sibling whose prompt blocks this one waits to share
        # the output's grammar matcher (structured outputs); set before it is scheduled
        self.grammar: RequestGrammar | None = None
        # greedy without penalties, min_tokens, logprobs or a grammar: the logits' argmax alone
        self.argmax_only = (
            sampling.structured_outputs is None
            and sampling.greedy
            and sampling.logprobs is None
            and sampling.min_tokens == 0
            and sampling.repetition_penalty == 1.0
            and not sampling.presence_penalty
            and not sampling.frequency_penalty
        )
        self.num_output_tokens_before = num_output_tokens_before
        self.generator: torch.Generator | None = None
        # draws of the generator that the earlier output used; the sampler skips them first
        self.draws_to_skip = 0
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)
            self.draws_to_skip = 0 if sampling.greedy else num_output_tokens_before
        self.status = RequestStatus.WAITING
        self.arrival = 0  # its place in the order requests reached the scheduler
        self.num_computed_tokens = 0
        # tokens sampled by a step still running on the device (async scheduling): counted
        # as computed and scheduled for, their values not known yet (0 or 1)
        self.num_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.block_hashes: list[int] = []
        self.num_emitted = 0  # output tokens already reported
        self.new_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far, counting any still being sampled on the device."""
        return len(self.all_token_ids) + self.num_placeholders - self.num_prompt_tokens

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the output tokens themselves (penalties), not only counts."""
        s = self.sampling
        return s.repetition_penalty != 1.0 or bool(s.presence_penalty or s.frequency_penalty)

    @property
    def needs_sync(self) -> bool:
        """Whether its next step needs this step's outputs processed first (penalties read
        the token history; a grammar instead takes its pending token when it is masked)."""
        return self.needs_token_history

    @property
    def output_token_ids(self) -> list[int]:
        """Every output token, those generated before a migration included (penalties)."""
        return self.all_token_ids[self.num_prompt_tokens - self.num_output_tokens_before :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend block_hashes over every full block of the tokens known so far."""
        done = len(self.block_hashes)
        if (done + 1) * block_size <= self.num_tokens:
            parent = self.block_hashes[-1] if done else None
            self.block_hashes += hash_blocks(
                self.all_token_ids, block_size, self.extra_key, parent, start=done * block_size
            )
        return self.block_hashes

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def ends_with_placeholder(self, max_model_len: int) -> bool:
        """Whether the token being sampled on the device is certain to be the last one
        (max_tokens or max_model_len reached), so the sequence needs no further step."""
        if not self.num_placeholders:
            return False
        return (
            self.num_output_tokens >= self.max_tokens
            or self.num_tokens + self.num_placeholders >= max_model_len
        )

    def check_stop(self, max_model_len: int) -> bool:
        """Decide, after a token was appended, whether this sequence is done."""
        tokens = self.all_token_ids
        last, n_out = tokens[-1], len(tokens) - self.num_prompt_tokens
        if last in self.stop_token_ids and n_out >= self.sampling.min_tokens:
            self.finish_reason = "stop"
            self.stop_reason = None if last in self._eos_only() else last
        elif n_out >= self.max_tokens or len(tokens) >= max_model_len:
            self.finish_reason = "length"
        elif self.grammar is not None and self.grammar.done:
            # complete without a stop token (none to take), or off the grammar
            self.finish_reason = "abort" if self.grammar.failed else "stop"
        return self.finish_reason is not None

    def _eos_only(self) -> frozenset[int]:
        return self.stop_token_ids - frozenset(self.sampling.stop_token_ids)
