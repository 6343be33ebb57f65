"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3), written as its equations.

    h   = x + Attn(RMSNorm(x))     Attn: q,k,v = W_qkv h (+b); RoPE(q,k); softmax(qk^T/sqrt(d)) v
    out = h + W_down(silu(W_gate h') * W_up h'),  h' = RMSNorm(h)

Qwen2 adds a bias to q, k, v; Qwen3 normalises q and k per head before RoPE.
q/k/v and gate/up projections are fused into one matmul each; the loader fills the slices.
With tensor parallelism each rank holds its heads, its slice of the MLP and of the
vocabulary; o_proj, down_proj and the embedding sum over the ranks (shoal/layers/linear.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from shoal.kernels import triton_kernels
from shoal.kernels.qk_rope_ref import qk_rope_store_ref
from shoal.layers.activation import silu_and_mul
from shoal.layers.attention import Attention, AttentionMetadata
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.layers.norm import RMSNorm
from shoal.layers.parallel import TPGroup
from shoal.layers.rotary import RotaryEmbedding
from shoal.models.config import ModelConfig


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, tp
        )
        self.heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.split = [size for _, size in self.qkv_proj.segments]
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.heads, self.kv_heads, self.head_dim, self.head_dim**-0.5)

    def project(
        self, positions: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """q, k, v of the tokens: k and v into the cache at `slots`; returns rotated q."""
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if q.is_cuda:  # one fused kernel: q rotated in place, k and v into the cache
            self._qk_rope_store_fused(positions, q, k, v, slots)
            return q
        q, _ = qk_rope_store_ref(
            q,
            k,
            v,
            positions,
            self.rotary,
            self.attn.kv_cache,
            slots,
            self.q_norm,
            self.k_norm,
        )
        return q

    def _qk_rope_store_fused(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        q_norm, k_norm = self.q_norm, self.k_norm
        triton_kernels("qk_rope").qk_rope_store(
            q,
            k,
            v,
            positions,
            self.rotary.cos,
            self.rotary.sin,
            self.attn.kv_cache,
            slots,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
        )


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, sizes, False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, residual = self.attention_input(positions, x, residual, meta.slot_mapping)
        return self.attention_output(self.self_attn.attn(q, meta), residual)

    def attention_input(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention: (rotated q, the residual stream)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn.project(positions, x, slots), residual

    def attention_output(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention: (MLP output, the residual stream)."""
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(  # one cos/sin table shared by every layer
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    # The forward pass cut at each attention, for piecewise CUDA graphs
    # (shoal.engine.piecewise_graphs): head, attention 0, between(1), attention 1, ...,
    # between(L - 1), attention L - 1, tail.

    def head(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and the first layer up to its attention: (q, residual)."""
        return self.layers[0].attention_input(positions, self.embed_tokens(input_ids), None, slots)

    def between(
        self,
        i: int,
        attn: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i - 1 after its attention, then layer i up to its: (q, residual)."""
        x, residual = self.layers[i - 1].attention_output(attn, residual)
        return self.layers[i].attention_input(positions, x, residual, slots)

    def tail(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer after its attention and the final norm: the hidden states."""
        x, residual = self.layers[-1].attention_output(attn, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard index)
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.config = cfg
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of every token in the flat batch."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the vocabulary (on rank 0 only when tensor-parallel)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
