"""What the chat app talks to: the in-process engine, or any OpenAI-compatible server.

Both stream a turn as ``Chunk``s; ``Figures`` turns those into the status bar's live
numbers. Neither imports textual, so both are tested without a screen.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from localllm.config import EngineConfig
from localllm.errors import ContextOverflowError, EngineError, LocalLLMError, ModelLoadError, UsageError
from localllm.reasoning import Answer, markers_for


@dataclass(frozen=True)
class GenerationSettings:
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 2048

    def __post_init__(self) -> None:
        # The engine's own validation, so the settings screen and the CLI say the same thing.
        from localllm.engine.request import SamplingParams

        SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p)


@dataclass
class Chunk:
    """Part of an answer: new text (and a thinking model's reasoning, apart) and how many tokens
    it took; at the end, why it ended."""

    text: str = ""
    num_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_draft_proposed: int | None = None  # prompt-lookup drafts of the answer (local, at the end)
    num_draft_accepted: int | None = None
    reasoning: str = ""  # a thinking model's reasoning, never in text


@dataclass
class Figures:
    """The current answer's numbers, updated chunk by chunk."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    num_draft_proposed: int | None = None  # None: not known (a remote server)
    num_draft_accepted: int | None = None

    def observe(self, chunk: Chunk, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if chunk.num_tokens:
            if self.first is None:
                self.first = now
            self.last = now
            self.num_tokens += chunk.num_tokens
        if chunk.prompt_tokens is not None:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens
        if chunk.num_draft_proposed is not None:
            self.num_draft_proposed, self.num_draft_accepted = chunk.num_draft_proposed, chunk.num_draft_accepted
        if chunk.finished:
            self.finish_reason = chunk.finish_reason

    @property
    def ttft(self) -> float | None:
        return self.first - self.start if self.first is not None else None

    @property
    def tokens_per_s(self) -> float | None:
        if self.first is None or self.last is None or self.num_tokens < 2 or self.last <= self.first:
            return None
        return (self.num_tokens - 1) / (self.last - self.first)

    def to_dict(self) -> dict:
        """What is saved with the answer, so a resumed conversation shows its figures."""
        return {"ttft": self.ttft, "tokens_per_s": self.tokens_per_s, "tokens": self.num_tokens,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "finish_reason": self.finish_reason, "draft_proposed": self.num_draft_proposed,
                "draft_accepted": self.num_draft_accepted}


@dataclass(frozen=True)
class EngineFigures:
    kv_used: int  # tokens of KV cache in use by running requests
    kv_cached: int  # tokens of KV cache named by a prefix hash (reusable by a later request)
    kv_total: int
    num_running: int
    num_waiting: int
    threads: int = 0  # CPU threads decode steps run on now; 0: not known, or a GPU computes them
    threads_max: int = 0  # the most they may run on


class ChatBackend(Protocol):
    model_name: str
    n_ctx: int | None  # None: the server does not say
    pool_summary: str | None  # the KV cache's size as people read it; None: not known here
    shares_cpu: bool  # the model runs on this machine's cores, beside the screen
    # (optional) runner: the runner that computes the answers ("torch", "llamacpp"), and
    # runner_reason: why `--runner auto` took it; None where not known (a remote server)

    def load(self) -> None:
        """Blocking: load the model or reach the server. Raises LocalLLMError."""

    def count_tokens(self, messages: list[dict]) -> int | None:
        """The prompt length of these messages, or None when it cannot be known here."""

    def stream(self, messages: list[dict], settings: GenerationSettings) -> AsyncIterator[Chunk]:
        """The answer to ``messages``; raises ContextOverflowError when it cannot fit."""

    def stop(self) -> None:
        """End the answer being streamed now; its stream ends with finish_reason "abort"."""

    async def warm(self, messages: list[dict]) -> None:
        """Compute the KV of ``messages`` ahead of the next turn (a resumed conversation)."""

    async def engine_figures(self) -> EngineFigures | None:
        ...

    def close(self) -> None:
        ...


def reserve_for(settings: GenerationSettings, n_ctx: int) -> int:
    """Room an answer needs beyond the prompt before a turn is worth sending."""
    return min(settings.max_tokens, max(n_ctx // 8, 16))


class LocalModels:
    """The chat app's models in this process, held by the same ModelManager as `localllm serve`
    holds its own: the model in use is leased; one switched away from stays loaded (5 minutes
    idle, or until another needs its memory), so switching back to it is instant."""

    def __init__(self, base: EngineConfig):
        from localllm.manager import ModelManager
        from localllm.memory import SharedMemory

        self.memory = SharedMemory(base)
        self.manager = ModelManager([], self._load, self.memory.need_bytes, self.memory.free_bytes)
        self.memory.manager = self.manager

    def entry(self, path: Path):
        from localllm.manager import ModelEntry

        return self.manager.add(ModelEntry(str(Path(path).resolve()), Path(path)))

    def _load(self, entry) -> "_LoadedEngine":
        from localllm.engine.engine import AsyncEngine, LLMEngine

        return _LoadedEngine(AsyncEngine(LLMEngine(self.memory.config_for(entry))))

    async def close(self) -> None:
        await self.manager.close()


class _LoadedEngine:
    def __init__(self, engine):
        self.engine = engine

    def close(self) -> None:
        self.engine.shutdown()
        self.engine.engine.close()


class LocalBackend:
    """The engine in this process (AsyncEngine on its own thread): loaded by the backend itself,
    or, with ``models`` (LocalModels), leased from the app's model manager (``aload``/``aclose``)."""

    def __init__(self, config: EngineConfig, models: LocalModels | None = None):
        self.config = config
        self._models = models
        self._lease = None
        self.model_name = Path(config.model_path).name
        self.n_ctx: int | None = None
        self.pool_summary: str | None = None
        self.runner: str | None = None
        self.runner_reason: str | None = None
        self.shares_cpu = True
        self._engine = None  # AsyncEngine once loaded
        self._request_id: str | None = None

    def load(self) -> None:
        from localllm.engine.engine import AsyncEngine, LLMEngine

        engine = LLMEngine(self.config)
        self._describe(engine)
        self._engine = AsyncEngine(engine)

    def _describe(self, engine) -> None:
        """What the app shows of a loaded engine: its context, KV cache and runner."""
        self.n_ctx = engine.max_model_len
        self.pool_summary = engine.kv_pool_summary
        self.runner = engine.runner.name
        self.runner_reason = getattr(engine.runner, "chosen_because", None)

    async def aload(self) -> None:
        """Lease the model from the app's LocalModels (loading it if it is not loaded)."""
        if self._models is None:
            await asyncio.to_thread(self.load)
            return
        entry = self._models.entry(self.config.model_path)
        lease = self._models.manager.lease(entry.name)
        loaded = await lease.__aenter__()
        self._lease, self._engine = lease, loaded.engine
        self._describe(loaded.engine.engine)

    async def aclose(self) -> None:
        """Give the model back to the manager (it stays loaded while memory allows)."""
        if self._models is None:
            await asyncio.to_thread(self.close)
            return
        self.stop()
        lease, self._lease, self._engine = self._lease, None, None
        if lease is not None:
            await lease.__aexit__(None, None, None)

    @property
    def tokenizer(self):
        return self._engine.engine.tokenizer

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.tokenizer.apply_chat_template(messages))

    async def stream(self, messages: list[dict], settings: GenerationSettings) -> AsyncIterator[Chunk]:
        from localllm.engine.request import SamplingParams

        prompt_ids = self.tokenizer.apply_chat_template(messages)
        if len(prompt_ids) + reserve_for(settings, self.n_ctx) > self.n_ctx:
            raise ContextOverflowError(
                f"the conversation is {len(prompt_ids):,} tokens and the context holds {self.n_ctx:,}")
        params = SamplingParams(max_tokens=min(settings.max_tokens, self.n_ctx - len(prompt_ids)),
                                temperature=settings.temperature, top_p=settings.top_p)
        self._request_id = rid = f"chat-{uuid.uuid4().hex[:8]}"
        answer = Answer(markers_for(self.tokenizer, prompt_ids))
        first = True
        try:
            async for out in self._engine.generate(prompt_ids, params, request_id=rid):
                reasoning, text = answer.feed(out.text)
                if out.finished:
                    more = answer.finish()
                    reasoning, text = reasoning + more[0], text + more[1]
                chunk = Chunk(text=text, reasoning=reasoning, num_tokens=len(out.token_ids), finished=out.finished,
                              finish_reason=out.finish_reason)
                if first or out.finished:
                    chunk.prompt_tokens = len(prompt_ids)
                    metrics = out.metrics
                    chunk.cached_tokens = (metrics.num_cached_tokens if metrics is not None
                                           else out.num_cached_tokens)
                    first = False
                if out.metrics is not None:  # the last chunk
                    chunk.num_draft_proposed = out.metrics.num_draft_proposed
                    chunk.num_draft_accepted = out.metrics.num_draft_accepted
                yield chunk
        finally:
            self._request_id = None

    def stop(self) -> None:
        if self._request_id is not None and self._engine is not None:
            self._engine.abort(self._request_id)

    async def warm(self, messages: list[dict]) -> None:
        from localllm.engine.request import SamplingParams

        if not messages:
            return
        prompt_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        if len(prompt_ids) >= self.n_ctx:
            return
        async for _ in self._engine.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0)):
            pass

    async def engine_figures(self) -> EngineFigures | None:
        if self._engine is None:
            return None
        stats = await asyncio.wrap_future(self._engine.call(lambda e: e.stats()))
        block_size = self.config.cache.block_size
        return EngineFigures(stats.num_blocks_used * block_size, stats.num_blocks_cached * block_size,
                             stats.num_blocks_total * block_size,
                             stats.num_running, stats.num_waiting, stats.threads_decode, stats.threads_max)

    def close(self) -> None:
        if self._models is not None:
            return  # the manager owns the engine: aclose gives it back
        if self._engine is not None:
            self._engine.shutdown()
            self._engine.engine.close()
            self._engine = None


class RemoteBackend:
    """Any OpenAI-compatible server (localllm serve, llama-server, vLLM, Ollama's /v1)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0):
        base_url = base_url.rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise UsageError(f"--endpoint {base_url!r} is not an http(s) URL; "
                             "give one like http://127.0.0.1:8000/v1")
        self.base_url = base_url if base_url.endswith("/v1") else base_url + "/v1"
        self.model_name = model or ""
        self.n_ctx: int | None = None
        self.pool_summary: str | None = None
        self.shares_cpu = False
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout_s
        self._stopping: asyncio.Event | None = None

    def load(self) -> None:
        import httpx

        try:
            r = httpx.get(f"{self.base_url}/models", headers=self._headers, timeout=10)
        except httpx.HTTPError as e:
            raise ModelLoadError(f"cannot reach {self.base_url} ({e}); start the server or fix --endpoint") from None
        if r.status_code in (401, 403):
            raise ModelLoadError(f"{self.base_url} refused the API key (HTTP {r.status_code}); "
                                 "pass the server's key with --api-key")
        if r.status_code != 200:
            raise ModelLoadError(f"{self.base_url}/models answered HTTP {r.status_code}; "
                                 "is this an OpenAI-compatible /v1 URL?")
        try:
            ids = [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise ModelLoadError(f"{self.base_url}/models did not answer OpenAI's model list") from None
        if not self.model_name:
            if not ids:
                raise ModelLoadError(f"{self.base_url} serves no model; load one there first")
            self.model_name = ids[0]
        meta = next((m for m in r.json()["data"] if m.get("id") == self.model_name), {})
        n_ctx = meta.get("context_length") or meta.get("max_model_len") or (meta.get("meta") or {}).get("n_ctx_train")
        self.n_ctx = n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None

    def count_tokens(self, messages: list[dict]) -> None:
        return None

    async def stream(self, messages: list[dict], settings: GenerationSettings) -> AsyncIterator[Chunk]:
        import httpx

        body = {"model": self.model_name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": settings.temperature,
                "top_p": settings.top_p, "max_tokens": settings.max_tokens}
        self._stopping = stopping = asyncio.Event()
        finish = None
        async with httpx.AsyncClient(timeout=httpx.Timeout(self._timeout, connect=10)) as client:
            try:
                async with client.stream("POST", f"{self.base_url}/chat/completions", json=body,
                                         headers=self._headers) as r:
                    if r.status_code != 200:
                        error = _http_error(r.status_code, await r.aread())
                        if not isinstance(error, ContextOverflowError) or "max_tokens" not in body:
                            raise error
                        # Servers refuse prompt + max_tokens beyond their context, where the local
                        # engine would answer until the context is full. Ask the same way.
                        body = {k: v for k, v in body.items() if k != "max_tokens"}
                        r = await client.send(client.build_request(
                            "POST", f"{self.base_url}/chat/completions", json=body, headers=self._headers),
                            stream=True)
                        if r.status_code != 200:
                            raise _http_error(r.status_code, await r.aread())
                    try:
                        lines = r.aiter_lines()
                        while True:
                            next_line = asyncio.ensure_future(anext(lines, None))
                            stop_wait = asyncio.ensure_future(stopping.wait())
                            done, _ = await asyncio.wait({next_line, stop_wait},
                                                         return_when=asyncio.FIRST_COMPLETED)
                            if stop_wait in done:  # closing the connection makes the server abort
                                next_line.cancel()
                                yield Chunk(finished=True, finish_reason="abort")
                                return
                            stop_wait.cancel()
                            line = next_line.result()
                            if line is None:
                                break
                            chunk = _parse_event(line)
                            if chunk is None:
                                continue
                            if chunk.finish_reason is not None:
                                finish = chunk.finish_reason
                            yield chunk
                    finally:
                        await r.aclose()
            except httpx.HTTPError as e:
                raise EngineError(f"the connection to {self.base_url} failed ({e}); check the server") from None
            finally:
                self._stopping = None
        yield Chunk(finished=True, finish_reason=finish or "stop")

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def warm(self, messages: list[dict]) -> None:
        return None  # a remote server keeps (or not) its own prefix cache

    async def engine_figures(self) -> None:
        return None

    def close(self) -> None:
        pass


def _http_error(status: int, body: bytes) -> LocalLLMError:
    # OpenAI and llama-server: {"error": {"message", "code"}}; Ollama: {"error": "text"};
    # vLLM: {"message", "code"} at the top.
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    error = payload.get("error", payload) if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message, code = error["message"], error.get("code")
    elif isinstance(error, str):
        message, code = error, None
    else:
        message, code = body[:200].decode("utf-8", "replace"), None
    if code == "context_length_exceeded" or "context" in str(message).lower() and status == 400:
        return ContextOverflowError(f"the server says: {message}")
    if status in (401, 403):
        return EngineError(f"the server refused the API key (HTTP {status}); pass it with --api-key")
    return EngineError(f"the server answered HTTP {status}: {message}")


def _parse_event(line: str) -> Chunk | None:
    """One server-sent-event line of a chat stream as a Chunk; None for anything else. A usage
    event (no choices) gives the prompt figures."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        event = json.loads(data)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    if "error" in event:
        error = event["error"]
        raise EngineError(f"the server ended the answer with an error: "
                          f"{error.get('message') if isinstance(error, dict) else error}")
    chunk = Chunk()
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        # A thinking model's reasoning: llama-server's reasoning_content, vLLM's and Ollama's reasoning.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        if isinstance(reasoning, str) and reasoning:
            chunk.reasoning += reasoning
        if text or reasoning:
            chunk.text += text
            chunk.num_tokens += 1  # servers send about one token per event
        if choice.get("finish_reason"):
            chunk.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if isinstance(usage, dict):
        chunk.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        chunk.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
    return chunk
