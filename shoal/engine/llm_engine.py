"""LLMEngine: the synchronous engine core (add requests, step, abort) over token ids."""

from __future__ import annotations

import gc
import logging
import time
from array import array
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.device import engine_device
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_offload import OffloadConfig, OffloadManager, admit
from shoal.engine.model_runner import ModelRunner, StepHandle, kv_bytes_per_block
from shoal.engine.parallel.executor import Followers, RankDiedError
from shoal.engine.parallel.group import OffloadCommand
from shoal.engine.parallel.kv_shards import from_bytes, join_heads, split_heads, to_bytes
from shoal.engine.parallel.memory import (
    begin_profile,
    configured_kv_budget,
    measure_kv_budget,
    profiles_memory,
)
from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shoal.kv_hash import extra_key, hash_blocks
from shoal.layers.parallel import TPGroup, head_shards
from shoal.models.config import ModelConfig
from shoal.models.loader import load_model, resolve_model_dir
from shoal.protocol import (
    EngineOutput,
    EngineRequest,
    KVEvent,
    KVLayout,
    KVTransferParams,
    SamplingParams,
)

log = logging.getLogger(__name__)
SHORT_PROMPT_TOKENS = 512  # prompts checked with max() rather than numpy (see _validate)


@dataclass
class _Step:
    """A batch launched on the runner and not yet completed."""

    sched: SchedulerOutput
    starts: list[int]  # each sequence's num_computed_tokens before the step
    handle: StepHandle | None = None
    needs_history: bool = False  # a sequence it samples uses penalties or a grammar


def fewest_kv_blocks(counts: list[int], per_block: int) -> int:
    """The KV pool size every rank can hold: the fewest blocks any rank has room for
    (counts: each rank's, rank 0 first); raises if that is none."""
    num_blocks = min(counts)
    rank = counts.index(num_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache memory of tensor-parallel rank {rank} holds no block of {per_block} bytes"
            if len(counts) > 1
            else f"KV cache memory holds no block of {per_block} bytes"
        )
    if len(set(counts)) > 1:
        log.info("KV cache: %d blocks a rank, set by rank %d (ranks: %s)", num_blocks, rank, counts)
    return num_blocks


