"""Wire types shared by the frontend, router, workers and engine (msgspec structs, no pickle)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from sys import byteorder
from typing import Any, ClassVar

import msgspec

# The endpoint every engine worker serves and every frontend calls.
GENERATE_ENDPOINT = "shoal.backend.generate"
# The endpoint a worker answers with every block it caches (a router's resync).
KV_STATE_ENDPOINT = "shoal.backend.kv_state"
# A prefill worker's endpoints (issue 16): prefill-only generate, and its pinned KV blocks.
PREFILL_ENDPOINT = "shoal.prefill.generate"
KV_BLOCKS_ENDPOINT = "shoal.prefill.kv_blocks"
# A prefill worker's description of its registered KV memory (NIXL, CUDA IPC handshakes).
KV_AGENT_ENDPOINT = "shoal.prefill.kv_agent"
# Event-plane topics of a worker's publisher (its address: InstanceRecord.extra["kv_events"]).
KV_EVENTS_TOPIC = "kv"
LOAD_TOPIC = "load"


# JSON-schema keywords xgrammar would accept but not enforce: a schema using one is refused
# rather than constrained more loosely than it asks.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "if",
        "then",
        "else",
    }
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "additionalItems")


def unsupported_schema_keyword(schema: object, path: str = "$") -> str | None:
    """'keyword at path' for the first keyword of UNSUPPORTED_SCHEMA_KEYWORDS in the schema, or
    None; keywords are looked for where JSON Schema reads them, not in property names."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            return f"{key!r} at {path}"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"'pattern' with 'minLength'/'maxLength' at {path}"
    children: list[tuple[object, str]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(v, f"{path}.{key}.{k}") for k, v in schema[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(v, f"{path}.{key}[{i}]") for i, v in enumerate(schema[key])]
    children += [(schema[key], f"{path}.{key}") for key in _SCHEMA_ONES if key in schema]
    for child, where in children:
        found = unsupported_schema_keyword(child, where)
        if found is not None:
            return found
    return None


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of json (a JSON
    schema, as a dict or its JSON text), regex, choice, grammar (EBNF, or Lark syntax) or
    json_object (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object (found: {found})"
            )
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        if self.json is not None:
            self._check_schema()

    def schema(self) -> dict | bool:
        """The JSON schema of `json`, decoded if it came as text."""
        return msgspec.json.decode(self.json) if isinstance(self.json, str) else self.json

    def _check_schema(self) -> None:
        try:
            schema = self.schema()
        except msgspec.DecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        found = unsupported_schema_keyword(schema)
        if found is not None:
            raise ValueError(
                f"structured_outputs.json uses the JSON-schema keyword {found}, "
                "which shoal's grammar backend cannot enforce"
            )

    def kinds(self) -> list[str]:
        """The constraint fields that are set."""
        fields = ("json", "regex", "choice", "grammar")
        found = [f for f in fields if getattr(self, f) is not None]
        return found + (["json_object"] if self.json_object else [])


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request; field names and meanings follow vLLM's SamplingParams."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value cannot be honoured."""
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0 or self.top_k == -1, "top_k", "must be 0 or -1 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must not exceed max_tokens",
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be non-negative"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs",
                "must be non-negative",
            ),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
        ]
        for ok, field, message in checks:
            if not ok:
                raise ValueError(f"{field} {message} (got {getattr(self, field)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenLogprob(msgspec.Struct, array_like=True):
    """Log-probability of one position: the chosen token first, then the top alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class KVLayout(msgspec.Struct, kw_only=True, frozen=True):
    """The shape of an engine's KV cache blocks: a transfer moves [num_layers, 2 (K, V),
    blocks, block_size, num_kv_heads, head_dim] of `dtype` (a torch dtype name)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Disaggregated prefill (issue 16). On a request to a prefill worker: only
    `do_remote_decode`, keep the prompt's KV blocks pinned for a decode worker. On that
    worker's final output, and on the request the frontend then sends a decode worker: where
    the pinned blocks are and what they hold."""

    do_remote_decode: bool = False
    worker_id: str = ""
    address: str = ""  # the prefill worker's request plane
    request_id: str = ""  # the prefill engine request holding the blocks
    block_ids: list[int] = msgspec.field(default_factory=list)
    block_hashes: list[int] = msgspec.field(default_factory=list)  # kv_hash of the full blocks
    num_tokens: int = 0  # prompt tokens whose KV the blocks hold
    layout: KVLayout | None = None
    backends: list[str] = msgspec.field(default_factory=list)  # transfers offered, best first


class KVBlocksRequest(msgspec.Struct, kw_only=True):
    """Decode to prefill worker: send pinned blocks first_block.. of `request_id`
    (num_blocks None: all the rest, 0: none), then unpin them all if `release`."""

    request_id: str
    first_block: int = 0
    num_blocks: int | None = None
    release: bool = True


class KVBlocksChunk(msgspec.Struct, kw_only=True):
    """Blocks first_block..first_block+num_blocks of a pinned request, as [num_layers, 2,
    num_blocks, block_size, num_kv_heads, head_dim] in the layout's dtype, C order."""

    first_block: int
    num_blocks: int
    data: memoryview  # decoded as a view of the received frame, not a copy of it


