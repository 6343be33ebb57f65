"""The offline API: `LLM(model).generate(prompts, SamplingParams)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.protocol import EngineOutput, EngineRequest, SamplingParams
from shoal.tokenizer import IncrementalDetokenizer, TextTokenizer

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = TextTokenizer(engine_options.get("tokenizer") or self.engine.model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
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
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                results[out.request_id].update(out, self.engine)
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
