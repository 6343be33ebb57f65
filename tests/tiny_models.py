"""Tiny random-weight HF-format models, built offline and deterministically for the tests.

A byte-level BPE tokenizer is trained with `tokenizers` on tests/data/corpus.txt; each
architecture gets config.json, generation_config.json, tokenizer files and safetensors
written by `transformers` (the test-only reference implementation).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
VOCAB_SIZE = 384
BOS, EOS, IM_START, IM_END, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
)
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=4,
)

ARCHITECTURES: dict[str, dict] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_key_value_heads=1,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=32,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
}


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def write_tokenizer(path: Path) -> Path:
    """tokenizer.json and tokenizer_config.json (with the chat template) in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "model_max_length": BASE["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def write_model(
    path: Path, arch: str, seed: int = 0, max_shard_size: str = "50MB", **overrides
) -> Path:
    """A random-weight checkpoint of `arch` in HF format; overrides change config fields."""
    import transformers

    write_tokenizer(path)
    fields = {**BASE, **ARCHITECTURES[arch], "vocab_size": VOCAB_SIZE, **overrides}
    config_cls = transformers.AutoConfig.for_model(fields.pop("model_type"))
    config = type(config_cls)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    generation = {"bos_token_id": 0, "eos_token_id": [1, 3], "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path
