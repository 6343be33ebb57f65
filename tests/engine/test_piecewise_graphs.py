"""The forward pass cut at each attention: the pieces equal the whole (CPU), and their CUDA
graphs, replayed around eager attention, equal the CPU forward pass (GPU), as does the whole
graph of a prompt alone."""

from itertools import pairwise

import pytest
import torch

from shoal.engine.piecewise_graphs import (
    LAYER_FLOPS_WORTH_REPLAYING,
    MAX_TOKENS,
    PiecewiseGraphs,
    token_count_ladder,
)
from shoal.layers.attention import AttentionMetadata
from shoal.models.config import ModelConfig
from shoal.models.loader import load_model

BLOCK = 4
NUM_BLOCKS = 128


def build(model_dir, device: str) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(model_dir, "float32")
    model = load_model(model_dir, cfg, device)
    for layer in model.attention_layers():
        shape = (2, NUM_BLOCKS, BLOCK, layer.num_kv_heads, layer.head_dim)
        layer.kv_cache = torch.zeros(shape, device=device)
    return model


def mixed_batch(
    model, device: str, cached: list[int], new: list[int], seed: int = 0, workspace=None
):
    """Sequences with `cached[i]` tokens in the cache already and `new[i]` tokens this step
    (1: a decode), as the runner lays them out: (input_ids, positions, meta). With a decode
    workspace, the leading decodes go to the decode kernel, as the runner has them."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids, positions, slots, tables = [], [], [], []
    next_block = 0
    for c, n in zip(cached, new, strict=True):
        blocks = list(range(next_block, next_block + -(-(c + n) // BLOCK)))
        next_block += len(blocks)
        tables.append(blocks)
        for p in range(c, c + n):
            positions.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        ids += torch.randint(0, vocab, (n,), generator=gen).tolist()
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
    starts = torch.tensor([0, *new], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    decodes = next((i for i, n in enumerate(new) if n != 1), len(new)) if workspace else 0
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        max_query_len=max(new),
        query_lens_host=list(new),
        seq_lens_host=seq_lens,
    )
    if decodes:
        meta.cut(decodes, (starts[decodes:] - decodes).to(device), workspace)
    return torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta


def fill_cache(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in model.attention_layers():
        cache = torch.randn(layer.kv_cache.shape, generator=gen)
        layer.kv_cache.copy_(cache.to(layer.kv_cache.device))


def caches(model) -> list[torch.Tensor]:
    return [layer.kv_cache.clone() for layer in model.attention_layers()]


def by_pieces(model, ids, positions, meta) -> torch.Tensor:
    decoder, attention = model.model, model.attention_layers()
    slots = meta.slot_mapping
    q, residual = decoder.head(ids, positions, slots)
    for i, attend in enumerate(attention):
        attn = attend(q, meta)
        if i + 1 < len(attention):
            q, residual = decoder.between(i + 1, attn, residual, positions, slots)
    return decoder.tail(attn, residual)


def test_ladder():
    assert token_count_ladder(13) == [13]
    assert token_count_ladder(100) == [64, 100]
    full = token_count_ladder(16384)
    assert full[:3] == [64, 128, 192] and full[-1] == MAX_TOKENS
    assert full == sorted(set(full)) and 1024 in full and 1152 in full
    assert all(b / a <= 1.125 for a, b in pairwise(full[15:]))  # from 1024 on
    assert token_count_ladder(3000)[-3:] == [2560, 2816, 3000]
    assert token_count_ladder(10**6)[-1] == MAX_TOKENS == 16384


def test_ladder_stops_where_a_layers_matmuls_outlast_its_launches():
    """Llama-3.1-8B's layer (218M parameters) reaches 1e12 FLOP at 2,294 tokens: the
    ladder ends at the first count past it; Qwen3-0.6B's (15.7M) runs to MAX_TOKENS."""
    assert LAYER_FLOPS_WORTH_REPLAYING == 1e12
    big = token_count_ladder(16384, layer_params=218_000_000)
    assert big[-2:] == [2048, 2304] and big == token_count_ladder(2304)
    assert token_count_ladder(16384, layer_params=15_700_000) == token_count_ladder(16384)
    assert token_count_ladder(1000, layer_params=218_000_000) == token_count_ladder(1000)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_pieces_compose_to_the_forward_pass(model_dirs, arch):
    model = build(model_dirs[arch], "cpu")
    ids, positions, meta = mixed_batch(model, "cpu", cached=[0, 9, 5, 17], new=[7, 1, 12, 1])
    with torch.inference_mode():
        fill_cache(model, seed=1)
        whole = model(ids, positions, meta)
        cache_whole = caches(model)
        fill_cache(model, seed=1)
        pieces = by_pieces(model, ids, positions, meta)
    assert torch.equal(pieces, whole)
    for a, b in zip(caches(model), cache_whole, strict=True):
        assert torch.equal(a, b)