class KVAgentRequest(msgspec.Struct, kw_only=True):
    """Decode to prefill worker: describe your KV memory for this transfer backend."""

    backend: str  # "nixl" or "cuda_ipc"


class CudaIpcHandle(msgspec.Struct, kw_only=True, array_like=True):
    """One CUDA storage shared between processes (the fields of torch's _share_cuda_)."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class KVAgentInfo(msgspec.Struct, kw_only=True):
    """A prefill worker's KV memory: one region per layer, each [2 (K, V), num_blocks,
    block_size, num_kv_heads, head_dim] of the layout's dtype, C order. `nixl`: the agent's
    name and metadata and the regions' addresses; `cuda_ipc`: a handle per region."""

    backend: str
    host_id: str  # machine identity (boot id): CUDA IPC works only on the same host
    num_blocks: int
    mem_type: str = "DRAM"  # NIXL memory type of the regions: DRAM or VRAM
    device_id: int = 0
    agent_name: str = ""
    agent_metadata: bytes = b""
    region_addresses: list[int] = msgspec.field(default_factory=list)
    ipc_handles: list[CudaIpcHandle] = msgspec.field(default_factory=list)


def is_packed(obj: object) -> bool:
    """Whether `obj` is token ids packed as pack_token_ids packs them."""
    return type(obj) is array and obj.typecode == "I"


def pack_token_ids(token_ids: Iterable[int]) -> array:
    """Token ids as a packed array of u32: what EngineRequest holds and the request plane
    carries as one msgpack bin (little-endian), so a prompt of any length costs one copy to
    send and to receive instead of an integer object per token. ValueError unless every id
    is an integer in [0, 2**32)."""
    if is_packed(token_ids):
        return token_ids
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers from 0 to 2**32 - 1 ({e})") from None


def token_ids_to_wire(token_ids: array) -> bytes:
    """The packed ids as little-endian bytes (the msgpack bin the request plane carries)."""
    if byteorder == "little":
        return token_ids.tobytes()
    swapped = array("I", token_ids)
    swapped.byteswap()
    return swapped.tobytes()


def token_ids_from_wire(data: Any) -> array:
    """Packed ids from their wire form: the bin token_ids_to_wire makes, or (a sender that
    does not pack them) a msgpack array of integers. ValueError for anything else."""
    if isinstance(data, bytes):
        if len(data) % 4:
            raise ValueError("packed token ids must be a whole number of 4-byte values")
        ids = array("I")
        ids.frombytes(data)
        if byteorder != "little":
            ids.byteswap()
        return ids
    if isinstance(data, list):
        return pack_token_ids(data)
    raise ValueError(f"expected token ids (bin or array), got {type(data).__name__}")


class EngineRequest(msgspec.Struct, kw_only=True):
    """A token-level request sent to a worker."""

    request_id: str
    prompt_token_ids: array  # pack_token_ids: a list given here is packed on construction
    sampling: SamplingParams
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_id: int | None = None
    arrival_time: float = 0.0
    # A migrated request: the last `num_output_tokens_before` prompt tokens are this request's
    # own earlier output. The engine samples as if it had drawn them (a seeded request's
    # generator moves past their draws) and its penalties count them as output, while
    # sampling.max_tokens and min_tokens count only the tokens still to come.
    num_output_tokens_before: int = 0
    kv_transfer: KVTransferParams | None = None  # disaggregated prefill (KVTransferParams)

    def __post_init__(self) -> None:
        self.prompt_token_ids = pack_token_ids(self.prompt_token_ids)


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one sequence of a request since its last output."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer: KVTransferParams | None = None  # a prefill worker's pinned blocks

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# KV events, in vLLM's wire layout (vllm/distributed/kv_events.py, v0.10/v0.11), so a router
# can follow shoal workers and any engine that publishes vLLM-format events alike: msgpack,
# each event an array tagged with its class name and its fields in vLLM's order, a batch the
# array [ts, events, data_parallel_rank]. Field names are not on the wire. Decoding accepts
# v0.9's events (no `medium`: GPU) and ignores fields later versions append at the end. On
# the event plane a batch is the last frame of [topic, seq (8 bytes big-endian), payload], as
# vLLM frames it; the publisher's address tells whose batch it is. Block hashes are the
# engine's own (ints, or bytes in some vLLM versions): the router re-hashes each stored
# block's token_ids with kv_hash.route_hashes and maps the engine's hashes to its own.

