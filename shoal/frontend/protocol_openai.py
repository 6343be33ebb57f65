"""Pydantic models of the OpenAI request bodies (validation only; responses are plain dicts).

Field ranges follow SamplingParams, so a bad value is reported as a 400 naming its field
before anything reaches an engine. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) reach the chat template unchanged."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_list(cls, value: Any) -> Any:
        """Accept a string, strings, a token-id list or token-id lists; return a list of them."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids "
                "or a list of token-id lists, and not empty"
            )
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_items(cls, value: list) -> list:
        for item in value:
            if not item:
                raise ValueError("must not contain an empty prompt")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise ValueError("token ids must be non-negative")
        return value
