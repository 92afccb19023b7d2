"""OpenAI's chat completions and completions APIs (`/v1/chat/completions`, `/v1/completions`)
over the shared request path (core.Server); their shapes are in protocol.py. Errors have
OpenAI's shape and status. Both also take what llama-server's and vLLM's clients send beyond
OpenAI's fields (protocol._Sampling): n_predict, grammar, json_schema, regex, llama-server's
response_format {"type": "json_object", "schema": ...}; completions take several prompts in
one request, and return_tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from localllm.engine import constraint
from localllm.engine.request import SamplingParams
from localllm.errors import LocalLLMError, UsageError
from localllm.server import protocol as P
from localllm.reasoning import Answer
from localllm.server.core import Choice, Server, json_or_text, sse
from localllm.server.errors import APIError
from localllm.server.models import ServedModels

EVENT_STREAM = {"text/event-stream": {}}  # with "stream": true: SSE events of the chunk objects


def choice_params(server: Server, req: P._Sampling, max_tokens: int, logprobs: bool, grammar: str | None,
                  top_logprobs: int) -> list[SamplingParams]:
    return server.sampling_params(
        n=req.n, seed=req.seed, max_tokens=max_tokens, stop=req.stop_list(), logprobs=logprobs, grammar=grammar,
        top_logprobs=top_logprobs, speculative=req.speculative,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repeat_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        logit_bias=req.logit_bias or ())


async def request_grammar(server: Server, req: P._Sampling) -> str | None:
    """The grammar the answer must match, from at most one of: ``grammar`` (Lark or GBNF text),
    ``json_schema`` (both llama-server's), ``regex`` (localllm's) and ``response_format``
    (OpenAI's json_object and json_schema, and llama-server's json_object with a ``schema``)."""
    fmt = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
    given = [name for name, value in (("grammar", req.grammar), ("json_schema", req.json_schema),
                                      ("regex", req.regex), ("response_format", fmt)) if value is not None]
    if len(given) > 1:
        raise APIError(400, f"{given[0]} and {given[1]} each set what the answer must match; give one of them",
                       param=given[1])
    if req.grammar is not None:
        return await server.checked_grammar(lambda: constraint.text_grammar(req.grammar), "grammar")
    if req.regex is not None:
        return await server.checked_grammar(lambda: constraint.regex_grammar(req.regex), "regex")
    if req.json_schema is not None:
        return await server.json_grammar(req.json_schema, "json_schema")
    if fmt is None:
        return None
    if fmt.type == "json_object":
        return await server.json_grammar(fmt.schema_, "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return await server.json_grammar(fmt.json_schema.schema_, "response_format")


def usage(num_prompt: int, choices: list[Choice], num_per_prompt: int | None = None) -> P.Usage:
    """The usage of choices; with several prompts (``num_per_prompt`` choices each) the cached
    tokens are each prompt's first choice's, summed."""
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices[::num_per_prompt or len(choices) or 1])
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
        """Chat logprobs; each token's ``bytes`` are its own bytes from the vocabulary, so a
        token holding part of a UTF-8 character gives those bytes (its ``token`` text is the
        replacement character)."""
        tops = tops or [[] for _ in token_ids]
        tok = self.tokenizer
        return [P.TokenLogprob(token=tok.decode([t]), logprob=lp, bytes=list(tok.piece(t)), top_logprobs=[
                    {"token": tok.decode([i]), "logprob": v, "bytes": list(tok.piece(i))} for i, v in top])
                for t, lp, top in zip(token_ids, logprobs, tops)]

    # -- chat -----------------------------------------------------------------------------

    async def chat(self, req: P.ChatCompletionRequest, request: Request):
        server = self.server
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        grammar = await self.grammar_for(req, tools)
        thinking = not (req.reasoning_effort == "none"
                        or (req.chat_template_kwargs or {}).get("enable_thinking") is False)
        prompt_ids = await server.chat_prompt([message_dict(m) for m in req.messages], tools, thinking,
                                              req.chat_template_kwargs)
        markers = server.reasoning_for(prompt_ids)
        asked = req.max_new_tokens(req.max_completion_tokens or req.max_tokens)
        max_tokens = server.max_tokens_for(len(prompt_ids), asked, "messages")
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

    async def grammar_for(self, req: P.ChatCompletionRequest, tools: list[dict] | None) -> str | None:
        if tools and (req.tool_choice == "required" or isinstance(req.tool_choice, P.NamedToolChoice)):
            name = req.tool_choice.function.get("name") if isinstance(req.tool_choice, P.NamedToolChoice) else None
            return await self.server.tool_grammar(tools, name)
        return await request_grammar(self.server, req)

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
        in content; with tools, text that may start a call is held until it is known, and each
        call goes out whole as its own tool_calls delta."""
        server = self.server
        choices = [Choice(i) for i in range(len(params))]
        answers = [Answer(markers) for _ in params]
        tool_parsers = [server.tool_call_parser(tools) for _ in params] if tools else []

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
                if tools:  # content as soon as it cannot start a call; each call when it is whole
                    parser = tool_parsers[i]
                    reasoning, text = answers[i].feed(out.text)
                    content, calls = parser.feed(text)
                    if out.finished:  # what the reasoning split and the call parser still hold
                        more_reasoning, text = answers[i].finish()
                        more, fed = parser.feed(text)
                        rest, last = parser.finish()
                        reasoning, content, calls = reasoning + more_reasoning, content + more + rest, calls + fed + last
                    if reasoning or content or lp is not None:
                        yield chunk(i, said(reasoning, content), logprobs=lp)
                    for k, found in enumerate(calls, parser.num_calls - len(calls)):  # k: the call's index
                        call = P.ToolCall(id=P.new_id("call"),
                                          function=P.FunctionCall(name=found.name, arguments=found.arguments))
                        yield chunk(i, P.ChunkDelta(tool_calls=[{"index": k, **call.model_dump()}]))
                    if out.finished:
                        yield chunk(i, P.ChunkDelta(), finish="tool_calls" if parser.num_calls else out.finish_reason)
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
        num_prompts = 1 if isinstance(req.prompt, str) or not req.prompt or isinstance(req.prompt[0], int) \
            else len(req.prompt)
        most = server.max_num_seqs + server.config.max_queue
        if num_prompts * req.n > most:
            raise APIError(400, f"{num_prompts} prompts x n={req.n} is {num_prompts * req.n} answers, more than the "
                                f"{most} this server takes at once; send the prompts in several requests",
                           param="prompt")
        prompts = await self.prompt_ids(req)
        grammar = await request_grammar(server, req)
        want_logprobs = req.logprobs is not None
        asked = req.max_new_tokens(req.max_tokens)
        params = []
        for prompt_ids in prompts:  # each prompt its own room in the context
            max_tokens = server.max_tokens_for(len(prompt_ids), asked, "prompt")
            params += choice_params(server, req, max_tokens, want_logprobs, grammar, req.logprobs or 0)
        server.check_capacity(len(params))
        rid = P.new_id("cmpl")
        echoes = [self.tokenizer.decode(ids) if req.echo and req.suffix is None else "" for ids in prompts]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._completion_stream(rid, prompts, params, echoes, want_logprobs, include_usage,
                                                             req.return_tokens),
                                     media_type="text/event-stream")
        choices = await server.collect_prompts(request, prompts, params)
        body = P.Completion(
            id=rid, model=server.model_id,
            choices=[P.CompletionChoice(index=c.index, text=echoes[c.index // req.n] + c.text,
                                        finish_reason=c.finish_reason,
                                        logprobs=self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                                        if want_logprobs else None,
                                        tokens=c.token_ids if req.return_tokens else None)
                     for c in choices],
            usage=usage(sum(map(len, prompts)), choices, req.n),
        ).model_dump()
        if not req.return_tokens:
            for choice in body["choices"]:
                del choice["tokens"]
        return body

    async def prompt_ids(self, req: P.CompletionRequest) -> list[list[int]]:
        """The request's prompts as token ids, each checked: text (with ``suffix``: its
        fill-in-the-middle prompt) or ids in the vocabulary, none empty."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt list is empty; give a prompt (text or token ids) or a list of them",
                           param="prompt")
        where = (lambda i: "the prompt") if len(prompt) == 1 else (lambda i: f"prompt {i}")
        if req.suffix is not None:
            if not isinstance(prompt[0], str):
                raise APIError(400, "suffix needs the prompt as text", param="suffix")
            prompts = [self.fim_prompt(text, req.suffix, "suffix") for text in prompt]
        elif isinstance(prompt[0], str):
            # A prompt laid out as the model's FIM template (Continue's autocomplete) reads its
            # markers as tokens; any other stays all plain text.
            layout = getattr(self.tokenizer, "encode_fim_layout", lambda text: None)
            prompts = await asyncio.to_thread(
                lambda: [layout(text) or self.tokenizer.encode(text) for text in prompt])
        else:
            n_vocab = self.tokenizer.n_vocab
            prompts = [list(ids) for ids in prompt]
            for i, ids in enumerate(prompts):
                bad = next((t for t in ids if not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise APIError(400, f"{where(i)}: token id {bad} is outside the vocabulary of {n_vocab}",
                                   param="prompt")
        for i, ids in enumerate(prompts):
            if not ids or (isinstance(prompt[i], str) and not prompt[i]):
                raise APIError(400, f"{where(i)} is empty; give at least one token of text", param="prompt")
        return prompts

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

    async def _completion_stream(self, rid: str, prompts: list[list[int]], params: list[SamplingParams],
                                 echoes: list[str], want_logprobs: bool, include_usage: bool,
                                 return_tokens: bool = False) -> AsyncIterator[str]:
        server = self.server
        num_per_prompt = len(params) // len(prompts)
        choices = [Choice(i) for i in range(len(params))]

        def chunk(index: int, text: str, finish: str | None, logprobs=None, tokens: list[int] | None = None) -> str:
            choice = {"index": index, "text": text, "finish_reason": finish,
                      "logprobs": logprobs.model_dump() if logprobs else None}
            if return_tokens:
                choice["tokens"] = tokens or []
            return sse(P.Completion(id=rid, model=server.model_id, choices=[]).model_dump(exclude_none=True)
                       | {"choices": [choice]})

        for i in range(len(params)):
            if echoes[i // num_per_prompt]:
                yield chunk(i, echoes[i // num_per_prompt], None)
        try:
            async for i, out in server.run_prompts(prompts, params):
                server.add(choices[i], out)
                lp = (self._completion_logprobs(out.token_ids, out.logprobs or [], out.top_logprobs)
                      if want_logprobs else None)
                if out.text or out.finished or (return_tokens and out.token_ids):
                    yield chunk(i, out.text, out.finish_reason if out.finished else None, lp, out.token_ids)
        except LocalLLMError as e:
            yield stream_error(e)
            yield sse("[DONE]")
            return
        if include_usage:
            yield sse(P.Completion(id=rid, model=server.model_id, choices=[],
                                   usage=usage(sum(map(len, prompts)), choices, num_per_prompt)).model_dump())
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


def add_routes(app: FastAPI, models: ServedModels) -> None:
    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": P.ChatCompletion, "content": EVENT_STREAM}})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        if (upstream := models.upstream(body.model)) is not None:
            return await models.forwarder.forward(upstream, "/chat/completions", request)
        async with models.lease(body.model, body.keep_alive) as lease:
            return lease.hand_over(await OpenAIChat(lease.server).chat(body, request))

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": P.Completion, "content": EVENT_STREAM}})
    async def completions(body: P.CompletionRequest, request: Request):
        if (upstream := models.upstream(body.model)) is not None:
            return await models.forwarder.forward(upstream, "/completions", request)
        async with models.lease(body.model, body.keep_alive) as lease:
            return lease.hand_over(await OpenAIChat(lease.server).completions(body, request))
