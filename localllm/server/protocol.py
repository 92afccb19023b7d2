"""OpenAI's request and response shapes as pydantic models. Requests forbid unknown fields
(a typo is a 400, not silently ignored) but accept the common ones editors send, and the
extensions llama-server's and vLLM's clients send (n_predict, grammar, json_schema, top_k,
min_p, ...); they are strict about types, as OpenAI is ("5" is not a number, false is not a
token id)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator


def _whole(value):
    """5.0 is the integer 5, as JSON Schema has it; "5", true and 5.5 stay what they are (errors)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer parameter: strict (no strings, no booleans) but, like JSON Schema, takes 5.0 for 5.
Int = Annotated[int, BeforeValidator(_whole)]


# Ollama's keep_alive: how long the model stays loaded after this request ("5m", 300, 0: unload
# after it, -1: keep it loaded); checked by manager.parse_keep_alive (a bad one is a 400).
KeepAlive = float | str | None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama-server's form: {"type": "json_object", "schema": {...}}, an object the schema allows.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: dict[str, str]


class _Sampling(_Request):
    model: str | None = None  # absent: the served model (llama-server and vLLM take it so)
    keep_alive: KeepAlive = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: Int = Field(default=1, ge=1, le=8)
    seed: Int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # llama.cpp-style extras that OpenAI-compatible local servers accept.
    top_k: Int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, ge=1e-3, le=1e3)
    # OpenAI's: token ids (as strings) -> a value in [-100, 100] added to their logits;
    # SamplingParams checks the ids and the values.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # llama-server's (and vLLM's): n_predict is max_tokens (-1: until the context ends; it wins
    # over max_tokens, as in llama-server); grammar is Lark (llguidance's) or GBNF text the
    # answer must match; json_schema a JSON schema it must match. regex (localllm's, as vLLM's
    # guided_regex) a regular expression the whole answer matches. At most one of grammar,
    # json_schema, regex and response_format.
    n_predict: Int | None = Field(default=None, ge=-1)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    # llama-server's, accepted and ignored: the prefix cache always caches and needs no slot;
    # no per-token timings or prompt progress are sent.
    cache_prompt: bool | None = None
    id_slot: Int | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    # localllm's own: false turns prompt-lookup drafting off for this request, true drafts at
    # every step where the prompt offers a match, absent follows the server (which drafts
    # where it pays, or never with `serve --no-spec`). Strict: "yes" or 1 is a 400.
    speculative: StrictBool | None = None

    @field_validator("n_predict")
    @classmethod
    def _some_tokens(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("n_predict 0 asks for no answer; give -1 (until the context ends) or 1 or more")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def max_new_tokens(self, asked: int | None) -> int | None:
        """The answer's most tokens: n_predict when given (None for -1: until the context
        ends), else ``asked`` (the door's max_tokens)."""
        if self.n_predict is None:
            return asked
        return None if self.n_predict == -1 else self.n_predict


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # Thinking models: "none" (or chat_template_kwargs {"enable_thinking": false}, vLLM's and
    # llama-server's way) asks the template to skip the reasoning; the other efforts think.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    # One prompt (text or token ids) or several (texts, or lists of token ids): each gets n
    # choices, prompt p's j-th at index p * n + j.
    prompt: str | list[Int] | list[str] | list[list[Int]]
    suffix: str | None = None
    max_tokens: Int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=5)
    best_of: Int | None = Field(default=None, ge=1, le=1)
    # llama-server's: each choice also gives its answer's token ids, as `tokens`.
    return_tokens: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind(cls, value):
        """A list of prompts is all texts or all token-id lists (one prompt: all ids); a mix
        is refused with that said, rather than as whichever union member failed first."""
        if isinstance(value, list):
            kinds = sorted({"texts" if isinstance(x, str) else "token-id lists" if isinstance(x, list) else "token ids"
                            for x in value})
            if len(kinds) > 1:
                raise ValueError(f"the prompt list mixes {' and '.join(kinds)}; give one text, a list of token "
                                 "ids, a list of texts or a list of token-id lists")
        return value


# -- responses -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A thinking model's reasoning, never in content: llama-server's name and vLLM's / Ollama's.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    tokens: list[int] | None = None  # with return_tokens (llama-server's): the answer's token ids


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelMeta(BaseModel):
    """llama-server's `meta` of a model: the context this server gives a request, the one the
    model was trained for (null where its file does not say), its vocabulary."""

    n_ctx: int | None
    n_ctx_train: int | None
    n_vocab: int | None  # null for a model not loaded yet


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "localllm"
    context_length: int | None  # tokens one request may hold, prompt and answer together (None: upstream's)
    max_model_len: int | None  # the same, by vLLM's name
    kind: Literal["chat", "completion", "embedding"] = "chat"  # completion: no chat template (a base model)
    loaded: bool = True  # in memory now; one that is not loads on its first request
    meta: ModelMeta


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