EngineBlockHash = int | bytes
MEDIUM_GPU = "GPU"  # the tier (`medium`) of blocks in GPU memory; CPU and disk tiers name theirs
GPU_MEDIA = (None, MEDIUM_GPU)  # `medium` values of GPU blocks (vLLM 0.9 events send none)


class KVCacheEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Base of the KV events (tagged by class name, encoded as arrays)."""


class BlockStored(KVCacheEvent):
    """Full blocks newly cached, chained after `parent_block_hash`; token_ids are theirs."""

    block_hashes: list[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the cache tier `medium`."""

    block_hashes: list[EngineBlockHash]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent):
    """Every cached block dropped (a prefix-cache reset)."""


class RouteHashesStored(KVCacheEvent):
    """Blocks a shoal worker now holds in tier `medium`, named by the router's hash of their
    tokens and prefix (kv_hash.route_hashes at the worker's block size), packed as
    little-endian uint64; each is a router hash the worker did not hold there before. The
    worker translates its engine's events (shoal.route_events), so a router applies these
    without re-hashing tokens or keeping a map per worker."""

    route_hashes: bytes
    medium: str | None = MEDIUM_GPU


class RouteHashesRemoved(KVCacheEvent):
    """Router hashes (packed as in RouteHashesStored) a shoal worker no longer holds in
    tier `medium`."""

    route_hashes: bytes
    medium: str | None = MEDIUM_GPU


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | RouteHashesStored | RouteHashesRemoved
# What a worker publishes (--kv-events-format): shoal: RouteHashesStored/Removed and
# AllBlocksCleared; vllm: BlockStored/Removed and AllBlocksCleared, as vLLM publishes them.
KV_EVENTS_FORMATS = ("shoal", "vllm")


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The KV events of one or more engine steps, stamped with the wall-clock time."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class LoadReport(msgspec.Struct, kw_only=True):
    worker_id: str
    num_running: int
    num_waiting: int
    active_blocks: int  # blocks held by requests (cached but unreferenced blocks are free)
    total_blocks: int
    timestamp: float = 0.0


class KVStateRequest(msgspec.Struct, kw_only=True):
    """Router to worker: send every block you cache."""

    reason: str = ""  # "start" | "gap": for the worker's log


class KVStateDump(msgspec.Struct, kw_only=True):
    """Every block a worker caches in GPU memory, as of the KV event batch numbered `seq`.

    A router replaces what it knew of the worker with what `events` store, then applies the
    worker's batches numbered above `seq` (-1 if the worker's numbers start at 0, as vLLM's
    do, and none was sent). The events are those of the worker's --kv-events-format: one
    RouteHashesStored per tier, or BlockStored ones (GPU memory only), each block's parent
    before it, whose tokens the router re-hashes as it does any stored block's.
    """

    worker_id: str
    seq: int
    block_size: int
    events: list[KVEvent]


# Router replicas share the load they add to workers (shoal/router/replica_sync.py): each
# replica publishes LoadDeltas on this topic of its own event-plane publisher.
ROUTER_LOAD_TOPIC = "router-load"


class RouteRequest(msgspec.Struct, array_like=True, gc=False):
    """A frontend asks the KV router service (`shoal router`) where to send a request.

    The frontend hashes the prompt (kv_hash.route_hashes at `block_size`); the service
    counts the request's load under (replica_id, request_id), and the frontend's
    FIRST_TOKEN and FINISHED LoadDeltas, published as a router replica's, release it.
    """

    replica_id: str  # the asking frontend, as its LoadDeltas name it
    request_id: str
    prompt_tokens: int
    block_size: int
    block_hashes: bytes  # the prompt's route hashes, uint64 little-endian
    candidates: list[str]  # the worker instances it may go to
    busy_wait: float  # seconds it may wait, in arrival order, while all are busy


class RouteResponse(msgspec.Struct, array_like=True, gc=False):
    """The service's answer: the chosen instance, or why there is none."""

    instance_id: str = ""
    error: str = ""
    busy: bool = False  # every candidate stayed busy for the request's busy_wait


