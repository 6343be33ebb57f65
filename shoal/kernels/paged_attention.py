"""Triton paged attention for Hopper (and any GPU Triton supports).

Kernels over the paged KV cache [2, num_blocks, block_size, kv_heads, head_dim] (the new
tokens' K and V are stored by shoal/kernels/qk_rope.py, fused with the rotary embedding):

- prefill attention: causal attention of each sequence's new queries (a prompt chunk, or
  a decode token) over its whole context, read through the block table. The query heads of
  one KV head are packed into the rows of one tile (GQA packing), so K/V are read once per
  group.
- decode attention: one query per sequence, the context split across programs
  (flash-decoding) so short batches still fill the GPU; a second kernel merges the splits
  (large batches run one split per sequence, which writes the output itself).
  Shapes depend only on the batch size, so it can be captured in a CUDA graph.

pure-torch references: shoal/kernels/paged_attention_ref.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels import dot_precision

LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp(x) = exp2(x * LOG2E)

# Arguments that change from step to step and that Triton would otherwise compile a variant
# for (an int divisible by 16 or not, a pointer 16-byte aligned or not): the block table's
# row stride is the widest sequence's block count, and a mixed batch's prefill part starts
# its block table and lengths at the row after the decodes. Each variant was compiled in
# the middle of serving, the first time it came (~0.6 s each, stalling every stream);
# these arguments only index scalars, so nothing is lost by not specializing.
_PER_STEP = {
    "do_not_specialize": ["stride_bt"],
    "do_not_specialize_on_alignment": ["block_tables", "seq_lens"],
}


@triton.jit
def _load_kv_tile(
    cache,
    half,
    block_tables,
    seq,
    stride_bt,
    kv_pos,
    kv_ok,
    kv_head,
    d,
    d_ok,
    PAGE: tl.constexpr,
    NUM_KV_HEADS,
    HEAD_DIM,
):
    """K and V [BLOCK_N, BLOCK_D] of tokens kv_pos of one sequence and KV head, read
    through the block table (zeros where kv_ok is false)."""
    page = tl.load(block_tables + seq * stride_bt + kv_pos // PAGE, mask=kv_ok, other=0)
    row = (page.to(tl.int64) * PAGE + kv_pos % PAGE) * NUM_KV_HEADS + kv_head
    offs = row[:, None] * HEAD_DIM + d[None, :]
    tile_ok = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(cache + offs, mask=tile_ok, other=0.0)
    v = tl.load(cache + half + offs, mask=tile_ok, other=0.0)
    return k, v


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold scores s [rows, BLOCK_N] (log2 units, masked ones -inf) and their V rows into
    the running max m_i, sum l_i and output acc.

    A row's first tile must hold a score that is not masked (true in both kernels: it
    holds the sequence's first token, or the first of the split), so m_new is finite.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(**_PER_STEP)
def _prefill_kernel(
    query,
    cache,
    out,
    block_tables,
    seq_lens,
    query_start,
    qk_scale,  # softmax scale x LOG2E
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    half,
    GROUP: tl.constexpr,  # query heads per KV head
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q queries x GROUP heads
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) rows start first
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # tokens before this step's queries

    r = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = context + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)
    # Tiles ending at or before the tile's first query position are seen whole by every row:
    # only the tiles from `masked_from` on need the causal and length mask.
    masked_from = tl.minimum(context + q_block * BLOCK_Q, kv_end) // BLOCK_N * BLOCK_N
    for start in range(0, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_end
        k, v = _load_kv_tile(
            cache,
            half,
            block_tables,
            seq,
            stride_bt,
            kv_pos,
            kv_ok,
            kv_head,
            d,
            d_ok,
            PAGE,
            NUM_KV_HEADS,
            HEAD_DIM,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if start >= masked_from:  # a branch, not a select on every tile: 1.18x on H100
            s = tl.where((kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PRECISION)
    acc = acc / l_i[:, None]
    tl.store(
        out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        acc.to(out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [T, heads, head_dim] (sequences back to back) over the cache."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    block_m = max(16, min(128, triton.next_power_of_2(group * max_query_len)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (block_tables.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query,
        kv_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache[0].numel(),
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=32 if head_dim > 128 else 64,
        PAGE=page,
        PRECISION=dot_precision(query.dtype),
        num_warps=8 if block_m >= 128 else 4,  # H100, 8 x 2048 prompts: 1.28x over 4 warps
        num_stages=2,
    )
    return out


@triton.jit(**_PER_STEP)
def _decode_split_kernel(
    query,
    cache,
    part_m,
    part_l,
    part_acc,
    out,
    block_tables,
    seq_lens,
    qk_scale,  # softmax scale x LOG2E
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    half,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS)
    first = split * per_split * BLOCK_N
    last = tl.minimum((split + 1) * per_split * BLOCK_N, seq_len)

    r = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + r
    row_ok = r < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        query + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(first, last, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < last
        k, v = _load_kv_tile(
            cache,
            half,
            block_tables,
            seq,
            stride_bt,
            kv_pos,
            kv_ok,
            kv_head,
            d,
            d_ok,
            PAGE,
            NUM_KV_HEADS,
            HEAD_DIM,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, PRECISION)
    if NUM_SPLITS == 1:  # the whole context in one program: write the output, no merge
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        return
    base = (seq * NUM_KV_HEADS * GROUP + head) * NUM_SPLITS + split
    tl.store(part_m + base, m_i, mask=row_ok)
    tl.store(part_l + base, l_i, mask=row_ok)
    tl.store(
        part_acc + base[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :]
    )


@triton.jit
def _decode_merge_kernel(
    part_m,
    part_l,
    part_acc,
    out,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_m + base)
    l = tl.load(part_l + base)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # m in log2 units
    acc = tl.load(part_acc + base[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out + seq.to(tl.int64) * stride_ot + head * stride_oh + d,
        o.to(out.dtype.element_ty),
        mask=d_ok,
    )


class DecodeWorkspace:
    """Scratch for the split partial results, sized once so CUDA graphs can reuse it."""

    def __init__(self, max_seqs: int, num_heads: int, head_dim: int, max_splits: int, device):
        self.max_splits = max_splits
        device = torch.device(device)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        shape = (max_seqs, num_heads, max_splits)
        self.m = torch.empty(shape, dtype=torch.float32, device=device)
        self.l = torch.empty(shape, dtype=torch.float32, device=device)
        self.acc = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)


def decode_splits(num_programs: int, num_sms: int, max_splits: int) -> int:
    """Splits per sequence so that about two programs run per SM (a power of two)."""
    wanted = triton.cdiv(2 * num_sms, num_programs)
    return min(max_splits, triton.next_power_of_2(wanted))


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: DecodeWorkspace,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [B, heads, head_dim] over the cached context.

    Sequences with seq_len 0 (CUDA-graph padding) get zeros.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    splits = decode_splits(batch * num_kv_heads, workspace.num_sms, workspace.max_splits)
    out = torch.empty_like(query) if out is None else out
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query,
        kv_cache,
        workspace.m,
        workspace.l,
        workspace.acc,
        out,
        block_tables,
        seq_lens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache[0].numel(),
        GROUP=group,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if head_dim <= 128 else 32,
        PAGE=page,
        NUM_SPLITS=splits,
        PRECISION=dot_precision(query.dtype),
        num_warps=4,
        num_stages=2,
    )
    if splits == 1:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        workspace.m,
        workspace.l,
        workspace.acc,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
    )
    return out
