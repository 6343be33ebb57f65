"""An EngineClient over an in-process AsyncLLM that refuses as a worker does: an engine output
carrying an error becomes the ValueError the frontend answers with a 400."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import uvicorn

from shoal.engine.async_llm import AsyncLLM
from shoal.engine.config import EngineConfig
from shoal.protocol import EngineOutput, EngineRequest, ModelCard

MODEL = "tiny-llama"


class RefusingEngineClient:
    def __init__(self, model_dir: Path) -> None:
        self.llm = AsyncLLM(EngineConfig(model=str(model_dir), device="cpu", num_gpu_blocks=2048))
        core = self.llm.engine
        self.card = ModelCard(
            model_name=MODEL,
            tokenizer=str(model_dir),
            context_length=core.max_model_len,
            kv_block_size=core.config.block_size,
            num_kv_blocks=core.kv.num_blocks,
        )

    def models(self) -> dict[str, ModelCard]:
        return {MODEL: self.card}

    def live_models(self) -> list[str]:
        return [MODEL]

    async def generate(self, model: str, request: EngineRequest) -> AsyncGenerator[EngineOutput]:
        async with contextlib.aclosing(self.llm.generate(request)) as stream:
            async for out in stream:
                if out.error is not None:
                    raise ValueError(out.error)
                yield out

    def shutdown(self) -> None:
        self.llm.shutdown()


class Server:
    """The app on 127.0.0.1 (ephemeral port) in a background thread."""

    def __init__(self, app) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
