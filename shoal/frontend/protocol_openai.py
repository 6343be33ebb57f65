"""Pydantic models of the OpenAI request bodies (validation only; responses are plain dicts).

Field ranges follow SamplingParams, so a bad value is reported as a 400 naming its field
before anything reaches an engine: integers stay within 64 bits, floats are finite, and
text holds no lone UTF-16 surrogate (JSON can spell one; UTF-8 cannot carry it). Unknown
fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _valid_unicode(text: str) -> str:
    """The text, if UTF-8 can carry it (no lone surrogate); else a ValueError."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ValueError("contains a lone UTF-16 surrogate (not valid Unicode)") from None
    return text


def _check_unicode(value: Any) -> None:
    """Raise ValueError if any string (or dict key) inside `value` holds a lone surrogate."""
    if isinstance(value, str):
        _valid_unicode(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # below the vocabulary size: preprocess


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the output must follow, and its name."""

    model_config = ConfigDict(populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields shared by chat and completions: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Int64 | None = None
    stop: list[Text] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs object, and the
    # names vLLM removed in 0.12 (refused with their replacement named, never ignored)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None

    @field_validator("structured_outputs")
    @classmethod
    def _structured_unicode(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        _check_unicode(value)
        return value

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

    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) reach the chat template unchanged."""

    model_config = ConfigDict(extra="allow")

    role: Text
    content: Text | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _extra_unicode(self) -> ChatMessage:
        _check_unicode(self.model_extra)
        return self


class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does, and the JSON schema of its arguments."""

    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_unicode(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        _check_unicode(value)
        return value


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    """tool_choice naming the function the model must call."""

    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_unicode(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        _check_unicode(value)
        return value


class CompletionRequest(SamplingFields):
    prompt: list[Text] | list[list[TokenId]]
    max_tokens: Count | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_list(cls, value: Any) -> Any:
        """Accept a string, strings, a token-id list or token-id lists; return a list of them."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids "
                "or a list of token-id lists, and not empty"
            )
        for item in value:
            if not item:
                raise ValueError("must not contain an empty prompt")
            if isinstance(item, list) and all(isinstance(t, int) for t in item):
                low, high = min(item), max(item)
                if low < 0 or high > INT64_MAX:
                    raise ValueError(f"token id {low if low < 0 else high} is out of range")
        return value


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer (for the OpenAPI document; errors.py builds it)."""

    error: ErrorDetail
