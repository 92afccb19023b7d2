"""OpenAI's Responses API shapes (platform.openai.com/docs/api-reference/responses): the request
of `/v1/responses` as pydantic models, its input items and tools, and the response object's
schema. The door is openai_responses.py.

Strict where it matters (a wrong type anywhere, an unknown top-level field or item type is a
400); fields a newer client adds inside an item or a tool are ignored, and a message item may
leave its type out, as OpenAI allows.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from localllm.server.protocol import Int, KeepAlive

# -- requests --------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Part(BaseModel):
    """An item or a part: its type checked, its known fields typed, later fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Part):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Part):
    type: Literal["refusal"]
    refusal: str


class MediaPart(_Part):
    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


class MessageItem(_Part):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Part):
    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # a message may leave its type out
    return getattr(value, "type", None)


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(_Part):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Part):
    """Function tools grouped under a name (Codex's multi_agent_v1): each is offered as it is."""

    type: Literal["namespace"]
    name: str
    tools: list[FunctionTool]


class HostedTool(_Part):
    """A tool OpenAI's service runs (web_search, file_search, code_interpreter, mcp, ...): there
    is no such service here, so it is not offered to the model (Codex sends web_search always)."""

    type: str


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
                 | Annotated[HostedTool, Tag("hosted")], Discriminator(_tool_type)]


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    """What the openai SDK's responses.create sends that means something here; the hosted
    service's own fields (include, truncation, service_tier, prompt_cache_key, ...) are accepted
    and ignored."""

    model: str | None = None  # absent: the served model
    keep_alive: KeepAlive = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's


class ResponseObject(BaseModel):
    """The response object (its main fields; every one is sent)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    output: list[dict[str, Any]]
