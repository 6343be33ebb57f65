"""MockRunner: the model runner's place in the step loop, with a clock instead of a GPU.

Like ModelRunner, it samples one token for each sequence whose scheduled chunk reaches
its last known token. The token is drawn uniformly from a fixed vocabulary (the
tokenizer's ordinary tokens: no EOS, no special tokens, so outputs run to max_tokens),
and the logprobs it reports are those of that uniform distribution. The step then takes
the timing model's time, divided by the speedup.
"""

from __future__ import annotations

import math
import random

import torch

from shoal.engine.model_runner import RunnerOutput
from shoal.engine.scheduler import SchedulerOutput
from shoal.mocker.pacing import sleep_until
from shoal.mocker.timing import TimingModel
from shoal.protocol import TokenLogprob


class MockRunner:
    def __init__(
        self,
        vocab: list[int],
        timing: TimingModel,
        speedup: float = 1.0,
        seed: int = 0,
        num_layers: int = 1,
    ) -> None:
        if not vocab:
            raise ValueError("the mocker needs at least one token to sample")
        if not speedup > 0:
            raise ValueError(f"speedup must be positive (got {speedup})")
        self.vocab = vocab
        self.in_vocab = frozenset(vocab)
        self.token_logprob = -math.log(len(vocab))
        self.timing = timing
        self.num_layers = num_layers  # of the KV layout blocks move in
        self.speedup = speedup
        self.rng = random.Random(seed)
        self.simulated_seconds = 0.0  # modelled GPU time of every step so far
        self._owed = 0.0  # wall seconds the current step should last

    def launch(self, sched: SchedulerOutput) -> RunnerOutput:
        """The model runner's launch: a mocked step is done as soon as it starts (see collect)."""
        modelled = self.timing.step_seconds(sched)
        self.simulated_seconds += modelled
        self._owed += modelled / self.speedup
        out = RunnerOutput({}, {}, {})
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            if req.wants_prompt_logprobs and start < req.num_prompt_tokens - 1:
                count = min(end, req.num_prompt_tokens - 1) - start
                targets = req.all_token_ids[start + 1 : start + 1 + count]
                top = req.sampling.prompt_logprobs
                out.prompt_logprobs[req.request_id] = [self._logprob(t, top) for t in targets]
            if end == req.num_tokens:
                token = self.rng.choice(self.vocab)
                out.sampled[req.request_id] = token
                if req.sampling.logprobs is not None:
                    out.logprobs[req.request_id] = self._logprob(token, req.sampling.logprobs)
        return out

    def idle_until(self, clock: float) -> None:
        """Let the simulated clock run to `clock` with nothing scheduled (a copy to wait
        for); the step sleeps that time too, divided by the speedup."""
        if clock > self.simulated_seconds:
            self._owed += (clock - self.simulated_seconds) / self.speedup
            self.simulated_seconds = clock

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV as the mocker holds it: none (shoal.mocker.transfer)."""
        return torch.empty((self.num_layers, 2, len(block_ids), 0, 0, 0))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Transferred KV lands in these blocks: nothing to write in a mocker."""

    def collect(self, out: RunnerOutput) -> RunnerOutput:
        """The launched step's output (already complete)."""
        return out

    def pace(self, started: float) -> float:
        """Sleep until the step that began at `started` (time.perf_counter) has lasted its
        modelled time / speedup; host time already spent in the step counts towards it.
        Returns the step's end (its deadline)."""
        deadline = started + self._owed
        self._owed = 0.0
        sleep_until(deadline)
        return deadline

    def _logprob(self, token_id: int, num_top: int) -> TokenLogprob:
        """The token's logprob and rank under the uniform distribution, then the first
        num_top tokens of the vocabulary as the top alternatives (equally likely, ranked by
        position as the real engine ranks its top-k)."""
        top = self.vocab[:num_top]
        if token_id in self.in_vocab:
            chosen, rank = self.token_logprob, 1
        else:
            chosen, rank = -math.inf, len(self.vocab) + 1
        return TokenLogprob(
            [token_id, *top],
            [chosen] + [self.token_logprob] * len(top),
            [rank, *range(1, len(top) + 1)],
        )
