"""Engine options, named like vLLM's where the meaning is the same."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str | None = None  # float32 | bfloat16 | float16; default: the config's
    device: str | None = None  # cpu | cuda; default: cuda when available
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_gpu_blocks: int | None = None  # KV blocks; overrides the memory-based sizing
    kv_cache_memory_bytes: int | None = None  # KV cache size; default below per device
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    load_format: str = "auto"  # auto: safetensors; dummy: random weights (benchmarks)
    enforce_eager: bool = False  # GPU: run every step without CUDA graphs
    # schedule step N+1 while the device runs step N; default: on with CUDA, off on CPU
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is split over
    # lower KV tiers (docs/kv-offload.md): host memory, then a local disk folder under it
    kv_offload_cpu_gb: float | None = None
    kv_offload_disk_path: str | None = None
    kv_offload_disk_gb: float | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1"),
            (self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be at least 1"),
            (self.block_size >= 1, "block_size", "must be at least 1"),
            (
                self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
                "num_gpu_blocks",
                "must be at least 1",
            ),
            (
                0.0 < self.gpu_memory_utilization <= 1.0,
                "gpu_memory_utilization",
                "must be in (0, 1]",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 1,
                "max_model_len",
                "must be at least 1",
            ),
            (
                self.kv_offload_cpu_gb is None or self.kv_offload_cpu_gb >= 0,
                "kv_offload_cpu_gb",
                "must be >= 0",
            ),
            (
                self.kv_offload_disk_gb is None or self.kv_offload_disk_gb >= 0,
                "kv_offload_disk_gb",
                "must be >= 0",
            ),
            (
                (self.kv_offload_disk_path is None) == (not self.kv_offload_disk_gb),
                "kv_offload_disk_gb",
                "must be set, and only set, with kv_offload_disk_path",
            ),
            (
                self.kv_offload_disk_path is None or bool(self.kv_offload_cpu_gb),
                "kv_offload_disk_path",
                "needs the host tier (kv_offload_cpu_gb): the disk takes what it evicts",
            ),
            (
                not self.kv_offload_cpu_gb or self.enable_prefix_caching,
                "kv_offload_cpu_gb",
                "needs enable_prefix_caching",
            ),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message} (got {getattr(self, name)!r})")

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


CPU_KV_CACHE_BYTES = 512 * 2**20
