"""gather_blocks (the CUDA IPC backend's copy): whatever the block ids' runs, the transfer
tensor holds exactly the blocks asked for, in order, bit for bit. On the CPU here; on a GPU
(marked gpu) on a copy stream of its own, as the CUDA IPC backend runs it."""

from __future__ import annotations

import pytest
import torch

from shoal.disagg.gather import gather_blocks

NUM_BLOCKS = 40
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
IDS = {
    "one_run": list(range(7, 23)),
    "few_runs": [30, 31, 32, 5, 6, 11, 12, 13, 14, 0],
    "reversed": list(range(NUM_BLOCKS - 1, -1, -2)),
    "single": [17],
}


def caches(device: str, dtype: torch.dtype, tail: tuple[int, ...], layers: int = 3):
    """Per-layer caches [2, blocks, *tail] of distinct random values."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, NUM_BLOCKS, *tail)
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(layers)]


def reference(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    index = torch.tensor(ids, device=layers[0].device)
    return torch.stack([c.index_select(1, index) for c in layers])


def run(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    out = torch.full((len(layers), 2, len(ids), *layers[0].shape[2:]), -7.0)
    out = out.to(layers[0].dtype).to(layers[0].device)
    if out.is_cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            gather_blocks(layers, ids, out)
        stream.synchronize()
    else:
        gather_blocks(layers, ids, out)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(IDS))
def test_blocks_arrive_in_order(device, name):
    layers = caches(device, torch.bfloat16, (4, 2, 8))  # 128-byte rows: gathered as words
    ids = IDS[name]
    assert torch.equal(run(layers, ids), reference(layers, ids))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_not_a_multiple_of_eight_bytes(device):
    layers = caches(device, torch.float16, (1, 1, 3))  # 6-byte rows: gathered as halves
    ids = IDS["few_runs"]
    assert torch.equal(run(layers, ids), reference(layers, ids))


def test_no_blocks_and_wrong_shapes():
    layers = caches("cpu", torch.bfloat16, (4, 2, 8))
    gather_blocks(layers, [], torch.empty((3, 2, 0, 4, 2, 8), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not hold 2 blocks"):
        gather_blocks(layers, [1, 2], torch.empty((3, 2, 3, 4, 2, 8), dtype=torch.bfloat16))
