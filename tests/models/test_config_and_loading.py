"""Model configs and checkpoints: what is supported, and clear errors for what is not."""

import json
import shutil

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.layers.rotary import rope_inv_freq
from shoal.models.config import ModelConfig

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
}


def test_transformers4_layout_of_llama31():
    cfg = ModelConfig.from_hf(LLAMA31)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (8, 128, torch.bfloat16)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == [128001, 128008, 128009]
    inv = rope_inv_freq(128, cfg.rope_theta, cfg.rope_scaling)
    plain = rope_inv_freq(128, cfg.rope_theta, None)
    assert torch.equal(inv[:10], plain[:10])  # high frequencies untouched
    assert torch.allclose(inv[-5:], plain[-5:] / 8)  # low frequencies slowed by the factor


def test_dtype_override_and_bad_dtype():
    assert ModelConfig.from_hf(LLAMA31, "float16").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype 'int3'"):
        ModelConfig.from_hf(LLAMA31, "int3")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 5}, "not a multiple"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ],
)
def test_unsupported_configs_are_named(tmp_path, llama_dir, change, message):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("rope_parameters", None) if "rope_scaling" in change else None
    config.update(change)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(model))


def test_missing_files_are_named(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        LLM(str(tmp_path))
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    (model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(model))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(str(tmp_path / "nowhere"))


def test_missing_weight_is_named(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.1.self_attn.qkv_proj"):
        LLM(str(model))


def test_sliding_window_caps_context(tmp_path, model_dirs):
    model = tmp_path / "m"
    shutil.copytree(model_dirs["mistral"], model)
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = 256
    (model / "config.json").write_text(json.dumps(config))
    assert LLM(str(model)).engine.max_model_len == 256
    with pytest.raises(ValueError, match="sliding_window"):
        LLM(str(model), max_model_len=512)


def prompt_token_logprobs(model_dir, dtype: str, prompt: list[int]) -> torch.Tensor:
    """The logprob the model gives each prompt token after the first, in this dtype."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = LLM(str(model_dir), dtype=dtype).generate([prompt], sp)[0]
    return torch.tensor([lp.logprobs[0] for lp in out.prompt_logprobs[1:]])


def test_bfloat16_logprobs_match_float32(llama_dir):
    prompt = list(range(5, 45))
    full = prompt_token_logprobs(llama_dir, "float32", prompt)
    half = prompt_token_logprobs(llama_dir, "bfloat16", prompt)
    # the float32 logprobs vary by far more than the tolerance, so a wrong bf16 path fails
    assert full.std() > 1.0
    diff = (half - full).abs()
    assert diff.max() < 0.3, diff
    assert diff.mean() < 0.1, diff


def test_dummy_load_format_needs_only_a_config(tmp_path, llama_dir):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    shutil.copy(llama_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    out = LLM(str(tmp_path), load_format="dummy").generate([[5, 6, 7]])[0]
    assert len(out.outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match="load_format 'pickle'"):
        LLM(str(llama_dir), load_format="pickle")
