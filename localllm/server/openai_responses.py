"""OpenAI's Responses API (`/v1/responses`), as Codex and the `openai-agents` SDK speak it, over
the shared request path (core.Server): its request and response shapes (responses_protocol.py),
its event stream, and the kept responses that `previous_response_id` continues
(response_store.py). Errors have OpenAI's shape.

Input is a string or a list of items: messages (input_text / output_text parts), function_call
and function_call_output items; reasoning items are accepted and left out of the prompt. Only
function tools exist here (a namespace's are offered as they are; tools OpenAI's service runs,
such as web_search, are not offered); images and files are a 400 naming what to send.
A response is kept (`store`, true by default as OpenAI has it) with the conversation it ended;
`instructions` are not carried over to the next response, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from localllm.errors import LocalLLMError
from localllm.reasoning import Answer
from localllm.server.core import Choice, Server, ToolCall, json_or_text, sse
from localllm.server.errors import APIError
from localllm.server.models import ServedModels
from localllm.server.response_store import ResponseStore
from localllm.server.responses_protocol import (HostedTool, MessageItem, NamedFunction, NamespaceTool, ResponseObject,
                                                ResponsesRequest)

# -- the door --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def part_text(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    for k, part in enumerate(content):
        if part.type in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{part.type} parts are not supported: this model reads text only; send the "
                                "content as input_text", param=f"{where}.content.{k}")
    return "".join(p.text if p.type != "refusal" else p.refusal for p in content)


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def call_item(call: ToolCall, req: ResponsesRequest) -> dict:
    """A function_call item; a namespace's function keeps its namespace, as Codex expects."""
    item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}
    for tool in req.tools or ():
        if tool.type == "namespace" and any(f.name == call.name for f in tool.tools):
            item["namespace"] = tool.name
    return item


