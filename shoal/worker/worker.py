"""Run one engine as a worker: serve `generate` over the request plane until SIGTERM.

If the engine loop dies, the worker withdraws from discovery, fails its streams so that
they can move to other workers, and exits non-zero (SystemExit with a one-line reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator

from shoal.disagg.backends import start_exporters, start_transports
from shoal.disagg.metrics import DisaggMetrics
from shoal.disagg.receiver import KVReceiver
from shoal.disagg.source import PIN_TIMEOUT, KVSource
from shoal.engine.async_llm import AsyncLLM, EngineDeadError
from shoal.engine.llm_engine import LLMEngine
from shoal.models.loader import resolve_model_dir
from shoal.protocol import (
    GENERATE_ENDPOINT,
    KV_AGENT_ENDPOINT,
    KV_BLOCKS_ENDPOINT,
    KV_STATE_ENDPOINT,
    MODEL_FILE_CHUNK,
    MODEL_FILE_NAMES,
    MODEL_FILES_ENDPOINT,
    PREFILL_ENDPOINT,
    EngineOutput,
    EngineRequest,
    KVAgentRequest,
    KVBlocksRequest,
    KVStateDump,
    KVStateRequest,
    LoadReport,
    ModelCard,
    ModelFileChunk,
    ModelFilesRequest,
    model_files_digest,
)
from shoal.runtime.distributed import DistributedRuntime
from shoal.runtime.errors import SHUTDOWN_CODE
from shoal.runtime.event_loop import GIL_SWITCH_INTERVAL_S
from shoal.runtime.request_server import StreamSink
from shoal.worker.kv_publisher import KVPublisher, load_report
from shoal.worker.metrics import StatsLogger, WorkerMetrics

log = logging.getLogger(__name__)

LOAD_INTERVAL = 0.2  # seconds between load reports (and metric refreshes)
DEFAULT_STATS_INTERVAL = 10.0  # seconds between engine stats log lines
MAX_N = 256  # sequences per request
ROLES = ("both", "prefill", "decode")  # a worker's part in disaggregated serving
_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1


def check_request(request: EngineRequest, vocab_size: int) -> None:
    """Raise ValueError naming the field of a request the engine could not run safely.

    The request plane decodes any well-typed request; these are the values a well-typed
    request can still carry that would make an engine step fail (not just this request).
    """
    sp = request.sampling
    if sp.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N} (got {sp.n})")
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, field)
        if value is not None and value > vocab_size:
            raise ValueError(f"{field} must be at most the vocabulary size {vocab_size}")
    if sp.seed is not None and not _INT64[0] <= sp.seed <= _UINT64_MAX - sp.n:
        raise ValueError(f"seed must be a 64-bit integer (got {sp.seed})")
    if request.lora_id is not None and not _INT64[0] <= request.lora_id <= _INT64[1]:
        raise ValueError(f"lora_id must be a signed 64-bit integer (got {request.lora_id})")


def read_model_files(core: LLMEngine) -> dict[str, bytes]:
    """The MODEL_FILE_NAMES files of the engine's tokenizer folder (--tokenizer's, a hub id
    resolved, or the model's): what a frontend needs to serve the model."""
    folder = resolve_model_dir(core.config.tokenizer) if core.config.tokenizer else core.model_dir
    return {
        name: (folder / name).read_bytes() for name in MODEL_FILE_NAMES if (folder / name).is_file()
    }


def file_chunks(files: dict[str, bytes]) -> Iterator[ModelFileChunk]:
    """The files as ModelFileChunks of at most MODEL_FILE_CHUNK bytes (an empty file: one)."""
    for name, data in files.items():
        for start in range(0, max(len(data), 1), MODEL_FILE_CHUNK):
            yield ModelFileChunk(name=name, data=data[start : start + MODEL_FILE_CHUNK])


