"""Model classes by the `architectures` name of an HF config.json."""

from __future__ import annotations

from torch import nn

from shoal.models.config import ModelConfig
from shoal.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported (supported: {supported})"
        ) from None
