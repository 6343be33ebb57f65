"""The offline API: `LLM(model).generate(prompts, SamplingParams)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.device import engine_device
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.protocol import EngineOutput, EngineRequest, SamplingParams
from shoal.tokenizer import IncrementalDetokenizer, TextTokenizer

Prompt = str | list[int]


LARGE_GPU_BYTES = 70 * 2**30


def offline_token_budget(gpu_memory_bytes: int | None) -> int:
    """Tokens per step for offline runs when none is given: 16384 on a GPU of 70 GiB or more
    (prefill in bigger steps, as vLLM's offline LLM class does there), else the engine's 8192."""
    if gpu_memory_bytes is not None and gpu_memory_bytes >= LARGE_GPU_BYTES:
        return 16384
    return EngineConfig.max_num_batched_tokens


def _gpu_memory_bytes(device: str | None) -> int | None:
    """Total memory of the GPU the engine will run on, None when it runs on the CPU."""
    target = engine_device(device)
    if target.type != "cuda":
        return None
    return torch.cuda.get_device_properties(target).total_memory


class LLM:
    def __init__(self, model: str, **engine_options) -> None:
        if "max_num_batched_tokens" not in engine_options:
            memory = _gpu_memory_bytes(engine_options.get("device"))
            engine_options["max_num_batched_tokens"] = offline_token_budget(memory)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = TextTokenizer(engine_options.get("tokenizer") or self.engine.model_dir)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        A request the engine refuses (a grammar that does not compile) raises ValueError
        with the engine's message, after stopping every prompt of the call.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        results = {}
        for prompt, sp in zip(prompts, params, strict=True):
            rid = str(next(self._ids))
            results[rid] = self._add(rid, prompt, sp)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id].update(out, self.engine)
        except ValueError:
            for rid in results:  # the other prompts of this call stop with it
                self.engine.abort(rid)
            raise
        return [r.output for r in results.values()]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode_chat(conv, add_generation_prompt) for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _add(self, rid: str, prompt: Prompt, sp: SamplingParams) -> _Tracker:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        request = EngineRequest(
            request_id=rid, prompt_token_ids=token_ids, sampling=sp, eos_token_ids=eos
        )  # the engine adds the model's own EOS ids
        self.engine.add_request(request)
        return _Tracker(RequestOutput(rid, text, token_ids, []), sp, self.tokenizer)


class _Tracker:
    """Accumulates one request's engine outputs into text, applying stop strings."""

    def __init__(self, output: RequestOutput, sp: SamplingParams, tok: TextTokenizer) -> None:
        self.output = output
        self.output.outputs = [
            CompletionOutput(i, logprobs=[] if sp.logprobs is not None else None)
            for i in range(sp.n)
        ]
        self.detoks = [
            IncrementalDetokenizer(
                tok.tokenizer, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens
            )
            for _ in range(sp.n)
        ]

    def update(self, out: EngineOutput, engine: LLMEngine) -> None:
        if out.finish_reason == "error":
            raise ValueError(out.error or "the engine refused the request")
        seq = self.output.outputs[out.index]
        if seq.finish_reason is not None:
            return
        seq.token_ids += out.new_token_ids
        if out.new_logprobs:
            seq.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.output.prompt_logprobs = out.prompt_logprobs
        self.output.num_cached_tokens = out.num_cached_tokens
        detok = self.detoks[out.index]
        seq.text += detok.add_tokens(out.new_token_ids, final=out.finished)
        if detok.stop_reason is not None:
            seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            engine.abort(out.request_id, out.index)
        elif out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
