"""Build a model from an HF checkpoint: a local folder or a Hugging Face model id."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shoal.layers.parallel import TPGroup
from shoal.models.config import ModelConfig
from shoal.models.registry import model_class

HF_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


def resolve_model_dir(model: str | Path) -> Path:
    """The local folder of `model`: itself if it is a folder, else a Hugging Face download."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists() or str(model).startswith((".", "/")):
        raise FileNotFoundError(f"model path {model} is not a directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=HF_PATTERNS))


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (from the sharded index when there is one)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    path: Path,
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    tp: TPGroup | None = None,
) -> nn.Module:
    """Instantiate the config's architecture on `device` and fill it from the safetensors.

    With a tensor-parallel group, the model holds this rank's shard and reads only its
    slices of the checkpoint. load_format "dummy" fills random weights instead (benchmarks
    of real shapes need no checkpoint: random weights cost exactly what real ones do).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)  # build in the target dtype: no float32 copy first
    try:
        with torch.device(torch.device(device)):
            model = model_class(cfg)(cfg, tp or TPGroup())
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        init_random_weights(model)
    else:
        load_weights(model, safetensors_files(path))
    return model.eval()


@torch.no_grad()
def init_random_weights(model: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) matrices and embeddings, unit norm weights, zero biases."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std)


@torch.no_grad()
def load_weights(model: nn.Module, files: list[Path]) -> None:
    """Fill every parameter from the checkpoint; fail on unknown or missing weights.

    A sharded layer (one with `load_weight`) reads only its rank's slice of each tensor.
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {}
    tied = model.config.tie_word_embeddings
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                target, shard = _target(name, model.packed_modules)
                if target not in params:
                    raise ValueError(f"{file.name}: weight {name!r} has no place in the model")
                owner, _, leaf = target.rpartition(".")
                module = modules[owner]
                try:
                    if hasattr(module, "load_weight"):
                        module.load_weight(leaf, shard, f.get_slice(name))
                    else:
                        _copy_whole(params[target].data, f.get_tensor(name))
                except ValueError as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
                filled.setdefault(target, set()).add(shard or 0)
    missing = [
        n
        for n, p in params.items()
        if len(filled.get(n, ())) < getattr(modules[n.rpartition(".")[0]], "num_shards", 1)
        and not (tied and n == "lm_head.weight")
    ]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}")


def _copy_whole(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def _target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """The model parameter a checkpoint tensor fills, and its shard if the parameter is fused."""
    for ckpt_name, (fused, shard) in packed.items():
        if f".{ckpt_name}." in name:
            return name.replace(f".{ckpt_name}.", f".{fused}."), shard
    return name, None
