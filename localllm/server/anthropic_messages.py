"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the shared request
path (core.Server), as Claude Code and the `anthropic` SDK speak it: its request and response
shapes (anthropic_protocol.py), its named-event stream, its errors (errors.py gives every error
under /v1/messages Anthropic's shape).

Requests are strict as Anthropic's are: an unknown top-level field or block type is a 400, as
is a wrong type anywhere (fields a newer client adds inside a block or a tool are ignored).
Image and document blocks are a 400 that says the model reads text only. A `tool_result` must
answer a `tool_use` id an earlier assistant turn gave. `output_config.format` (a JSON schema)
constrains the answer as OpenAI's response_format does. A thinking model's reasoning comes as a
`thinking` block before the text (unsigned: `signature` is empty); `thinking: {"type":
"disabled"}` asks its template to skip the reasoning.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from localllm.errors import LocalLLMError
from localllm.reasoning import Answer
from localllm.server.core import Choice, Server, ToolCall, json_or_text, sse
from localllm.server.anthropic_protocol import (CountTokensRequest, MessageOut, MessagesRequest, TextOut, ThinkingOut,
                                                TokenCount, ToolResultBlock, ToolUseOut, Usage)
from localllm.server.errors import APIError, error_body
from localllm.server.models import ServedModels


def _text_of(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    if any(b.type != "text" for b in content):
        raise APIError(400, f"{where}: a system message holds text blocks only", param=where)
    return "".join(b.text for b in content)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_input(call: ToolCall) -> dict:
    arguments = json_or_text(call.arguments)
    return arguments if isinstance(arguments, dict) else {}


# -- the door --------------------------------------------------------------------------------


class AnthropicMessages:
    def __init__(self, server: Server):
        self.server = server

    def chat(self, req: CountTokensRequest) -> tuple[list[dict], list[dict] | None]:
        """The request as the chat template takes it: (messages, tools or None)."""
        messages: list[dict] = []
        system = [req.system] if isinstance(req.system, str) else [b.text for b in req.system or ()]
        # System text in the middle of the conversation joins the system prompt: every template
        # takes one system message first, few take one later.
        system += [_text_of(m.content, f"messages.{i}") for i, m in enumerate(req.messages) if m.role == "system"]
        if any(system):
            messages.append({"role": "system", "content": "\n\n".join(t for t in system if t)})
        known_ids: set[str] = set()
        for i, m in enumerate(req.messages):
            if m.role == "system":
                continue
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            texts, calls = [], []
            for j, block in enumerate(m.content):
                where = f"messages.{i}.content.{j}"
                if block.type == "text":
                    texts.append(block.text)
                elif block.type in ("image", "document"):
                    raise self.unseen(block.type, where)
                elif block.type == "tool_use":
                    if m.role != "assistant":
                        raise APIError(400, f"{where}: tool_use blocks belong to assistant turns", param=where)
                    known_ids.add(block.id)
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": block.input}})
                elif block.type == "tool_result":
                    if m.role != "user":
                        raise APIError(400, f"{where}: tool_result blocks belong to user turns", param=where)
                    if block.tool_use_id not in known_ids:
                        raise APIError(400, f"{where}: tool_result for tool_use_id '{block.tool_use_id}', which no "
                                            "earlier assistant turn's tool_use block has", param=where)
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                     "content": self.result_text(block, where)})
                # thinking blocks of earlier turns are left out, as thinking templates do
            if m.role == "assistant":
                messages.append({"role": "assistant", "content": "".join(texts)} | ({"tool_calls": calls} if calls else {}))
            elif texts or not any(b.type == "tool_result" for b in m.content):
                messages.append({"role": "user", "content": "".join(texts)})
        use_tools = req.tools and not (req.tool_choice and req.tool_choice.type == "none")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in req.tools] if use_tools else None
        return messages, tools

    def unseen(self, kind: str, where: str) -> APIError:
        return APIError(400, f"{where}: {kind} blocks are not supported: the model '{self.server.model_id}' reads "
                             "text only; send the content as text", param=where)

    def result_text(self, block: ToolResultBlock, where: str) -> str:
        if block.content is None or isinstance(block.content, str):
            return block.content or ""
        for k, part in enumerate(block.content):
            if part.type != "text":
                raise self.unseen(part.type, f"{where}.content.{k}")
        return "".join(part.text for part in block.content)

    async def count_tokens(self, req: CountTokensRequest) -> TokenCount:
        messages, tools = self.chat(req)
        return TokenCount(input_tokens=len(await self.server.chat_prompt(messages, tools)))

    async def create(self, req: MessagesRequest, request: Request):
        server = self.server
        messages, tools = self.chat(req)
        grammar = None
        choice = req.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
        if tools and choice is not None and choice.type in ("any", "tool"):
            grammar = await server.tool_grammar(tools, choice.name if choice.type == "tool" else None, "tool_choice.name")
        elif req.output_config is not None and req.output_config.format is not None:
            grammar = await server.json_grammar(req.output_config.format.schema_, "output_config.format.schema")
        thinking = not (req.thinking is not None and req.thinking.type == "disabled")
        prompt_ids = await server.chat_prompt(messages, tools, thinking)
        answer = Answer(server.reasoning_for(prompt_ids))
        # max_tokens is a cap here, as Ollama has it: Claude Code asks 32,000 of any model, and
        # the answer stops (stop_reason max_tokens) where the context ends. A prompt that leaves
        # no room at all is a 400.
        room = server.max_model_len - len(prompt_ids)
        max_tokens = server.max_tokens_for(len(prompt_ids), min(req.max_tokens, max(room, 1)), "max_tokens")
        params = server.sampling_params(
            max_tokens=max_tokens, stop=tuple(req.stop_sequences or ()), grammar=grammar,
            temperature=1.0 if req.temperature is None else req.temperature,  # Anthropic's default
            top_p=req.top_p, top_k=req.top_k)
        server.check_capacity(1)
        mid = new_id("msg")
        if req.stream:
            return StreamingResponse(self.stream(mid, prompt_ids, params, tools, answer),
                                     media_type="text/event-stream")
        [c] = await server.collect(request, prompt_ids, params)
        reasoning, text = answer.split(c.text)
        content, calls, finish = server.split_tool_calls(text, tools, c.finish_reason, lambda: new_id("toolu"))
        blocks: list = [ThinkingOut(thinking=reasoning)] if reasoning else []
        blocks += [TextOut(text=content)] if content else []
        blocks += [ToolUseOut(id=call.id, name=call.name, input=tool_input(call)) for call in calls]
        return MessageOut(id=mid, model=server.model_id, content=blocks,
                          stop_reason=stop_reason(finish, c.stop_sequence), stop_sequence=c.stop_sequence,
                          usage=self.usage(len(prompt_ids), c)).model_dump()

    def usage(self, num_prompt: int, c: Choice) -> Usage:
        return Usage(input_tokens=num_prompt - c.num_cached_tokens, output_tokens=len(c.token_ids),
                     cache_read_input_tokens=c.num_cached_tokens)

    async def stream(self, mid: str, prompt_ids: list[int], params, tools: list[dict] | None,
                     answer: Answer) -> AsyncIterator[str]:
        """Anthropic's event sequence: message_start, ping, per block content_block_start /
        _delta / _stop, message_delta (stop reason, usage), message_stop. A thinking model's
        reasoning streams as a thinking block before the text. Text streams as it comes; with
        tools, text that may start a call is held until it is known, and each call is a
        tool_use block as soon as it is whole."""
        server = self.server
        blocks = _Blocks()
        parser = server.tool_call_parser(tools) if tools else None

        def said(reasoning: str, content: str, final: bool = False) -> list[str]:
            calls = []
            if parser is not None:
                content, calls = parser.feed(content)
                if final:
                    rest, last = parser.finish()
                    content, calls = content + rest, calls + last
            events = blocks.say(reasoning, content)
            for call in calls:
                events += blocks.tool_use(ToolCall(new_id("toolu"), call.name, call.arguments))
            return events

        start = MessageOut(id=mid, model=server.model_id, content=[], stop_reason=None, stop_sequence=None,
                           usage=Usage(input_tokens=len(prompt_ids), output_tokens=0))
        yield _event("message_start", message=start.model_dump())
        yield _event("ping")
        c = Choice(0)
        try:
            async for _, out in server.run_choices(prompt_ids, params):
                server.add(c, out)
                for e in said(*answer.feed(out.text)):
                    yield e
            for e in said(*answer.finish(), final=True):
                yield e
        except LocalLLMError as e:
            _, body = error_body("/v1/messages", 500, str(e), "server_error")
            yield sse(body, event="error")
            return
        for e in blocks.close():
            yield e
        finish = "tool_calls" if parser is not None and parser.num_calls else c.finish_reason
        yield _event("message_delta", delta={"stop_reason": stop_reason(finish, c.stop_sequence),
                                             "stop_sequence": c.stop_sequence},
                     usage=self.usage(len(prompt_ids), c).model_dump())
        yield _event("message_stop")


