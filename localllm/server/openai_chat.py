"""OpenAI's chat completions and completions APIs (`/v1/chat/completions`, `/v1/completions`)
over the shared request path (core.Server); their shapes are in protocol.py. Errors have
OpenAI's shape and status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from localllm.engine.request import SamplingParams
from localllm.errors import LocalLLMError, UsageError
from localllm.server import protocol as P
from localllm.reasoning import Answer
from localllm.server.core import Choice, Server, json_or_text, sse
from localllm.server.errors import APIError

EVENT_STREAM = {"text/event-stream": {}}  # with "stream": true: SSE events of the chunk objects


def choice_params(server: Server, req: P._Sampling, max_tokens: int, logprobs: bool, grammar: str | None,
                  top_logprobs: int) -> list[SamplingParams]:
    return server.sampling_params(
        n=req.n, seed=req.seed, max_tokens=max_tokens, stop=req.stop_list(), logprobs=logprobs, grammar=grammar,
        top_logprobs=top_logprobs, speculative=req.speculative,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repeat_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty)


def usage(num_prompt: int, choices: list[Choice]) -> P.Usage:
    completion = sum(len(c.token_ids) for c in choices)
    cached = choices[0].num_cached_tokens if choices else 0
    return P.Usage(prompt_tokens=num_prompt, completion_tokens=completion, total_tokens=num_prompt + completion,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


def stream_error(e: LocalLLMError) -> str:
    return sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})


class OpenAIChat:
    def __init__(self, server: Server):
        self.server = server
        self.tokenizer = server.tokenizer

    def token_logprobs(self, token_ids: list[int], logprobs: list[float],
                       tops: list[list[tuple[int, float]]] | None = None) -> list[P.TokenLogprob]:
        tops = tops or [[] for _ in token_ids]
        return [P.TokenLogprob(token=self.tokenizer.decode([t]), logprob=lp, top_logprobs=[
                    {"token": self.tokenizer.decode([i]), "logprob": v, "bytes": None} for i, v in top])
                for t, lp, top in zip(token_ids, logprobs, tops)]

    # -- chat -----------------------------------------------------------------------------

    async def chat(self, req: P.ChatCompletionRequest, request: Request):
        server = self.server
        server.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported yet; leave it out", param="logit_bias")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        grammar = self.grammar_for(req, tools)
        thinking = not (req.reasoning_effort == "none"
                        or (req.chat_template_kwargs or {}).get("enable_thinking") is False)
        prompt_ids = await server.chat_prompt([message_dict(m) for m in req.messages], tools, thinking,
                                              req.chat_template_kwargs)
        markers = server.reasoning_for(prompt_ids)
        max_tokens = server.max_tokens_for(len(prompt_ids), req.max_completion_tokens or req.max_tokens, "messages")
        params = choice_params(server, req, max_tokens, req.logprobs, grammar, req.top_logprobs or 0)
        server.check_capacity(req.n)
        rid = P.new_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._chat_stream(rid, req, prompt_ids, params, include_usage, tools, markers),
                                     media_type="text/event-stream")
        choices = await server.collect(request, prompt_ids, params)
        return P.ChatCompletion(
            id=rid, model=server.model_id,
            choices=[self._chat_choice(c, req, tools, Answer(markers)) for c in choices],
            usage=usage(len(prompt_ids), choices),
        ).model_dump(exclude_none=False)

    def grammar_for(self, req: P.ChatCompletionRequest, tools: list[dict] | None) -> str | None:
        if tools and (req.tool_choice == "required" or isinstance(req.tool_choice, P.NamedToolChoice)):
            name = req.tool_choice.function.get("name") if isinstance(req.tool_choice, P.NamedToolChoice) else None
            return self.server.tool_grammar(tools, name)
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return self.server.json_grammar(None, "response_format")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        return self.server.json_grammar(fmt.json_schema.schema_, "response_format")

    def tool_calls(self, text: str, tools: list[dict] | None, finish: str | None):
        content, calls, finish = self.server.split_tool_calls(text, tools, finish, lambda: P.new_id("call"))
        return content, [P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
                         for c in calls] or None, finish

    def _chat_choice(self, c: Choice, req: P.ChatCompletionRequest, tools: list[dict] | None,
                     answer: Answer) -> P.ChatChoice:
        reasoning, text = answer.split(c.text)
        content, calls, finish = self.tool_calls(text, tools, c.finish_reason)
        message = P.ResponseMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls)
        return P.ChatChoice(
            index=c.index, message=message, finish_reason=finish,
            logprobs=P.ChoiceLogprobs(content=self.token_logprobs(c.token_ids, c.logprobs, c.top_logprobs))
            if req.logprobs else None)

    async def _chat_stream(self, rid: str, req: P.ChatCompletionRequest, prompt_ids: list[int],
                           params: list[SamplingParams], include_usage: bool,
                           tools: list[dict] | None = None, markers=None) -> AsyncIterator[str]:
        """Chunks as the answer comes: reasoning in reasoning_content (and reasoning), never
        in content; with tools the answer is sent when it ends, where its calls are known."""
        server = self.server
        choices = [Choice(i) for i in range(len(params))]
        answers = [Answer(markers) for _ in params]

        def said(reasoning: str, content: str | None) -> P.ChunkDelta:
            return P.ChunkDelta(content=content if content or not reasoning else None,
                                reasoning_content=reasoning or None, reasoning=reasoning or None)

        def chunk(index: int, delta: P.ChunkDelta, finish: str | None = None, logprobs=None) -> str:
            c = P.ChatCompletionChunk(id=rid, model=server.model_id, choices=[
                P.ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)])
            return sse(c.model_dump(exclude_none=True) | {"choices": [
                ch.model_dump(exclude_none=True) | {"finish_reason": finish} for ch in c.choices]})

        for i in range(len(params)):
            yield chunk(i, P.ChunkDelta(role="assistant", content=""))
        try:
            async for i, out in server.run_choices(prompt_ids, params):
                server.add(choices[i], out)
                lp = (P.ChoiceLogprobs(content=self.token_logprobs(out.token_ids, out.logprobs or [], out.top_logprobs))
                      if req.logprobs and out.token_ids else None)
                if tools:  # a tool call is only known whole: the answer is sent when it ends
                    if out.finished:
                        reasoning, text = answers[i].split(choices[i].text)
                        content, calls, finish = self.tool_calls(text, tools, out.finish_reason)
                        delta = said(reasoning or "", content)
                        delta.tool_calls = [{"index": k, **c.model_dump()} for k, c in enumerate(calls)] if calls else None
                        yield chunk(i, delta)
                        yield chunk(i, P.ChunkDelta(), finish=finish)
                    continue
                reasoning, content = answers[i].feed(out.text)
                if reasoning or content or lp is not None:
                    yield chunk(i, said(reasoning, content), logprobs=lp)
                if out.finished:
                    reasoning, content = answers[i].finish()
                    if reasoning or content:
                        yield chunk(i, said(reasoning, content))
                    yield chunk(i, P.ChunkDelta(), finish=out.finish_reason)
        except LocalLLMError as e:
            yield stream_error(e)
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(P.ChatCompletionChunk(id=rid, model=server.model_id, choices=[],
                                            usage=usage(len(prompt_ids), choices)).model_dump())
        yield sse("[DONE]")

    # -- completions ----------------------------------------------------------------------

    async def completions(self, req: P.CompletionRequest, request: Request):
        server = self.server
        server.check_model(req.model)
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported yet; leave it out", param="logit_bias")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                               param="prompt")
            prompt = prompt[0]
        if req.suffix is not None:
            if not isinstance(prompt, str):
                raise APIError(400, "suffix needs the prompt as text", param="suffix")
            prompt_ids = self.fim_prompt(prompt, req.suffix, "suffix")
        elif isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            n_vocab = self.tokenizer.n_vocab
            bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary of {n_vocab}", param="prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty; give at least one token of text", param="prompt")
        max_tokens = server.max_tokens_for(len(prompt_ids), req.max_tokens, "prompt")
        want_logprobs = req.logprobs is not None
        params = choice_params(server, req, max_tokens, want_logprobs, None, req.logprobs or 0)
        server.check_capacity(req.n)
        rid = P.new_id("cmpl")
        echo = self.tokenizer.decode(prompt_ids) if req.echo and req.suffix is None else ""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._completion_stream(rid, prompt_ids, params, echo, want_logprobs, include_usage),
                                     media_type="text/event-stream")
        choices = await server.collect(request, prompt_ids, params)
        return P.Completion(
            id=rid, model=server.model_id,
            choices=[P.CompletionChoice(index=c.index, text=echo + c.text, finish_reason=c.finish_reason,
                                        logprobs=self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                                        if want_logprobs else None)
                     for c in choices],
            usage=usage(len(prompt_ids), choices),
        ).model_dump()

    def fim_prompt(self, prefix: str, suffix: str, param: str) -> list[int]:
        """The model's fill-in-the-middle prompt: the text before and after the cursor."""
        encode_fim = getattr(self.tokenizer, "encode_fim", None)
        if encode_fim is None:
            raise APIError(400, "fill-in-the-middle is not supported yet", param=param)
        try:
            return encode_fim(prefix, suffix)
        except UsageError as e:
            raise APIError(400, str(e), param=param) from None

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[float],
                             tops: list[list[tuple[int, float]]] | None = None) -> P.CompletionLogprobs:
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = [{self.tokenizer.decode([i]): v for i, v in step} for step in tops] if tops else None
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=top,
                                    text_offset=offsets)

    async def _completion_stream(self, rid: str, prompt_ids: list[int], params: list[SamplingParams], echo: str,
                                 want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
        server = self.server
        choices = [Choice(i) for i in range(len(params))]

        def chunk(index: int, text: str, finish: str | None, logprobs=None) -> str:
            return sse(P.Completion(id=rid, model=server.model_id, choices=[
                P.CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=logprobs)]).model_dump(exclude_none=True)
                | {"choices": [{"index": index, "text": text, "finish_reason": finish,
                                "logprobs": logprobs.model_dump() if logprobs else None}]})

        if echo:
            for i in range(len(params)):
                yield chunk(i, echo, None)
        try:
            async for i, out in server.run_choices(prompt_ids, params):
                server.add(choices[i], out)
                lp = (self._completion_logprobs(out.token_ids, out.logprobs or [], out.top_logprobs)
                      if want_logprobs else None)
                if out.text or out.finished:
                    yield chunk(i, out.text, out.finish_reason if out.finished else None, lp)
        except LocalLLMError as e:
            yield stream_error(e)
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(P.Completion(id=rid, model=server.model_id, choices=[],
                                   usage=usage(len(prompt_ids), choices)).model_dump())
        yield sse("[DONE]")


def message_dict(m: P.ChatMessage) -> dict:
    """An OpenAI chat message as the chat template takes it."""
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        # Templates expect arguments as an object (they render it with tojson).
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json_or_text(c.function.arguments)}} for c in m.tool_calls]
    return msg


def add_routes(app: FastAPI, server: Server) -> None:
    door = OpenAIChat(server)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": P.ChatCompletion, "content": EVENT_STREAM}})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await door.chat(body, request)

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": P.Completion, "content": EVENT_STREAM}})
    async def completions(body: P.CompletionRequest, request: Request):
        return await door.completions(body, request)
