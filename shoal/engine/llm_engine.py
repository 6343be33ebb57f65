"""LLMEngine: the synchronous engine core (add requests, step, abort) over token ids."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shoal.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.model_runner import ModelRunner, StepHandle, kv_bytes_per_block, run_profile_step
from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shoal.kv_hash import extra_key
from shoal.models.config import ModelConfig
from shoal.models.loader import load_model, resolve_model_dir
from shoal.protocol import EngineOutput, EngineRequest, KVEvent, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Step:
    """A batch launched on the runner and not yet completed."""

    sched: SchedulerOutput
    starts: list[int]  # each sequence's num_computed_tokens before the step
    handle: StepHandle | None = None
    needs_history: bool = False  # a sequence it samples uses penalties


def engine_device(device: str | None) -> torch.device:
    """The device an engine runs on: the one given, else CUDA when present, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self._init_config(config, engine_device(config.device))
        t0 = time.perf_counter()
        model = load_model(self.model_dir, self.model_config, self.device, config.load_format)
        load_time = time.perf_counter() - t0
        num_blocks = self._num_kv_blocks(model)
        self._init_core(num_blocks)
        generator = torch.Generator(self.device).manual_seed(config.seed)
        self.runner = ModelRunner(
            model,
            self.model_config,
            self.kv,
            self.device,
            generator,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=config.enforce_eager,
        )
        graph_time = self.runner.capture_graphs()
        log.info(
            "engine ready in %.2fs (weights %.2fs, graphs %.2fs): %s on %s, "
            "%d KV blocks of %d tokens = %d tokens of KV cache",
            time.perf_counter() - t0,
            load_time,
            graph_time,
            self.model_config.architecture,
            self.device,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
        )

    def _init_config(self, config: EngineConfig, device: torch.device) -> None:
        """The model's folder and config, the device, context length and EOS ids."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir, config.dtype)
        self.device = device
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)

    def _init_core(self, num_blocks: int) -> None:
        """The KV block pool of num_blocks blocks, the scheduler over it, the request map."""
        config = self.config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv,
        )
        self.requests: dict[str, list[Request]] = {}  # request id -> its sequences
        self._in_flight: _Step | None = None  # launched, not yet completed (async scheduling)
        async_default = self.device.type == "cuda"
        self.async_scheduling = (
            async_default if config.async_scheduling is None else config.async_scheduling
        )

    def _max_model_len(self) -> int:
        cfg, wanted = self.model_config, self.config.max_model_len
        limit = cfg.max_position_embeddings
        if cfg.sliding_window is not None and cfg.sliding_window < limit:
            limit = cfg.sliding_window  # no sliding-window attention: stay inside the window
        if wanted is not None and wanted > limit:
            raise ValueError(
                f"max_model_len {wanted} exceeds what the model supports ({limit}: "
                "max_position_embeddings, or sliding_window which shoal does not implement)"
            )
        return wanted or limit

    def _num_kv_blocks(self, model: torch.nn.Module) -> int:
        cfg, config = self.model_config, self.config
        if config.num_gpu_blocks is not None:
            return config.num_gpu_blocks
        per_block = kv_bytes_per_block(cfg, config.block_size, cfg.dtype)
        budget = config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            budget = self._profile_kv_budget(model)
        if budget is None:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache memory {budget} bytes holds no block of {per_block} bytes")
        return num_blocks

    def _profile_kv_budget(self, model: torch.nn.Module) -> int:
        """GPU bytes left for the KV cache: the utilization share minus weights, the peak
        activations of a full-budget step, and memory used outside this process's torch."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        torch.cuda.reset_peak_memory_stats(self.device)
        run_profile_step(model, self.model_config, tokens, self.config.block_size, self.device)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - outside_torch
        log.info(
            "GPU memory: total %.1f GiB, weights+activations peak %.2f GiB, "
            "other processes %.2f GiB -> KV cache %.2f GiB",
            total / 2**30,
            peak / 2**30,
            outside_torch / 2**30,
            budget / 2**30,
        )
        torch.cuda.empty_cache()
        return budget

    # ---- requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ValueError if it can never be served."""
        rid, sp = request.request_id, request.sampling
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt = list(request.prompt_token_ids)
        self._validate(prompt, sp)
        max_tokens = (
            sp.max_tokens if sp.max_tokens is not None else self.max_model_len - len(prompt)
        )
        eos = frozenset(request.eos_token_ids) | self.eos_token_ids
        key = extra_key(request.lora_id)
        seqs: list[Request] = []
        for i in range(sp.n):
            seqs.append(
                Request(
                    rid if sp.n == 1 else f"{rid}#{i}",
                    prompt,
                    sp,
                    eos,
                    max_tokens,
                    output_id=rid,
                    index=i,
                    extra_key=key,
                    lora_id=request.lora_id,
                    seed=None if sp.seed is None else sp.seed + i,
                    leader=seqs[0] if seqs and self.config.enable_prefix_caching else None,
                )
            )
        self.requests[rid] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def _validate(self, prompt: list[int], sp: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}"
            )
        if sp.max_tokens is not None and len(prompt) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sp.max_tokens}) = "
                f"{len(prompt) + sp.max_tokens} exceeds max_model_len {self.max_model_len}"
            )
        total = len(prompt) + (sp.max_tokens or self.max_model_len - len(prompt))
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {total} tokens of KV cache; the pool holds "
                f"{self.kv.num_blocks * self.kv.block_size}"
            )

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its n sequences) now and free its KV blocks.

        Unknown ids are ignored.
        """
        seqs = self.requests.get(request_id)
        if not seqs:
            return
        stopped = seqs if index is None else [seqs[index]]
        for seq in stopped:
            seq.finish_reason = seq.finish_reason or "abort"
        self.scheduler.finish(stopped)
        if all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # ---- the step

    def step(self) -> list[EngineOutput]:
        """Run one scheduled batch through the model and report every sequence's news.

        With async scheduling the batch is launched on the device and the outputs returned
        are those of the previous batch: the host schedules and prepares step N+1 while the
        device runs step N. Each sequence then counts the token step N is sampling for it as
        a placeholder, and a sequence that stops on a token sampled at step N has one wasted
        token computed in step N+1 (one that reaches max_tokens is not scheduled again). A
        batch whose sequences sample with penalties (which read the tokens themselves) waits
        for the step before it.
        """
        outputs: list[EngineOutput] = []
        if self._in_flight is not None and self._in_flight.needs_history:
            outputs, self._in_flight = self._complete(self._in_flight), None
        sched = self.scheduler.schedule()
        launched = self._launch(sched) if sched.requests else None
        if self._in_flight is not None:
            outputs += self._complete(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._complete(launched)
            self._in_flight = None
        return outputs

    def _launch(self, sched: SchedulerOutput) -> _Step:
        """Start the batch on the runner and advance its sequences past the scheduled tokens."""
        step = _Step(sched, [r.num_computed_tokens for r in sched.requests])
        step.handle = self.runner.launch(sched)
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens + req.num_placeholders:
                req.num_placeholders += 1  # sampled by this step
                step.needs_history = step.needs_history or req.needs_token_history
        return step

    def _complete(self, step: _Step) -> list[EngineOutput]:
        """Wait for a launched batch's tokens and apply them: stops, cache, outputs."""
        result = self.runner.collect(step.handle)
        sampled, logprobs, prompt_logprobs = result.sampled, result.logprobs, result.prompt_logprobs
        finished: list[Request] = []
        touched: list[Request] = []
        for req, start in zip(step.sched.requests, step.starts, strict=True):
            if req.is_finished:
                continue  # stopped or aborted while this step ran: its work here is void
            rid = req.request_id
            prompt_lps = prompt_logprobs.get(rid) if prompt_logprobs else None
            if prompt_lps and len(req.prompt_logprobs) == start:
                req.prompt_logprobs += prompt_lps  # (a recompute after preemption adds none)
            token = sampled.get(rid)
            if token is not None:
                req.num_placeholders -= 1
                req.append_token(token)
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_blocks(req)
            if token is None:
                continue
            if logprobs and rid in logprobs:
                req.new_logprobs.append(logprobs[rid])
            touched.append(req)
            if req.check_stop(self.max_model_len):
                finished.append(req)
        self.scheduler.finish(finished)
        outputs = [self._output(req) for req in touched]
        for req in finished:
            seqs = self.requests.get(req.output_id)
            if seqs is not None and all(s.is_finished for s in seqs):
                del self.requests[req.output_id]
        return outputs

    def _output(self, req: Request) -> EngineOutput:
        new = req.all_token_ids[req.num_prompt_tokens + req.num_emitted :]
        first = req.num_emitted == 0
        req.num_emitted += len(new)
        out = EngineOutput(
            request_id=req.output_id,
            index=req.index,
            new_token_ids=new,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        if req.sampling.logprobs is not None:
            out.new_logprobs, req.new_logprobs = req.new_logprobs, []
        if first and req.wants_prompt_logprobs:
            out.prompt_logprobs = [None, *req.prompt_logprobs]
        return out

    # ---- state for the serving layer

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
