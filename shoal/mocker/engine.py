"""MockEngine: the real engine core (scheduler, KV block pool, prefix cache, KV events,
preemption, abort) with MockRunner in place of the model.

No weights are read: a model folder with config.json and the tokenizer files is enough.
The KV pool has config.num_gpu_blocks blocks, by default as many as Llama-3.1-8B gets on
one H100 at 0.9 memory utilisation. Nothing touches a GPU.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.mocker.runner import MockRunner
from shoal.mocker.tiers import ModelledOffload, TierModel
from shoal.mocker.timing import TimingModel
from shoal.protocol import EngineOutput
from shoal.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

H100_8B_KV_TOKENS = 444_896  # Llama-3.1-8B bf16, one H100 80GB, gpu_memory_utilization 0.9


class MockEngine(LLMEngine):
    def __init__(
        self,
        config: EngineConfig,
        timing: TimingModel | None = None,
        speedup: float = 1.0,
        tiers: TierModel | None = None,
    ) -> None:
        self._init_config(config, torch.device("cpu"))
        num_blocks = config.num_gpu_blocks or H100_8B_KV_TOKENS // config.block_size
        self._init_core(num_blocks)
        self._device_free_at: float | None = None  # perf_counter time the last step ended
        vocab = sampling_vocab(
            Path(config.tokenizer or self.model_dir),
            self.model_config.vocab_size,
            self.eos_token_ids,
        )
        self.runner = MockRunner(
            vocab, timing or TimingModel(), speedup, config.seed, self.model_config.num_layers
        )
        if config.kv_offload_cpu_gb:
            self.kv.offload = ModelledOffload(config, self.kv, self.runner, tiers or TierModel())
            log.info("mocker KV tiers: %s", self.kv.offload.copier.model)
        log.info(
            "mocker ready: %s, %d KV blocks of %d tokens, speedup %g, %s",
            self.model_config.architecture,
            num_blocks,
            config.block_size,
            speedup,
            self.runner.timing,
        )

    @property
    def overlaps_host_work(self) -> bool:
        """Back-to-back mocked steps follow each other on the modelled device, as the real
        engine's do with async scheduling: the host's work between them is hidden."""
        return True

    def step(self) -> list[EngineOutput]:
        started = self._device_free_at
        if started is None:
            started = time.perf_counter()
        clock = self.runner.simulated_seconds
        outputs = super().step()
        ran = self.runner.simulated_seconds != clock
        offload = self.kv.offload
        if offload is not None and not ran:
            offload.idle()  # nothing ran: the clock moves on to the next copy's end
        end = self.runner.pace(started)
        # with more to run, the next step starts on the device where this one ends (host
        # work in between, the hand-over of the outputs included, counts towards it);
        # after an empty step or with nothing left, it starts when the host calls it
        self._device_free_at = end if ran and self.has_unfinished_requests() else None
        return outputs


def sampling_vocab(tokenizer_dir: Path, model_vocab_size: int, eos: frozenset[int]) -> list[int]:
    """Token ids the mocker emits: the tokenizer's tokens that the model's vocabulary holds,
    except EOS ids, special tokens and tokens that are not text on their own.

    A token of a byte-level vocabulary may hold part of a UTF-8 character (a byte >= 0x80):
    a client sees no text until a later token completes it, if one ever does. Drawing such
    tokens would make the time to first text and the gaps between texts, which clients
    measure as TTFT and ITL, longer than the mocker's steps; the tiny test tokenizer has 132
    of them in 384 tokens.
    """
    tokenizer = TextTokenizer(tokenizer_dir)
    special = {i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}
    excluded = special | eos | {tokenizer.eos_token_id}
    size = min(tokenizer.vocab_size, model_vocab_size)
    return [i for i in range(size) if i not in excluded and _whole_text(tokenizer, i)]


def _whole_text(tokenizer: TextTokenizer, token_id: int) -> bool:
    """Whether the token alone decodes to text: not empty, no replacement character."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return bool(text) and "\ufffd" not in text