def profile_prompt_lengths(max_batched_tokens: int, max_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths that fill the largest step the engine can run: max_batched_tokens
    tokens (fewer if max_seqs prompts under max_model_len cannot hold them) in as many
    prompts as allowed, so the step samples as many sequences as a step can."""
    tokens = min(max_batched_tokens, max_seqs * max(1, max_model_len - 1))
    count = min(max_seqs, tokens)
    base, extra = divmod(tokens, count)
    return [base + 1] * extra + [base] * (count - extra)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self._init_config(config, engine_device(config.device))
        t0 = time.perf_counter()
        self._start_followers()
        try:
            model = load_model(
                self.model_dir, self.model_config, self.device, config.load_format, self.tp
            )
            if self.followers is not None:
                self.followers.wait_ready()
            load_time = time.perf_counter() - t0
            num_blocks = self._num_kv_blocks(model)
            self._build(model, num_blocks)
            graph_time = self._capture_graphs()
        except BaseException:
            self.shutdown()
            raise
        self._attach_offload()
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

    def _build(self, model: torch.nn.Module, num_blocks: int) -> None:
        """The core over a KV pool of num_blocks blocks and a model runner bound to it."""
        config = self.config
        self._init_core(num_blocks)
        generator = torch.Generator(self.device).manual_seed(config.seed)
        if self.followers is not None:
            self.followers.build(
                num_blocks, config.max_num_seqs, self.max_model_len, config.enforce_eager
            )
        self.runner = ModelRunner(
            model,
            self.model_config,
            num_blocks,
            config.block_size,
            self.device,
            generator,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=config.enforce_eager,
            kv=self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            tp=self.tp,
            followers=self.followers,
        )

    def _capture_graphs(self, profile: bool = False) -> float:
        """Capture the CUDA graphs on every rank; seconds spent on this one."""
        if self.followers is not None:
            self.followers.capture_graphs(profile)
        return self.runner.capture_graphs(profile)

    def _start_followers(self) -> None:
        """With tensor_parallel_size > 1: check the model splits, start ranks 1.., join them."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return
        cfg = self.model_config
        head_shards(cfg.num_heads, cfg.num_kv_heads, TPGroup(0, size))
        if cfg.intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide "
                f"intermediate_size {cfg.intermediate_size}"
            )
        self.followers = Followers(self.config, self.device)
        self.device, self.tp = self.followers.device, self.followers.tp

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine cannot step after)."""
        if getattr(self, "followers", None) is not None:
            self.followers.close()

    def _attach_offload(self) -> None:
        """The lower KV tiers under the runner's cache (docs/kv-offload.md), if configured."""
        config = self.config
        if not config.kv_offload_cpu_gb:
            return
        caches = self.runner.kv_caches
        shape = (len(caches), caches[0].shape[0], *caches[0].shape[2:])
        tiers = OffloadConfig(
            int(config.kv_offload_cpu_gb * 2**30),
            config.kv_offload_disk_path,
            int((config.kv_offload_disk_gb or 0) * 2**30),
        )
        pin = self.device.type == "cuda"
        self.kv.offload = OffloadManager(tiers, self.kv, shape, caches[0].dtype, pin)
        self.kv.offload.bind(caches)
        if self.followers is not None:
            disk = self.kv.offload.disk
            self.followers.attach_offload(
                OffloadCommand(
                    self.kv.offload.host.capacity,
                    tiers.disk_path,
                    0 if disk is None else disk.capacity,
                )
            )
            self.kv.offload.mirror = self.followers
        log.info(
            "KV offload: host tier %d blocks%s",
            self.kv.offload.host.capacity,
            f", disk tier {self.kv.offload.disk.capacity} blocks in {tiers.disk_path}"
            if self.kv.offload.disk is not None
            else "",
        )

    def _init_config(self, config: EngineConfig, device: torch.device) -> None:
        """The model's folder and config, the device, context length and EOS ids."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir, config.dtype)
        self.device = device
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.tp: TPGroup = TPGroup()  # this process's rank: 0 of tensor_parallel_size
        self.followers: Followers | None = None  # the other ranks
        self.kv_blocks_by_rank: list[int] | None = None  # each rank's room, when measured
        self._grammars = None  # GrammarCompilerPool, built for the first structured request

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
        # structured-output requests whose grammar compiles in the pool, not yet queued
        self._compiling: list[tuple[Future, list[Request]]] = []
        # disaggregation: prefills to pin for a decode worker, the pinned requests' transfer
        # parameters, KV staged for a request about to arrive, and those waiting to start
        self._remote_decode: set[str] = set()
        self.pinned: dict[str, KVTransferParams] = {}
        self._staged: dict[str, tuple[int, torch.Tensor]] = {}
        self._injecting: deque[tuple[Request, int, torch.Tensor]] = deque()
        self.num_kv_injected = 0  # requests started from transferred KV
        self.num_kv_inject_fallbacks = 0  # requests with staged KV prefilled here instead
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
        """KV blocks per rank: as set, else the fewest any rank has room for (each rank
        measures its own, so none holds more than it can)."""
        config = self.config
        if config.num_gpu_blocks is not None:
            return config.num_gpu_blocks
        per_block = kv_bytes_per_block(
            self.model_config, config.block_size, self.model_config.dtype, self.tp
        )
        if profiles_memory(config, self.device):
            counts = self._profile_kv_blocks(model, per_block)
        else:
            counts = [configured_kv_budget(config) // per_block]
            if self.followers is not None:
                counts += self.followers.measure_kv_blocks()
        self.kv_blocks_by_rank = counts
        return fewest_kv_blocks(counts, per_block)

    def _profile_kv_blocks(self, model: torch.nn.Module, per_block: int) -> list[int]:
        """The KV blocks each rank has room for (rank 0 first), measured on its GPU: the
        utilization share less memory used outside the process's torch and less all the
        rank holds at its peak apart from the cache.

        That peak is measured, not estimated: the engine is built over a scratch KV pool
        just big enough for its largest step, captures its decode graphs, runs that step
        through `step` and is taken down again. The scratch pool is not counted.
        """
        begin_profile(self.device)
        prompts = profile_prompt_lengths(
            self.config.max_num_batched_tokens, self.config.max_num_seqs, self.max_model_len
        )
        blocks = sum(-(-(n + 1) // self.config.block_size) for n in prompts)
        self._build(model, blocks)
        self._capture_graphs(profile=True)
        self._run_profile_step(prompts)
        self._load_sampler_kernels()
        profile = measure_kv_budget(
            self.device, self.config.gpu_memory_utilization, blocks * per_block
        )
        theirs = self.followers.measure_kv_blocks() if self.followers is not None else []
        self._take_down(model)
        log.info(
            "GPU memory: total %.1f GiB; weights, buffers, graphs and the largest step "
            "(%d tokens in %d sequences) %.2f GiB; outside torch %.2f GiB -> KV cache %.2f GiB",
            profile.total / 2**30,
            sum(prompts),
            len(prompts),
            profile.held / 2**30,
            profile.outside_torch / 2**30,
            profile.budget / 2**30,
        )
        return [max(profile.budget, 0) // per_block, *theirs]

    def _run_profile_step(self, prompt_lengths: list[int]) -> None:
        """One step of every prompt at once, each sampled with every filter and 20 logprobs
        (the sampler's largest working set)."""
        sp = SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20, max_tokens=1
        )
        draw = torch.Generator().manual_seed(0)
        for i, n in enumerate(prompt_lengths):
            ids = torch.randint(0, self.model_config.vocab_size, (n,), generator=draw).tolist()
            request = EngineRequest(request_id=f"profile-{i}", prompt_token_ids=ids, sampling=sp)
            self.add_request(request)
        seqs = [seq for seqs in self.requests.values() for seq in seqs]
        self.step()
        if any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
            raise RuntimeError("the profile batch did not fit in one step")
        while self.has_unfinished_requests():
            self.step()

    def _load_sampler_kernels(self) -> None:
        """Sample with every filter and 20 logprobs at 1 row and at 2, as the profile step
        did at its row count. CUDA loads a kernel on its first launch and the load waits for
        the device; the sampler's sorts and top-k pick their kernels by row count, the same
        within each range (1 row, 2 to about 100, the rest: docs/gpu.md), so these two steps
        and the profile's load every range's (as many of the two as one step can hold)."""
        config = self.config
        for rows in range(1, min(2, config.max_num_seqs, config.max_num_batched_tokens) + 1):
            self._run_profile_step([1] * rows)

    def _take_down(self, model: torch.nn.Module) -> None:
        """Free the runner, its graphs and its KV pool."""
        del self.runner, self.scheduler, self.kv
        if self.followers is not None:
            self.followers.take_down()
        for layer in model.attention_layers():
            layer.kv_cache = torch.empty(0)
        gc.collect()
        torch.cuda.empty_cache()

    # ---- requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ValueError if it can never be served."""
        rid, sp = request.request_id, request.sampling
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        self._validate(request.prompt_token_ids, sp)
        prompt = request.prompt_token_ids.tolist()
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
                    num_output_tokens_before=request.num_output_tokens_before,
                    leader=seqs[0] if seqs and self.config.enable_prefix_caching else None,
                )
            )
        self.requests[rid] = seqs
        staged = self._staged.pop(rid, None)
        if request.kv_transfer is not None and request.kv_transfer.do_remote_decode and sp.n == 1:
            self._remote_decode.add(rid)
        if sp.structured_outputs is not None:
            # queued once its grammar is compiled, off this thread (staged KV goes unused)
            self._compiling.append((self._grammar_pool().submit(sp.structured_outputs), seqs))
            return
        if staged is not None and sp.n == 1:
            self._injecting.append((seqs[0], *staged))
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _validate(self, prompt: array, sp: SamplingParams) -> None:
        """Raise ValueError if the packed prompt or its limits can never be served; the ids
        of a long prompt are checked in one vectorised pass (a Python pass costs ~40 ns a
        token), those of a short one by max() (numpy's call costs more there: 24 us against
        8 us for 40 tokens with cold caches, as a request finds them at low load)."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        short = len(prompt) <= SHORT_PROMPT_TOKENS
        if (max(prompt) if short else int(np.frombuffer(prompt, np.uint32).max())) >= vocab:
            bad = next(t for t in prompt if t >= vocab)
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
        self._staged.pop(request_id, None)
        seqs = self.requests.get(request_id)
        if not seqs:
            return
        stopped = seqs if index is None else [seqs[index]]
        self._remote_decode.discard(request_id)
        if any(waiting is seqs for _, waiting in self._compiling):
            for seq in stopped:
                seq.status = RequestStatus.FINISHED  # not queued yet: it holds nothing
            if all(s.is_finished for s in seqs):
                self._compiling = [c for c in self._compiling if c[1] is not seqs]
        offload = self.kv.offload
        for seq in stopped:
            seq.finish_reason = seq.finish_reason or "abort"
            if offload is not None and offload.cancel(seq):
                seq.status = RequestStatus.FINISHED  # its blocks go when their copy is done
            for i, item in enumerate(self._injecting):
                if item[0] is seq:
                    del self._injecting[i]
                    seq.status = RequestStatus.FINISHED  # it held no blocks yet
                    break
        self.scheduler.finish(stopped)
        if all(s.is_finished for s in seqs):
            del self.requests[request_id]

    @property
    def overlaps_host_work(self) -> bool:
        """Whether host work between steps runs while the device runs the next batch (async
        scheduling), so a short wait of the engine thread there costs the device nothing."""
        return self.async_scheduling

    def has_unfinished_requests(self) -> bool:
        busy_tiers = self.kv.offload is not None and self.kv.offload.busy
        return bool(self.requests) or self._in_flight is not None or busy_tiers

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
        if self.followers is not None:
            self.followers.check()
        if self._in_flight is not None and self._in_flight.needs_history:
            outputs, self._in_flight = self._complete(self._in_flight), None
        if self._injecting:
            self._admit_injected()
        if self._compiling:
            outputs += self._admit_compiled()
        offload = self.kv.offload
        if offload is not None:
            admit(offload, self.scheduler, self.config.max_num_seqs)
        sched = self.scheduler.schedule()
        launched = self._launch(sched) if sched.requests else None
        if self._in_flight is not None:
            outputs += self._complete(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._complete(launched)
            self._in_flight = None
        if offload is not None:
            offload.flush()
        return outputs

    def _launch(self, sched: SchedulerOutput) -> _Step:
        """Start the batch on the runner and advance its sequences past the scheduled tokens."""
        step = _Step(sched, [r.num_computed_tokens for r in sched.requests])
        self.kv.pool.launches += 1
        try:
            step.handle = self.runner.launch(sched)
        except RuntimeError as e:
            if self.followers is not None and not isinstance(e, RankDiedError):
                self.followers.wait_failure(e)
            raise
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens + req.num_placeholders:
                req.num_placeholders += 1  # sampled by this step
                step.needs_history = step.needs_history or req.needs_sync
        return step

    def _grammar_pool(self):
        """The structured-output compiler pool over the model's vocabulary (built once)."""
        if self._grammars is None:
            from shoal.engine.structured import GrammarCompilerPool, tokenizer_info_from_dir

            info = tokenizer_info_from_dir(
                self.model_dir, self.model_config.vocab_size, sorted(self.eos_token_ids)
            )
            self._grammars = GrammarCompilerPool(info)
        return self._grammars

    def _admit_compiled(self) -> list[EngineOutput]:
        """Queue the requests whose grammar is compiled, each sequence with its own matcher;
        end those whose grammar failed with its error. With nothing else to run, wait a little
        for a compile rather than spin."""
        from shoal.engine.structured import RequestGrammar

        if not (self.scheduler.num_unfinished or self._in_flight or self._injecting):
            wait([f for f, _ in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        outputs: list[EngineOutput] = []
        pending = []
        for future, seqs in self._compiling:
            if not future.done():
                pending.append((future, seqs))
                continue
            error = future.exception()
            rid = seqs[0].output_id
            if error is not None:
                del self.requests[rid]
                message = str(error) if isinstance(error, ValueError) else repr(error)
                outputs += [
                    EngineOutput(
                        request_id=rid, index=s.index, finish_reason="error", error=message
                    )
                    for s in seqs
                ]
                continue
            for seq in seqs:
                if seq.is_finished:
                    continue
                seq.grammar = RequestGrammar(future.result(), seq.stop_token_ids)
                before = seq.num_output_tokens_before
                seq.grammar.accept_all(seq.prompt_token_ids[seq.num_prompt_tokens - before :])
                self.scheduler.add(seq)
        self._compiling = pending
        return outputs

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
        if self._remote_decode:
            for req in finished:
                if req.request_id in self._remote_decode:
                    self._remote_decode.discard(req.request_id)
                    if req.finish_reason == "length":
                        self._pin(req)
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
        if req.finish_reason is not None and self.pinned:
            out.kv_transfer = self.pinned.get(req.request_id)
        return out

    # ---- disaggregated prefill: KV export (prefill side) and injection (decode side)

    @property
    def kv_layout(self) -> KVLayout:
        """The layout of this engine's KV blocks as a transfer moves them."""
        cfg = self.model_config
        return KVLayout(
            num_layers=cfg.num_layers,
            block_size=self.kv.block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=str(cfg.dtype).removeprefix("torch."),
        )

    def _pin(self, req: Request) -> None:
        """Keep a finished prefill's prompt blocks for a decode worker to pull."""
        n = req.num_prompt_tokens
        blocks = self.kv.pin(req, n)
        self.pinned[req.request_id] = KVTransferParams(
            request_id=req.request_id,
            block_ids=[b.block_id for b in blocks],
            block_hashes=req.update_block_hashes(self.kv.block_size)[: n // self.kv.block_size],
            num_tokens=n,
            layout=self.kv_layout,
        )

    def release_kv(self, request_id: str) -> int:
        """Unpin a prefill's blocks (unknown ids: none); returns how many were pinned."""
        self.pinned.pop(request_id, None)
        return self.kv.unpin(request_id)

    def read_kv_blocks(self, request_id: str, first: int, count: int) -> torch.Tensor:
        """A host copy of pinned blocks first..first+count of a prefill (KVLayout's shape)."""
        params = self.pinned.get(request_id)
        if params is None:
            raise ValueError(f"no KV blocks pinned for request {request_id!r}")
        block_ids = params.block_ids[first : first + count]
        own = self.runner.read_blocks(block_ids)
        if self.followers is None:
            return own
        replies = self.followers.read_kv(block_ids)
        shards = [from_bytes(raw, own.dtype, own.shape) for raw in replies]
        return join_heads([own, *shards], self.model_config)

    def num_cached_prefix_blocks(self, token_ids: list[int], lora_id: int | None = None) -> int:
        """Leading full blocks of these tokens held in the prefix cache now."""
        hashes = hash_blocks(token_ids, self.kv.block_size, extra_key(lora_id))
        return self.kv.num_cached_prefix_blocks(hashes)

    def stage_kv(self, request_id: str, first_block: int, data: torch.Tensor) -> None:
        """Hold the prompt KV from block first_block on for the request about to be added
        under this id (its prompt: the prefill's prompt and first token)."""
        self._staged[request_id] = (first_block, data)

    def _admit_injected(self) -> None:
        """Start the requests with transferred KV, first in line for seats and blocks."""
        while self._injecting and len(self.scheduler.running) < self.config.max_num_seqs:
            seq, first, data = self._injecting[0]
            if not self._inject(seq, first, data):
                return
            self._injecting.popleft()

    def _inject(self, seq: Request, first: int, data: torch.Tensor) -> bool:
        """Give `seq` blocks holding its prompt's KV: cache hits, then the transferred
        blocks; False to wait for free blocks. Where the transfer cannot be used (cached
        blocks evicted meanwhile, a mismatched shape, a pool that stays short) the request
        is queued to prefill here instead."""
        size, n = self.kv.block_size, seq.num_tokens - 1
        hits, _ = self.kv.get_computed_blocks(seq)
        total = self.kv.blocks_needed(n)
        usable = len(hits) >= first and data.shape[2] == total - first
        if usable and not self.kv.allocate_slots(seq, seq.num_tokens - len(hits) * size, hits):
            if self.scheduler.running:
                return False
            usable = False
        if not usable:
            log.info("request %s: transferred KV unusable, prefilling here", seq.request_id)
            self.num_kv_inject_fallbacks += 1
            self.scheduler.add(seq)
            return True
        ids = self.kv.block_ids(seq)[len(hits) : total]
        if ids:
            self._write_kv(ids, data[:, :, len(hits) - first :])
        seq.num_computed_tokens = n
        seq.num_cached_tokens = len(hits) * size
        seq.status = RequestStatus.RUNNING
        self.scheduler.running.append(seq)
        self.kv.cache_blocks(seq)
        self.num_kv_injected += 1
        return True

    def _write_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite these blocks with whole blocks' KV (KVLayout's), each rank its heads."""
        if self.followers is None:
            self.runner.write_blocks(block_ids, data)
            return
        own, *theirs = split_heads(data, self.model_config, self.tp.size)
        self.followers.write_kv(block_ids, [to_bytes(shard) for shard in theirs])
        self.runner.write_blocks(block_ids, own)

    # ---- state for the serving layer

    def enable_kv_events(self) -> None:
        """Keep the KV events from now on, for take_kv_events (a worker publishing them)."""
        self.kv.keep_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call (none unless enable_kv_events was called)."""
        return self.kv.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