class Worker:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        publisher: KVPublisher,
        metrics: WorkerMetrics | None = None,
        model_files: dict[str, bytes] | None = None,
    ) -> None:
        """model_files: what the model_files endpoint serves (read_model_files of the
        tokenizer folder; None: nothing, and the card names no files)."""
        self.engine = engine
        self.publisher = publisher
        self.metrics = metrics
        self.stats = StatsLogger()
        core = engine.engine
        self.vocab_size = core.model_config.vocab_size
        self.source: KVSource | None = None  # a prefill worker's pinned KV blocks
        self.receiver: KVReceiver | None = None  # a decode worker's KV pulls
        self.model_files = model_files or {}
        self.card = ModelCard(
            model_name=served_model_name,
            tokenizer=str(core.config.tokenizer or core.model_dir),
            context_length=core.max_model_len,
            kv_block_size=core.kv.block_size,
            num_kv_blocks=core.kv.num_blocks,
            files_digest=model_files_digest(self.model_files) if self.model_files else "",
        )

    def generate(self, request: EngineRequest, sink: StreamSink) -> None:
        """The endpoint's push handler: each engine output goes straight into the stream;
        a request carrying a prefill worker's KV pulls what the engine lacks first."""
        remote = request.kv_transfer
        if remote is not None and remote.request_id and self.receiver is not None:
            task = asyncio.ensure_future(self._receive_then_start(request, sink))
            sink.on_cancel = task.cancel
            return
        self._start(request, sink)

    async def _receive_then_start(self, request: EngineRequest, sink: StreamSink) -> None:
        await self.receiver.receive(request)
        self._start(request, sink)

    def _start(self, request: EngineRequest, sink: StreamSink) -> None:
        """Run the request in the engine, each output straight into the stream.

        A request the engine refuses ends with its error message; one whose engine step
        failed ends with a handler error; if the engine died, the stream ends as if the worker
        shut down, so the request can move elsewhere. Cancelling the stream aborts it.
        """
        request_id = request.request_id
        count = self.stats.count_generated

        def on_output(out: EngineOutput, last: bool) -> None:
            count(len(out.new_token_ids))
            if last and out.kv_transfer is not None and self.source is not None:
                self.source.pinned(out.kv_transfer)
            sink.send(out)
            if last:
                sink.end()

        def on_error(exc: BaseException) -> None:
            if isinstance(exc, EngineDeadError):
                sink.fail(SHUTDOWN_CODE, str(exc))
            elif isinstance(exc, ValueError):
                refuse(exc)
            else:
                sink.fail("handler", f"{type(exc).__name__}: {exc}")

        def refuse(exc: ValueError) -> None:
            sink.send(EngineOutput(request_id=request_id, finish_reason="error", error=str(exc)))
            sink.end()

        try:
            check_request(request, self.vocab_size)
            self.engine.open(request, on_output, on_error)
        except ValueError as e:
            refuse(e)
            return
        except EngineDeadError as e:
            sink.fail(SHUTDOWN_CODE, str(e))
            return
        self.stats.count_prompt(len(request.prompt_token_ids))
        sink.on_cancel = functools.partial(self.engine.cancel, request_id)

    async def model_files_handler(
        self, request: ModelFilesRequest
    ) -> AsyncIterator[ModelFileChunk]:
        """The model_files endpoint: every file, in chunks; nothing if `request.digest` names
        other files than this worker's (the caller's digest check then fails)."""
        if request.digest != self.card.files_digest:
            return
        for chunk in file_chunks(self.model_files):
            yield chunk

    async def kv_state(self, request: KVStateRequest) -> AsyncIterator[KVStateDump]:
        """The resync endpoint: one dump of every block the engine caches."""
        dump = self.publisher.dump(self.card.kv_block_size)
        log.info(
            "KV state dump for a router (%s): %d blocks at seq %d",
            request.reason,
            self.publisher.num_cached,
            dump.seq,
        )
        yield dump

    def _tick(self, core: LLMEngine) -> LoadReport:
        """In the engine thread: refresh what reads the engine, and its load to publish."""
        if self.source is not None:
            self.source.update(core)
        if self.metrics is not None:
            self.metrics.update(core)
        return load_report(self.publisher.worker_id, core, time.time())

    async def report_load(self, interval: float = LOAD_INTERVAL) -> None:
        """Publish the engine's load (and refresh the metrics) every `interval` s, busy or idle."""
        while True:
            self.publisher.publish_load(await self.engine.call(self._tick))
            await asyncio.sleep(interval)

    async def log_stats(self, interval: float) -> None:
        """Log the engine stats line every `interval` seconds (once while idle)."""
        while True:
            await asyncio.sleep(interval)
            line = await self.engine.call(self.stats.line)
            if line is not None:
                log.info("%s", line)


