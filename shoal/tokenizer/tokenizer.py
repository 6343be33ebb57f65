"""TextTokenizer: an HF tokenizer folder read with `tokenizers` and jinja2 (no transformers)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise jinja2.TemplateError(message)


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if self.chat_template is None and jinja_file.is_file():
            self.chat_template = jinja_file.read_text()
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values()), None))
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.bos_token_id = self.token_to_id(self.bos_token)
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; the GIL is released while it works, so a thread may call it.

        `Tokenizer.encode` holds the GIL for the whole text; the batch call does not, and its
        fast form skips the character offsets nobody here reads.
        """
        (encoding,) = self.tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return encoding.ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render the model's chat template (as transformers does, with the same globals)."""
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat_template; send a plain completion")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
                x, indent=indent, ensure_ascii=False
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """Token ids of the rendered chat; the template already carries the special tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)