def test_cut_parts_attend_like_the_whole(model_dirs):
    """Each part of a cut batch, run alone, gives its rows of the whole batch's attention."""
    model = build(model_dirs["qwen3"], "cpu")
    *_, meta = mixed_batch(model, "cpu", cached=[40, 3, 0, 30], new=[1, 1, 15, 20])
    meta.cut(2, torch.tensor([0, 15, 35], dtype=torch.int32), workspace=None)
    decodes, rest = meta.split
    assert decodes.query_lens_host == [1, 1] and rest.seq_lens_host == [15, 50]
    layer = model.attention_layers()[0]
    fill_cache(model, seed=3)
    q = torch.randn(37, layer.num_heads, layer.head_dim)
    whole = layer(q, meta)
    parts = torch.cat([layer(q[:2], decodes), layer(q[2:], rest)])
    torch.testing.assert_close(parts, whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphs_equal_the_cpu_forward_pass(model_dirs, arch):
    """Replayed pieces around eager attention (decodes of a mixed batch on the decode
    kernel) against the CPU reference; padding writes no KV."""
    from shoal.kernels.paged_attention import DecodeWorkspace

    cpu = build(model_dirs[arch], "cpu")
    model = build(model_dirs[arch], "cuda")
    first = model.attention_layers()[0]
    workspace = DecodeWorkspace(8, first.num_heads, first.head_dim, 16, "cuda")
    graphs = PiecewiseGraphs(model, torch.device("cuda"), max_tokens=200, max_blocks=64)
    graphs.capture()
    assert graphs.sizes == [64, 128, 192, 200]
    assert sorted(graphs.whole) == graphs.sizes  # all within WHOLE_MAX_TOKENS
    whole = {size: _Counted(graph) for size, graph in graphs.whole.items()}
    graphs.whole = whole
    batches = [
        ([0, 9, 5, 17], [7, 1, 12, 1]),  # 21 tokens, padded to 64
        ([40, 3, 60, 0, 30], [1, 1, 1, 150, 20]),  # three decodes first; 173 tokens
        ([0], [64]),  # a prompt alone, exactly a size: its whole graph
        ([0], [130]),  # a prompt alone, padded to 192
        ([30], [45]),  # a prompt's later chunk alone, after 30 cached tokens
        ([50], [2]),  # two new tokens, 62 padding rows
    ]
    for seed, (cached, new) in enumerate(batches):
        ids, positions, meta = mixed_batch(model, "cuda", cached, new, seed, workspace)
        ref_ids, ref_positions, ref_meta = mixed_batch(cpu, "cpu", cached, new, seed)
        replays = sum(counted.replays for counted in whole.values())
        with torch.inference_mode():
            fill_cache(cpu, seed=seed)
            expected = cpu(ref_ids, ref_positions, ref_meta)
            fill_cache(model, seed=seed)
            replayed = graphs.run(ids, positions, meta.slot_mapping, meta).cpu()
        alone = len(new) == 1
        assert sum(counted.replays for counted in whole.values()) == replays + alone
        torch.testing.assert_close(replayed, expected, rtol=1e-3, atol=2e-4)
        for a, b in zip(caches(model), caches(cpu), strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-3, atol=2e-4)


class _Counted:
    """A captured graph that counts its replays."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()