class OpenAIResponses:
    def __init__(self, server: Server | None, store: ResponseStore):
        self.server, self.store = server, store

    async def conversation(self, req: ResponsesRequest) -> list[dict]:
        """The chat so far (a previous response's, then this input), without the instructions."""
        messages: list[dict] = []
        if req.previous_response_id is not None:
            stored = await asyncio.to_thread(self.store.get, req.previous_response_id)
            if stored is None:
                raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found: it was "
                                    "never stored (store=false), was deleted, or is older than the newest "
                               f"{self.store.max_responses} kept", param="previous_response_id",
                               code="previous_response_not_found")
            messages = list(stored.conversation)
        items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
        known_ids = {c["id"] for m in messages for c in m.get("tool_calls", ())}
        for i, item in enumerate(items):
            where = f"input.{i}"
            if item.type == "message":
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": part_text(item.content, where)})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": json_or_text(item.arguments)}}
                known_ids.add(item.call_id)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type == "function_call_output":
                if item.call_id not in known_ids:
                    raise APIError(400, f"{where}: function_call_output for call_id '{item.call_id}', which no "
                                        "function_call before it has", param=where)
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": part_text(item.output, where)})
            # reasoning items: their text is not part of the prompt
        return messages

    async def grammar(self, req: ResponsesRequest, tools: list[dict] | None) -> str | None:
        choice = req.tool_choice
        if tools and (choice == "required" or isinstance(choice, NamedFunction)):
            return await self.server.tool_grammar(tools, choice.name if isinstance(choice, NamedFunction) else None)
        fmt = req.text.format if req.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs its schema", param="text.format.schema")
        return await self.server.json_grammar(fmt.schema_ if fmt.type == "json_schema" else None, "text.format.schema")

    async def create(self, req: ResponsesRequest, request: Request):
        server = self.server
        conversation = await self.conversation(req)
        functions = [f for t in req.tools or () if not isinstance(t, HostedTool)
                     for f in (t.tools if isinstance(t, NamespaceTool) else [t])]
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.parameters or {"type": "object", "properties": {}}}}
                 for t in functions] if functions and req.tool_choice != "none" else None
        grammar = await self.grammar(req, tools)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        thinking = (req.reasoning or {}).get("effort") != "none"
        prompt_ids = await server.chat_prompt(system + conversation, tools, thinking)
        answer = Answer(server.reasoning_for(prompt_ids))
        max_tokens = server.max_tokens_for(len(prompt_ids), req.max_output_tokens, "max_output_tokens")
        params = server.sampling_params(max_tokens=max_tokens, grammar=grammar, top_p=req.top_p,
                                        temperature=1.0 if req.temperature is None else req.temperature)
        server.check_capacity(1)
        base = self.response(new_id("resp"), req, "in_progress", [], None)
        if req.stream:
            return StreamingResponse(self.stream(base, req, conversation, prompt_ids, params, tools, answer),
                                     media_type="text/event-stream")
        [c] = await server.collect(request, prompt_ids, params)
        reasoning, content, calls, status = self.result(c, answer, tools)
        output = ([reasoning_item(reasoning)] if reasoning else []) + ([message_item(content, status)] if content else [])
        return await self.finish(base, req, conversation, prompt_ids, c, output + [call_item(k, req) for k in calls],
                                 content, calls, status)

    def response(self, rid: str, req: ResponsesRequest, status: str, output: list[dict], usage: dict | None) -> dict:
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else (req.tool_choice or "auto")
        return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
                "model": self.server.model_id, "output": output, "usage": usage, "error": None,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
                "temperature": 1.0 if req.temperature is None else req.temperature, "top_p": req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": choice,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "text": {"format": fmt},
                "store": req.store, "metadata": req.metadata or {}, "reasoning": req.reasoning,
                "truncation": req.truncation or "disabled", "user": req.user}

    def result(self, c: Choice, answer: Answer, tools: list[dict] | None):
        """(reasoning, content, tool calls, status) of the finished answer ``c``."""
        reasoning, text = answer.split(c.text)
        content, calls, finish = self.server.split_tool_calls(text, tools, c.finish_reason, lambda: new_id("call"))
        return reasoning, content, calls, "incomplete" if finish == "length" else "completed"

    async def finish(self, base: dict, req: ResponsesRequest, conversation: list[dict], prompt_ids: list[int],
                     c: Choice, output: list[dict], content: str | None, calls: list[ToolCall], status: str) -> dict:
        """The finished response with its ``output`` items, kept when ``store`` asks."""
        reasoning_tokens = 0  # not counted apart yet
        usage = {"input_tokens": len(prompt_ids), "input_tokens_details": {"cached_tokens": c.num_cached_tokens},
                 "output_tokens": len(c.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": len(prompt_ids) + len(c.token_ids)}
        response = base | {"status": status, "output": output, "usage": usage,
                           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        if req.store:
            said = {"role": "assistant", "content": content or ""}  # the reasoning stays out, as templates drop it
            if calls:
                said["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                    "name": call.name, "arguments": json_or_text(call.arguments)}} for call in calls]
            await asyncio.to_thread(self.store.put, response["id"], response, conversation + [said])
        return response

    async def stream(self, base: dict, req: ResponsesRequest, conversation: list[dict], prompt_ids: list[int],
                     params, tools: list[dict] | None, answer: Answer) -> AsyncIterator[str]:
        """The Responses event sequence: response.created, response.in_progress, then each output
        item (a reasoning item, a message, function calls) with its own events, and
        response.completed (or response.incomplete). Text streams as it comes; with tools the
        answer is held to its end, where its calls are known."""
        server = self.server
        out_items = _Output()
        yield out_items.event("response.created", response=base)
        yield out_items.event("response.in_progress", response=base)
        c = Choice(0)
        try:
            async for _, out in server.run_choices(prompt_ids, params):
                server.add(c, out)
                if not tools:
                    for e in out_items.say(*answer.feed(out.text)):
                        yield e
            if not tools:
                for e in out_items.say(*answer.finish()):
                    yield e
        except LocalLLMError as e:
            failed = base | {"status": "failed", "error": {"code": "server_error", "message": str(e)}}
            yield out_items.event("response.failed", response=failed)
            return
        reasoning, content, calls, status = self.result(c, answer, tools)
        if tools:
            for e in out_items.say(reasoning or "", content or ""):
                yield e
        for e in out_items.close(status):
            yield e
        for call in calls:
            for e in out_items.call(call_item(call, req)):
                yield e
        response = await self.finish(base, req, conversation, prompt_ids, c, out_items.items, content, calls, status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield out_items.event(kind, response=response)

    async def retrieve(self, response_id: str) -> dict:
        stored = await asyncio.to_thread(self.store.get, response_id)
        if stored is None:
            raise APIError(404, f"No response with id '{response_id}' is kept here", param="response_id",
                           code="not_found")
        return stored.response

    async def delete(self, response_id: str) -> dict:
        if not await asyncio.to_thread(self.store.delete, response_id):
            raise APIError(404, f"No response with id '{response_id}' is kept here", param="response_id",
                           code="not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Output:
    """The output items of a streamed response and their events, numbered in order: a reasoning
    item, then a message, each opened when its first piece comes and closed before the next."""

    def __init__(self) -> None:
        self.items: list[dict] = []  # closed items, as the response lists them
        self.sequence = 0
        self.open: dict | None = None
        self.text = ""

    def event(self, kind: str, **data) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1} | data, event=kind)

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def _start(self, item: dict, part: dict) -> list[str]:
        events = self.close("completed")
        self.open, self.text = item, ""
        return events + [self.event("response.output_item.added", output_index=len(self.items),
                                    item=item | {"status": "in_progress", "content": []}),
                         self.event("response.content_part.added", part=part, **self._where())]

    def say(self, reasoning: str, content: str) -> list[str]:
        events = []
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start(reasoning_item(""), {"type": "reasoning_text", "text": ""})
            self.text += reasoning
            events.append(self.event("response.reasoning_text.delta", delta=reasoning, **self._where()))
        if content:
            if self.open is None or self.open["type"] != "message":
                events += self._start(message_item("", "in_progress"),
                                      {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.text += content
            events.append(self.event("response.output_text.delta", delta=content, logprobs=[], **self._where()))
        return events

    def close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        if self.open["type"] == "reasoning":
            item = reasoning_item(self.text, self.open["id"])
            events = [self.event("response.reasoning_text.done", text=self.text, **self._where())]
        else:
            item = message_item(self.text, status, self.open["id"])
            events = [self.event("response.output_text.done", text=self.text, logprobs=[], **self._where())]
        events += [self.event("response.content_part.done", part=item["content"][0], **self._where()),
                   self.event("response.output_item.done", output_index=len(self.items), item=item)]
        self.items.append(item)
        self.open = None
        return events

    def call(self, item: dict) -> list[str]:
        index = len(self.items)
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=index,
                           item=item | {"arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


def add_routes(app: FastAPI, models: ServedModels, store: ResponseStore) -> None:
    door = OpenAIResponses(None, store)  # kept responses need no model

    @app.post("/v1/responses", response_model=None,
              responses={200: {"model": ResponseObject, "content": {"text/event-stream": {}}}})
    async def create(body: ResponsesRequest, request: Request):
        async with models.lease(body.model, body.keep_alive) as lease:
            return lease.hand_over(await OpenAIResponses(lease.server, store).create(body, request))

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve(response_id: str):
        return await door.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        return await door.delete(response_id)
