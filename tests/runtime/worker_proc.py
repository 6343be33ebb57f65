"""A worker (or client) process for the runtime tests; prints one `READY {json}` line.

serve:  python worker_proc.py serve DISCOVERY_URL ENDPOINT TTL DELAY
client: python worker_proc.py client ADDRESS ENDPOINT
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from shoal.protocol import EngineOutput, EngineRequest, ModelCard, SamplingParams
from shoal.runtime import DistributedRuntime, RequestClient

CARD = ModelCard(
    model_name="tiny",
    tokenizer="/models/tiny",
    context_length=2048,
    kv_block_size=16,
    num_kv_blocks=512,
)


def ready(**info: object) -> None:
    print("READY " + json.dumps(info), flush=True)


async def serve(discovery: str, endpoint: str, ttl: float, delay: float) -> None:
    async def generate(request: EngineRequest):
        for i in range(request.sampling.max_tokens or 1):
            if delay:
                await asyncio.sleep(delay)
            last = i + 1 == request.sampling.max_tokens
            yield EngineOutput(
                request_id=request.request_id,
                new_token_ids=[i],
                finish_reason="length" if last else None,
            )

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with DistributedRuntime(discovery, lease_ttl=ttl) as runtime:
        served = await runtime.serve_endpoint(
            endpoint, generate, EngineRequest, card=CARD, extra={"kv_events": "tcp://127.0.0.1:1"}
        )
        ready(instance_id=runtime.instance_id, address=served.record.address)
        await stop.wait()


async def client(address: str, endpoint: str) -> None:
    requests = RequestClient(heartbeat_interval=0.2)
    request = EngineRequest(
        request_id="from-subprocess", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=10)
    )
    async for _ in requests.stream(address, endpoint, request, EngineOutput):
        ready(first=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "serve":
        asyncio.run(serve(args[0], args[1], float(args[2]), float(args[3])))
    else:
        asyncio.run(client(args[0], args[1]))