class LoadDelta(msgspec.Struct, array_like=True, gc=False):
    """One router replica's change to the load it puts on a worker."""

    ROUTED: ClassVar[int] = 0  # sent to `worker_id`, holding `blocks`, to prefill `prefill_tokens`
    FIRST_TOKEN: ClassVar[int] = 1  # its prefill is over
    FINISHED: ClassVar[int] = 2  # it ended

    replica_id: str
    kind: int  # ROUTED, FIRST_TOKEN or FINISHED
    request_id: str
    worker_id: str = ""  # ROUTED: where it went
    blocks: int = 0  # ROUTED: KV blocks it will hold there
    prefill_tokens: int = 0  # ROUTED: prompt tokens it must prefill there


# ---------------------------------------------------------------------------------------------
# Distributed runtime (shoal/runtime): instance records in discovery, and the request plane's
# frames. A request-plane message is a ZMQ multipart message: one header frame (a struct
# below, msgpack) and, for StreamOpen and StreamData only, one payload frame (the endpoint's
# own request or response struct, msgpack).


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker serves: enough for a frontend to tokenize and a router to count blocks.

    `tokenizer` names the worker's tokenizer folder, on the worker's host. A frontend on any
    host gets the files themselves from the worker's MODEL_FILES_ENDPOINT; `files_digest`
    (model_files_digest of them) says which files those are, and is empty when the worker
    serves none.
    """

    model_name: str
    tokenizer: str
    context_length: int
    kv_block_size: int
    num_kv_blocks: int
    files_digest: str = ""


# The endpoint a worker answers with the files a frontend needs to serve its model.
MODEL_FILES_ENDPOINT = "shoal.backend.model_files"
# The tokenizer folder's files a frontend reads (tokenizer, chat template, generation config).
MODEL_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)
MODEL_FILE_CHUNK = 1 << 20  # bytes of a file one ModelFileChunk carries at most


class ModelFilesRequest(msgspec.Struct, kw_only=True):
    """Frontend to worker: send your model files (those whose digest is `digest`)."""

    digest: str


class ModelFileChunk(msgspec.Struct, kw_only=True):
    """Part of one model file: a file's chunks arrive in order, and are its bytes joined."""

    name: str
    data: bytes


def model_files_digest(files: dict[str, bytes]) -> str:
    """sha256 over the files' names and contents, in name order: equal files, equal digest."""
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(b"%d:%s%d:" % (len(name), name.encode(), len(data)))
        digest.update(data)
    return digest.hexdigest()


class InstanceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One worker instance serving one endpoint, as stored in discovery."""

    instance_id: str
    endpoint: str  # namespace.component.endpoint
    address: str  # request plane, e.g. tcp://10.0.0.5:41234
    card: ModelCard | None = None
    extra: dict[str, str] = msgspec.field(default_factory=dict)  # e.g. {"kv_events": "tcp://..."}


class StreamOpen(msgspec.Struct, tag=1, array_like=True):
    """Client to server: start stream `rid` on `endpoint`; the payload frame is the request."""

    rid: int
    endpoint: str
    window: int  # responses the server may send before it needs a StreamCredit


class StreamCredit(msgspec.Struct, tag=2, array_like=True):
    """Client to server: the consumer took `n` more responses of stream `rid`."""

    rid: int
    n: int


class StreamCancel(msgspec.Struct, tag=3, array_like=True):
    """Client to server: stop stream `rid`; the server cancels its handler task."""

    rid: int


class Heartbeat(msgspec.Struct, tag=4, array_like=True):
    """Either way: a liveness probe from the client, echoed by the server."""

    seq: int


class StreamData(msgspec.Struct, tag=5, array_like=True):
    """Server to client: one response of stream `rid`; the payload frame is the response."""

    rid: int


class StreamEnd(msgspec.Struct, tag=6, array_like=True):
    """Server to client: stream `rid` is over (the handler finished or was cancelled)."""

    rid: int


class StreamError(msgspec.Struct, tag=7, array_like=True):
    """Server to client: stream `rid` failed; `code` names the kind of failure."""

    rid: int
    code: str  # "handler" | "no_endpoint" | "bad_request" | "overloaded" | "shutdown"
    message: str


class StreamBatch(msgspec.Struct, tag=8, array_like=True):
    """Server to client: one response of each stream in `rids`, in that order, each the
    endpoint's response struct as msgpack (the server encodes the structs in place; a client
    keeps each as Raw until its stream decodes it). A worker sends the outputs one engine step
    made for one client as this one frame."""

    rids: list[int]
    payloads: list[msgspec.Raw]


ClientFrame = StreamOpen | StreamCredit | StreamCancel | Heartbeat
ServerFrame = StreamData | StreamBatch | StreamEnd | StreamError | Heartbeat
