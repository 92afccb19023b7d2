"""Anthropic's Messages API shapes (docs.anthropic.com/en/api/messages): the requests of
`/v1/messages` and `/v1/messages/count_tokens` as pydantic models, and the message a
response is. The door is anthropic_messages.py.

Strict as Anthropic's API is: an unknown top-level field or block type is a 400, as is a wrong
type anywhere; fields a newer client adds inside a block or a tool are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from localllm.server.protocol import Int, KeepAlive

# -- requests --------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Part(BaseModel):
    """A block or a tool: its type is checked, its known fields are typed, and fields that
    Anthropic's API adds later are ignored, so a newer client still works."""

    model_config = ConfigDict(extra="ignore", strict=True)


CacheControl = dict[str, Any] | None  # prompt-caching hints: accepted; the prefix cache caches anyway


class TextBlock(_Part):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None


class MediaBlock(_Part):
    type: Literal["image", "document"]  # a 400: the model reads text only
    source: dict[str, Any]


class ToolUseBlock(_Part):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Part):
    """An earlier turn's reasoning: left out of the prompt, as thinking templates leave it."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Request):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation system text
    content: str | list[Block]


class Tool(_Part):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Request):
    user_id: str | None = None


class CountTokensRequest(_Request):
    model: str
    keep_alive: KeepAlive = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    speed: Literal["standard", "fast"] | None = None
    context_management: dict[str, Any] | None = None  # Claude Code's: the context here is not edited


class MessagesRequest(CountTokensRequest):
    """What the anthropic SDK (2.16) sends, and the sampling values its older versions and
    Claude Code send; the fields of Anthropic's hosted service (container, diagnostics,
    inference_geo, service_tier, workspace_id, user_profile_id) are accepted and mean nothing here."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# -- responses -------------------------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int  # prompt tokens computed for this request (Anthropic's sense: cache reads apart)
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens the prefix cache gave
    cache_creation_input_tokens: int = 0


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing to sign: the reasoning never leaves this machine


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Annotated[ThinkingOut | TextOut | ToolUseOut, Field(discriminator="type")]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int
