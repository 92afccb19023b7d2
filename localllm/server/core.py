"""The one request path under every protocol of `localllm serve`: admission (the model's name,
the context, the queue), the chat prompt (template, tools), grammars, sampling parameters,
generation with cancellation when the client leaves, tool-call parsing and usage. A protocol
module (openai_chat, anthropic_messages) only turns its own request shape into these calls and
their results into its own response shape and event stream.

Every request is its own stream in the engine, so clients share each engine step and none
waits for another to finish. A client that goes away has its request aborted (its blocks
come back at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from localllm.chat_template import TemplateLimitError
from localllm.config import ServerConfig
from localllm.engine import constraint
from localllm.engine.engine import AsyncEngine, RequestOutput
from localllm.engine.request import SamplingParams
from localllm.errors import NoChatTemplateError, ParameterError, TemplateError, UsageError
from localllm.reasoning import ReasoningMarkers, markers_for, reasoning_markers
from localllm.server.errors import APIError
from localllm.server.metrics import ServerMetrics
from localllm.tool_calls import ToolCallParser, family_for, parse_tool_calls

# Sampling values a door may pass through, by SamplingParams' names.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")


def sse(obj, event: str | None = None) -> str:
    """One server-sent event; ``event`` names it (Anthropic's streams name every event)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class Choice:
    """One generation stream of a request, as it accumulates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None
    metrics: object = None
    first_token_time: float | None = None  # time.perf_counter() when the first token came
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (known with the first token)

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else self.cached_tokens


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from an answer: its id, the function's name, the arguments as JSON text."""

    id: str
    name: str
    arguments: str


class Server:
    def __init__(self, engine: AsyncEngine, model_path: Path, config: ServerConfig, n_ctx_train: int | None = None,
                 name: str | None = None, metrics: ServerMetrics | None = None):
        """One loaded model's request path; ``name`` is what responses call it (default: the
        file's stem; which names reach it is server/models.py's); ``metrics`` may be shared by
        the models of one server."""
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.n_ctx_train = n_ctx_train
        self.max_num_seqs = engine.engine.config.scheduler.max_num_seqs
        self.config = config
        self.model_id = name or Path(model_path).stem
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.num_in_flight = 0
        # Whether the model's chat template thinks (a <think> block before the answer).
        self.template_thinks = reasoning_markers(getattr(self.tokenizer, "template_source", None)) is not None
        # How the model writes a tool call: its chat template's family (localllm/tool_calls.py).
        self.tool_family = family_for(getattr(self.tokenizer, "template_source", None))

    # -- admission ------------------------------------------------------------------------

    def check_capacity(self, n: int) -> None:
        if self.num_in_flight + n > self.max_num_seqs + self.config.max_queue:
            raise APIError(503, f"the server is busy: {self.num_in_flight} requests in flight; retry shortly",
                           type_="server_error", code="server_busy", headers={"Retry-After": "1"})

    def max_tokens_for(self, num_prompt: int, asked: int | None, param: str) -> int:
        room = self.max_model_len - num_prompt
        if asked is None:
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt is {num_prompt} tokens, which leaves no room for a completion. Please reduce "
                    "the length of the prompt.", param="messages", code="context_length_exceeded")
            asked = room
        if num_prompt + asked > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + asked} tokens ({num_prompt} in the prompt, {asked} for the "
                f"completion). Please reduce the length of the prompt or the completion.",
                param=param, code="context_length_exceeded")
        return asked

    def sampling_params(self, *, n: int = 1, seed: int | None = None, **kwargs) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i uses seed + i so the n differ.
        ``kwargs`` are SamplingParams' own; a sampling value of None keeps the engine's default."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in SAMPLING_KEYS}
        try:
            params = [SamplingParams(seed=None if seed is None else seed + i, **kwargs) for i in range(n)]
            params[0].check_vocab(self.tokenizer.n_vocab)
        except ParameterError as e:
            raise APIError(400, str(e), param=e.param) from None
        except UsageError as e:
            raise APIError(400, str(e)) from None
        return params

    # -- prompts and grammars -------------------------------------------------------------

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None, thinking: bool = True,
                          template_vars: dict | None = None) -> list[int]:
        """The chat through the model's template, tokenized so no message forges a control token.
        ``thinking`` False asks a thinking template to skip its reasoning (Qwen3's
        enable_thinking); ``template_vars`` are a request's own template variables (vLLM's and
        llama-server's chat_template_kwargs)."""
        template_vars = dict(template_vars or {})
        if not thinking:
            template_vars["enable_thinking"] = False
        try:
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, True, tools,
                                           template_vars or None)
        except TemplateLimitError as e:  # the model's template is broken or hostile: not the request's fault
            raise APIError(500, str(e), type_="server_error", code="chat_template_error") from None
        except NoChatTemplateError as e:
            raise APIError(400, f"{e}, or send a plain prompt to /v1/completions", param="messages") from None
        except (TemplateError, UsageError) as e:
            raise APIError(400, str(e), param="messages") from None

    def reasoning_for(self, prompt_ids: list[int]) -> ReasoningMarkers | None:
        """How this prompt's answer marks its reasoning, or None when the template does not think."""
        return markers_for(self.tokenizer, prompt_ids) if self.template_thinks else None

    async def tool_grammar(self, tools: list[dict], name: str | None, param: str = "tool_choice") -> str:
        """The grammar of an answer that must call a tool (``name``, or any of ``tools``), its
        arguments held to the tool's parameters schema."""
        if name is not None and name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names '{name}', which is not among the tools", param=param)
        return await self.checked_grammar(lambda: constraint.tool_call_grammar(tools, name), "tools")

    async def json_grammar(self, schema: dict | None, param: str) -> str:
        """The grammar of a JSON answer: any object (``schema`` None), or one that ``schema`` allows."""
        return await self.checked_grammar(lambda: constraint.json_grammar(schema), param)

    async def checked_grammar(self, make: Callable[[], str], param: str) -> str:
        """The grammar ``make`` builds, compiled now against the model's vocabulary, so that a
        bad one (a schema llguidance cannot read or enforce, one no answer satisfies, a grammar
        or regex that does not parse) is a 400 naming ``param`` before any answer starts."""
        try:
            grammar = make()
            await self.engine.check_grammar(grammar)
        except UsageError as e:
            raise APIError(400, str(e), param=param) from None
        return grammar

    def split_tool_calls(self, text: str, tools: list[dict] | None, finish: str | None,
                         new_id: Callable[[], str]) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished answer; the reason is "tool_calls"
        when it called one, and each call's id is new_id()."""
        if not tools:
            return text, [], finish
        content, calls = parse_tool_calls(text, {t["function"]["name"] for t in tools}, self.tool_family)
        if not calls:
            return text, [], finish
        return content or None, [ToolCall(new_id(), c.name, c.arguments) for c in calls], "tool_calls"

    def tool_call_parser(self, tools: list[dict]) -> ToolCallParser:
        """The reader of a streamed answer's calls to ``tools`` (as split_tool_calls reads them)."""
        return ToolCallParser({t["function"]["name"] for t in tools}, self.tool_family)

    # -- generation -----------------------------------------------------------------------

    def run_choices(self, prompt_ids: list[int],
                    params: list[SamplingParams]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Stream (choice index, output) for n choices of one prompt (run_prompts)."""
        return self.run_prompts([prompt_ids], params)

    async def run_prompts(self, prompts: list[list[int]], params: list[SamplingParams],
                          cut: set[int] | frozenset[int] = frozenset()) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Stream (choice index, output) for the n = len(params) // len(prompts) choices of each
        prompt, numbered as OpenAI numbers them: choice p * n + j is prompt p's j-th. All run
        at once, sharing the engine's steps; a prompt's first choice runs alone until its
        prompt is computed, so the others find its KV blocks and share them. Leaving the
        stream early aborts every choice; a choice whose index the caller puts in ``cut`` is
        aborted at its next output."""
        n = len(params) // len(prompts)
        queue: asyncio.Queue = asyncio.Queue()
        prefilled = [asyncio.Event() for _ in prompts]
        done = object()

        async def run(index: int) -> None:
            prompt = index // n
            try:
                if index % n:
                    await prefilled[prompt].wait()
                async with contextlib.aclosing(self.engine.generate(prompts[prompt], params[index])) as outs:
                    async for out in outs:
                        prefilled[prompt].set()
                        if index in cut:
                            break  # closing the engine's stream aborts the request
                        await queue.put((index, out))
            except BaseException as e:  # delivered to the consumer, which re-raises it
                prefilled[prompt].set()
                await queue.put((index, e))
            finally:
                await queue.put((index, done))

        self.num_in_flight += len(params)
        tasks = [asyncio.create_task(run(i)) for i in range(len(params))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            self.num_in_flight -= len(params)
            for t in tasks:
                t.cancel()  # a client that left: each stream's exit aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, request: Request, prompt_ids: list[int], params: list[SamplingParams],
                      until: Callable[[Choice], bool] | None = None) -> list[Choice]:
        """Every choice whole (a response that is not streamed); the client leaving aborts them.
        ``until`` may end one answer early (it is aborted, its finish reason "length")."""
        return await self.collect_prompts(request, [prompt_ids], params, until)

    async def collect_prompts(self, request: Request, prompts: list[list[int]], params: list[SamplingParams],
                              until: Callable[[Choice], bool] | None = None) -> list[Choice]:
        """collect for the choices of several prompts, numbered as run_prompts numbers them."""
        choices = [Choice(i) for i in range(len(params))]

        cut: set[int] = set()

        async def consume() -> None:
            async for i, out in self.run_prompts(prompts, params, cut):
                if i in cut:
                    continue
                self.add(choices[i], out)
                if until is not None and choices[i].finish_reason is None and until(choices[i]):
                    choices[i].finish_reason = "length"
                    cut.add(i)  # run_prompts aborts it at its next output
                    if len(cut) == len(choices):
                        break  # leaving the stream aborts them all at once

        async def client_left() -> None:
            # A blocking receive, not request.is_disconnected(): behind a BaseHTTPMiddleware
            # layer (the key check was one) its zero-timeout poll never saw the disconnect, and
            # a dropped request ran on to max_tokens; a receive sees it whatever wraps the app.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.create_task(consume())
        listener = asyncio.create_task(client_left())
        try:
            await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and listener.exception() is None:
                task.cancel()  # the client left: the streams' exits abort the requests
            elif not task.done():  # the listener failed, which says nothing of the client
                await asyncio.wait({task})
        finally:
            listener.cancel()
            if not task.done():  # this handler itself was cancelled: the generation goes too
                task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        return choices

    def add(self, choice: Choice, out: RequestOutput) -> None:
        if out.token_ids and choice.first_token_time is None:
            choice.first_token_time = time.perf_counter()
        if out.num_cached_tokens is not None:
            choice.cached_tokens = out.num_cached_tokens
        choice.text += out.text
        choice.token_ids += out.token_ids
        if out.logprobs:
            choice.logprobs += out.logprobs
        if out.top_logprobs:
            choice.top_logprobs += out.top_logprobs
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_sequence = out.stop_sequence
            choice.metrics = out.metrics
            self.metrics.observe(out.metrics)
