"""Triton paged-attention kernels against the pure-torch reference.

On a GPU the kernels run natively; without one they run in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), on small shapes.
"""

import pytest
import torch
from kernel_setup import DEVICE, GPU

triton = pytest.importorskip("triton")

from shoal.kernels.paged_attention import (  # noqa: E402
    DecodeWorkspace,
    decode_attention,
    prefill_attention,
)
from shoal.kernels.paged_attention_ref import paged_attention_ref  # noqa: E402

DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = 2e-2 if GPU else 1e-4


def make_case(seq_lens, query_lens, heads, kv_heads, head_dim, page, seed):
    """Random cache contents, shuffled block tables and queries (fresh numbers every case)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    cache = torch.randn(2, num_blocks, page, kv_heads, head_dim, generator=g)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    to = dict(device=DEVICE)
    return cache.to(DTYPE).to(**to), tables.to(**to), q.to(DTYPE).to(**to)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = [
    # seq_lens, query_lens, heads, kv_heads, head_dim, page
    ([37], [37], 4, 2, 64, 16),
    ([50, 9, 33], [20, 9, 1], 8, 2, 64, 16),
    ([17, 64, 5], [1, 3, 5], 4, 4, 128, 8),
    ([70, 31], [70, 31], 8, 1, 64, 32),
    ([100], [1], 6, 2, 128, 16),
]


@pytest.mark.parametrize(("seq_lens", "query_lens", "heads", "kv", "dim", "page"), CASES)
def test_prefill_attention_matches_reference(seq_lens, query_lens, heads, kv, dim, page):
    cache, tables, q = make_case(seq_lens, query_lens, heads, kv, dim, page, seed=sum(seq_lens))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q,
        cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        starts.to(DEVICE),
        max(query_lens),
        dim**-0.5,
        out=out,
    )
    ref = paged_attention_ref(
        q.float(), cache.float(), tables.long(), query_lens, seq_lens, dim**-0.5
    )
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize(
    ("seq_lens", "heads", "kv", "dim", "page", "splits"),
    [
        ([37, 1, 16, 17], 4, 2, 64, 16, 4),
        ([130, 5], 8, 1, 128, 16, 8),
        ([64], 12, 4, 64, 8, 2),
        ([37, 1, 16, 17], 4, 2, 64, 16, 1),  # one split: no merge kernel
    ],
)
def test_decode_attention_matches_reference(seq_lens, heads, kv, dim, page, splits):
    cache, tables, q = make_case(seq_lens, [1] * len(seq_lens), heads, kv, dim, page, seed=7)
    lens = torch.tensor([*seq_lens, 0], dtype=torch.int32, device=DEVICE)  # one padded row
    tables = torch.cat([tables, tables[:1]])
    q = torch.cat([q, q[:1]])
    ws = DecodeWorkspace(len(lens), heads, dim, splits, DEVICE)
    ws.num_sms = splits * len(lens) * kv  # so that the kernel uses all `splits` splits
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, tables, lens, dim**-0.5, ws, out=out)
    n = len(seq_lens)
    ref = paged_attention_ref(
        q[:n].float(), cache.float(), tables[:n].long(), [1] * n, seq_lens, dim**-0.5
    )
    assert rel_err(out[:n], ref) < TOL
    assert torch.equal(out[n], torch.zeros_like(out[n]))