async def serve_worker(
    make_engine: Callable[[], LLMEngine],
    served_model_name: str,
    discovery: str | None,
    host: str = "127.0.0.1",
    port: int = 0,
    drain_timeout: float = 30.0,
    metrics_port: int | None = None,
    *,
    advertise_host: str | None = None,
    plane_secret: str | None = None,
    dead_after: float | None = None,
    stats_interval: float = DEFAULT_STATS_INTERVAL,
    role: str = "both",
    pin_timeout: float = PIN_TIMEOUT,
    kv_transfer_backend: str = "auto",
    kv_events_format: str = "shoal",
) -> None:
    """Start the engine, register, serve until SIGTERM/SIGINT, then drain and exit.

    advertise_host: the host others dial when it differs from `host` (needed to bind
    0.0.0.0); plane_secret: shared secret of the request and event planes (None: off);
    dead_after: seconds of total silence after which a peer counts as dead (None: the
    runtime's default, 60); stats_interval: seconds between engine stats log lines (0: off).
    role: both (aggregated), prefill (serves PREFILL_ENDPOINT and its pinned KV blocks,
    unpinned after pin_timeout s at the latest) or decode (pulls KV with the
    kv_transfer_backend); see docs/disagg.md. kv_events_format: shoal (router hashes) or
    vllm (the engine's events in vLLM's layout); see docs/routing.md.
    Raises SystemExit(1) after withdrawing from discovery if the engine loop dies.
    """
    loop = asyncio.get_running_loop()
    metrics = WorkerMetrics(served_model_name)
    liveness = {} if dead_after is None else {"dead_after": dead_after}
    runtime = DistributedRuntime(
        discovery,
        host=host,
        port=port,
        advertise_host=advertise_host,
        plane_secret=plane_secret,
        **liveness,
    )
    publisher = KVPublisher(
        runtime.instance_id,
        host,
        advertise_host=advertise_host,
        secret=plane_secret,
        events_format=kv_events_format,
    )
    died = asyncio.Event()

    def on_step(core: LLMEngine) -> None:
        events = core.take_kv_events()
        if events:  # sent from the loop: a ZMQ send would give up the engine thread's GIL
            loop.call_soon_threadsafe(publisher.publish_events, events)
        metrics.update(core)

    def on_dead(_exc: BaseException) -> None:
        loop.call_soon_threadsafe(died.set)

    core = await asyncio.to_thread(make_engine)
    core.enable_kv_events()
    engine = AsyncLLM(core, on_step, on_dead)
    metrics.update(engine.engine)
    if metrics_port is not None:
        metrics.serve(metrics_port, host, healthy=lambda: engine.alive)
    files = await asyncio.to_thread(read_model_files, engine.engine)
    worker = Worker(engine, served_model_name, publisher, metrics, files)
    disagg = DisaggMetrics(served_model_name, metrics.registry)
    name = runtime.instance_id
    if role == "prefill":
        exporters = await start_exporters(kv_transfer_backend, engine.engine, name)
        worker.source = KVSource(engine, disagg, pin_timeout, exporters=exporters)
    else:
        transports = await start_transports(
            kv_transfer_backend, runtime.requests, engine.engine, name
        )
        worker.receiver = KVReceiver(engine, transports, engine.engine.kv_layout, disagg)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background = [asyncio.create_task(worker.report_load())]
    if stats_interval > 0:
        background.append(asyncio.create_task(worker.log_stats(stats_interval)))
    await runtime.serve_endpoint(KV_STATE_ENDPOINT, worker.kv_state, KVStateRequest)
    await runtime.serve_endpoint(
        MODEL_FILES_ENDPOINT, worker.model_files_handler, ModelFilesRequest
    )
    if worker.source is not None:
        await runtime.serve_endpoint(KV_BLOCKS_ENDPOINT, worker.source.kv_blocks, KVBlocksRequest)
        await runtime.serve_endpoint(KV_AGENT_ENDPOINT, worker.source.kv_agent, KVAgentRequest)
    served = await runtime.serve_endpoint(
        PREFILL_ENDPOINT if role == "prefill" else GENERATE_ENDPOINT,
        worker.generate,
        EngineRequest,
        push=True,
        card=worker.card,
        extra={"kv_events": publisher.address, "role": role},
    )
    if worker.source is not None:
        worker.source.worker_id = runtime.instance_id
        worker.source.address = served.record.address
    log.info(
        "worker %s (role %s) serving %s at %s, KV events at %s",
        runtime.instance_id,
        role,
        served_model_name,
        served.record.address,
        publisher.address,
    )
    gc.collect()
    gc.freeze()  # the engine's and the model's objects stay out of every full collection
    # The engine thread holds the GIL through each step's host work; the loop thread
    # (requests in, outputs out) would wait up to the interpreter's 5 ms switch interval at
    # each hand-off. With the host tier on, 0.5 ms took onboarded turns' TTFT p50 in
    # kv_offload_bench serve on the H100 from 136-183 to 85-123 ms (docs/kv-offload.md).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        stopped = asyncio.create_task(stop.wait())
        dead = asyncio.create_task(died.wait())
        await asyncio.wait((stopped, dead), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        dead.cancel()
        if not died.is_set():
            log.info("worker %s draining (up to %.0fs)", runtime.instance_id, drain_timeout)
            await served.stop(drain_timeout)
    finally:
        if worker.source is not None:
            await worker.source.close()
        if worker.receiver is not None:
            await worker.receiver.transports.close()
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await task
        await runtime.close()
        engine.shutdown()
        publisher.close()
        metrics.close()
    if died.is_set():
        reason = f"worker {runtime.instance_id}: engine loop died: {engine.dead!r}"
        log.critical("%s; left discovery, exiting", reason)
        raise SystemExit(reason)