def _event(kind: str, **data) -> str:
    return sse({"type": kind} | data, event=kind)


class _Blocks:
    """The content blocks of a streamed message: a thinking block, then a text block, then
    tool_use blocks, each opened when its first piece comes and closed before the next."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [_event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def say(self, reasoning: str, content: str) -> list[str]:
        events = []
        if reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "thinking_delta", "thinking": reasoning}))
        if content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": content}))
        return events

    def tool_use(self, call: ToolCall) -> list[str]:
        events = self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        events.append(_event("content_block_delta", index=self.index,
                             delta={"type": "input_json_delta", "partial_json": json.dumps(tool_input(call))}))
        return events + self.close()


def add_routes(app: FastAPI, models: ServedModels) -> None:
    @app.post("/v1/messages", response_model=None,
              responses={200: {"model": MessageOut, "content": {"text/event-stream": {}}}})
    async def messages(body: MessagesRequest, request: Request):
        async with models.lease(body.model, body.keep_alive) as lease:
            return lease.hand_over(await AnthropicMessages(lease.server).create(body, request))

    @app.post("/v1/messages/count_tokens", response_model=TokenCount)
    async def count_tokens(body: CountTokensRequest):
        async with models.lease(body.model, body.keep_alive) as lease:
            return await AnthropicMessages(lease.server).count_tokens(body)
