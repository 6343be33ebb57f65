"""The fused q/k norm + rotary + KV store kernel against its pure-torch reference.

Natively on a GPU (float32 and bfloat16); in Triton's CPU interpreter elsewhere (float32).
Inputs are random with a fixed seed per case, so every run checks the same cases.
"""

import pytest
import torch
from kernel_setup import DEVICE, DTYPES

pytest.importorskip("triton")

from shoal.kernels.qk_rope import qk_rope_store
from shoal.kernels.qk_rope_ref import qk_rope_store_ref
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import RotaryEmbedding


def make_case(seed, dtype, heads, kv_heads, head_dim, block_size, qk_norm):
    """A strided q/k/v (views of one qkv row, like the model's), a random cache, and tokens
    whose positions straddle block boundaries, with one padding slot (-1)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, max_pos = 12, 1024
    # sequences at positions just before, at and after a block boundary, and a far one
    positions = torch.tensor(
        [block_size - 2, block_size - 1, block_size, 2 * block_size, 3 * block_size + 1, 700]
    )
    blocks = torch.randperm(num_blocks, generator=g)[: len(positions)]
    slots = blocks * block_size + positions % block_size
    slots[-1] = -1  # padding: nothing stored
    num_tokens, q_size, kv_size = len(positions), heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    rotary = RotaryEmbedding(head_dim, max_pos, 500000.0, None)
    norms = [RMSNorm(head_dim, 1e-6) for _ in range(2)] if qk_norm else [None, None]
    for norm in norms:
        if norm is not None:
            norm.weight.data = (1 + 0.5 * torch.randn(head_dim, generator=g)).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return (
        to(qkv),
        to(cache),
        to(positions),
        to(slots),
        rotary.to(DEVICE),
        [n.to(DEVICE) if n is not None else None for n in norms],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128), (6, 1, 64)])
@pytest.mark.parametrize("seed", [0, 1])
def test_qk_rope_store_matches_reference(
    dtype, qk_norm, block_size, heads, kv_heads, head_dim, seed
):
    qkv, cache, positions, slots, rotary, (q_norm, k_norm) = make_case(
        seed, dtype, heads, kv_heads, head_dim, block_size, qk_norm
    )
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = (
        t.view(len(positions), -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], -1)
    )
    valid = slots >= 0
    ref_cache = cache.clone()  # the cache after storing the valid tokens only
    qk_rope_store_ref(
        q[valid], k[valid], v[valid], positions[valid], rotary, ref_cache, slots[valid],
        q_norm, k_norm,
    )  # fmt: skip
    scratch = cache.clone()  # every query is rotated, the padding token's too
    scratch_slots = torch.arange(len(positions), device=DEVICE)
    ref_q, _ = qk_rope_store_ref(q, k, v, positions, rotary, scratch, scratch_slots, q_norm, k_norm)
    untouched_kv = qkv[:, q_size:].clone()

    qk_rope_store(
        q, k, v, positions, rotary.cos, rotary.sin, cache, slots,
        q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None, 1e-6,
    )  # fmt: skip

    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0}
    msg = f"seed {seed}"
    torch.testing.assert_close(q, ref_q, **tol, msg=msg)
    torch.testing.assert_close(cache, ref_cache, **tol, msg=msg)
    assert torch.equal(qkv[:, q_size:], untouched_kv), msg  # k and v are only read
