"""ModelConfig: the parts of an HF config.json that shoal's models use, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> ModelConfig:
        """Parse an HF config dict; raises ValueError naming what cannot be honoured."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json is missing {key!r}")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        theta, scaling = _rope(hf)
        eos = hf.get("eos_token_id")
        cfg = cls(
            architecture=arch,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            dtype=_dtype(dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=hf.get("bos_token_id"),
        )
        if arch in ("LlamaForCausalLM", "MistralForCausalLM"):
            cfg.qkv_bias = cfg.o_bias = hf.get("attention_bias", False)
        elif arch == "Qwen2ForCausalLM":
            cfg.qkv_bias = True
        elif arch == "Qwen3ForCausalLM":
            cfg.qkv_bias = cfg.o_bias = hf.get("attention_bias", False)
            cfg.qk_norm = True
        if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
            cfg.sliding_window = None
        else:
            cfg.sliding_window = hf.get("sliding_window")
        return cfg

    @classmethod
    def from_dir(cls, path: Path, dtype: str | None = None) -> ModelConfig:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        cfg = cls.from_hf(json.loads(config_file.read_text()), dtype)
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            eos = json.loads(generation_file.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
            cfg.eos_token_ids += [t for t in extra if t not in cfg.eos_token_ids]
        return cfg


def _rope(hf: dict) -> tuple[float, dict | None]:
    """rope theta and scaling from either the transformers 4 or 5 layout of config.json."""
    params = hf.get("rope_parameters")
    if params:
        scaling = dict(params)
        theta = scaling.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(theta), scaling
    return float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (choose from {', '.join(DTYPES)})")
    return DTYPES[name]
