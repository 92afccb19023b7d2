"""Schemathesis against a real `localllm serve` (Qwen2.5-Coder-0.5B): every operation in the
server's own /openapi.json, with valid and invalid bodies, paths and headers. No response may
be a 5xx, every error must be its protocol's error object, every body strict JSON (no NaN), and the
server must be whole afterwards: alive, idle, nothing in its log. Errors under /v1/messages are
Anthropic's object, and its streams Anthropic's named events.

Two passes. The first fuzzes the schema as served: the GET and DELETE routes with valid and
invalid data alike, the POST routes with invalid bodies only, which are refused with a 4xx
before the engine. The second narrows the schema to
bodies the server accepts (every message with text, a non-empty prompt, no logit_bias) and
generates only valid ones, so most of its cases run the model, with tools, grammars,
logprobs, stop strings, streaming and n.

Generation is kept cheap so the test fits in CI: `model` is pinned to the served model in the
schema (else nearly every body is a 404 that never reaches the engine), and a body's
max_tokens is cut to MAX_TOKENS and its n to MAX_N before it is sent.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

pytestmark = pytest.mark.model

MAX_TOKENS = 4
MAX_N = 2
MAX_EXAMPLES = 30  # per operation and phase; the coverage phase adds its own boundary cases
# Valid bodies run the model (prefill, grammars, n up to 2): 3-7 s each measured on the shared
# 2-core machine under load, so fewer of them.
MAX_VALID_EXAMPLES = 15
ERROR_KEYS = {"message", "type", "param", "code"}

num_cases: dict[tuple[str, str], int] = {}  # (pass, operation) -> cases sent
statuses: dict[tuple[str, int], int] = {}  # (pass, status) -> responses


def _served_spec(live_server) -> dict:
    """The server's /openapi.json with `model` pinned to the one model it serves."""
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    spec = httpx.get(f"{live_server.url}/openapi.json", headers=headers, timeout=30).json()
    model_id, embedder_id = [m["id"] for m in httpx.get(f"{live_server.base_url}/models", headers=headers,
                                                          timeout=30).json()["data"]]
    pinned = {"type": "string", "enum": [model_id]}
    for name in ("MessagesRequest", "CountTokensRequest"):  # Anthropic's model is required
        spec["components"]["schemas"][name]["properties"]["model"] = pinned
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):  # OpenAI's: absent or null too
        spec["components"]["schemas"][name]["properties"]["model"] = {"anyOf": [pinned, {"type": "null"}]}
    for name in ("InfillRequest", "TokenizeRequest", "DetokenizeRequest"):  # optional, as llama-server has it
        spec["components"]["schemas"][name]["properties"].pop("model")
    spec["components"]["schemas"]["EmbeddingRequest"]["properties"]["model"] = {
        "anyOf": [{"type": "string", "enum": [embedder_id]}, {"type": "null"}]}
    served.setdefault("spec", spec)
    return spec


served: dict = {}  # the schema as served (model pinned), for body_is_valid


def body_is_valid(case) -> bool:
    """Whether the body sent satisfies the served schema after all. Schemathesis marks a case
    negative when it generates it and does not check again after shrinking, which can drop
    the only invalid part (schemathesis issue #4332: a body of valid parts reported as
    "Schema-violating request accepted"); such a case is held to the other checks only."""
    import jsonschema

    if case.body is None or isinstance(case.body, (bytes, str)) or "spec" not in served:
        return False
    spec = served["spec"]
    operation = spec["paths"][case.operation.path][case.operation.method.lower()]
    body_schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body_schema is None:
        return False
    validator = jsonschema.Draft202012Validator({**body_schema, "components": spec["components"]})
    return validator.is_valid(case.body)


def _load(spec: dict, live_server):
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=live_server.url, headers={"Authorization": f"Bearer {live_server.api_key}"})
    return schema


@pytest.fixture(scope="module")
def fuzz_schema(live_server):
    return _load(_served_spec(live_server), live_server)


@pytest.fixture(scope="module")
def invalid_schema(live_server):
    """The schema as served, for invalid data only: the POST routes' valid bodies run the model,
    and the narrowed pass below sends those (as the full schema's, they cost a minute of CI)."""
    schema = _load(_served_spec(live_server), live_server)
    schema.config.generation.update(modes=["negative"])
    return schema


@pytest.fixture(scope="module")
def valid_schema(live_server):
    """The request schemas narrowed to what the server accepts beyond the schema's word."""
    spec = _served_spec(live_server)
    schemas = spec["components"]["schemas"]
    text = {"type": "string", "minLength": 1}
    schemas["ChatMessage"]["properties"] = {"role": {"enum": ["system", "user", "assistant"]}, "content": text}
    schemas["ChatMessage"]["required"] = ["role", "content"]
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 4
    schemas["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        text, {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 150_000},
               "minItems": 1, "maxItems": 64}]}
    # Responses: text input, no tools, schemas or chained ids (the chat door covers grammars;
    # an unknown previous_response_id is a 404 the first pass sends).
    schemas["ResponsesRequest"]["properties"]["input"] = text
    for key in ("tools", "tool_choice", "text", "previous_response_id"):
        schemas["ResponsesRequest"]["properties"].pop(key)
    schemas["EmbeddingRequest"]["properties"]["input"] = {"anyOf": [text, {"type": "array", "items": text,
                                                                           "minItems": 1, "maxItems": 8}]}
    # Anthropic's door: text turns, no tools or schemas (their grammars are the chat door's too).
    schemas["Message"]["properties"] = {"role": {"enum": ["user", "assistant"]}, "content": text}
    for name in ("MessagesRequest", "CountTokensRequest"):
        for key in ("tools", "tool_choice", "output_config"):
            schemas[name]["properties"].pop(key)
        schemas[name]["properties"]["messages"]["maxItems"] = 4
    schemas["MessagesRequest"]["properties"]["stop_sequences"] = {"anyOf": [
        {"type": "array", "items": text, "maxItems": 4}, {"type": "null"}]}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[name]["properties"].pop("logit_bias")
        schemas[name]["properties"]["stop"] = {"anyOf": [text, {"type": "array", "items": text, "maxItems": 4},
                                                         {"type": "null"}]}
    schema = _load(spec, live_server)
    schema.config.generation.update(modes=["positive"])
    schema.config.phases.coverage.enabled = False  # its boundary cases are the first pass's work
    return schema


schema = schemathesis.pytest.from_fixture("fuzz_schema").exclude(method="POST")
invalid = schemathesis.pytest.from_fixture("invalid_schema").include(method="POST")
valid = schemathesis.pytest.from_fixture("valid_schema").include(method="POST")


def _strict_json(text: str):
    def no_constant(name: str):
        raise AssertionError(f"the server sent {name}, which is not JSON")
    return json.loads(text, parse_constant=no_constant)


def _check_anthropic_error(body) -> None:
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert set(error) == {"type", "message"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error


def _check_error(body) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def _sse_lines(text: str) -> list[str]:
    """An event stream's lines, split where SSE splits them (CR, LF, CRLF): not str.splitlines,
    which also splits at U+2028, U+0085 and others that JSON leaves raw inside a string."""
    return re.split(r"\r\n|\r|\n", text)


def _cap(body, path: str):
    """Cut a generated body's cost: its answer's length to MAX_TOKENS (absent or null: set; the
    server would fill the context; n_predict -1 too), n to MAX_N."""
    if not isinstance(body, dict) or path in ("/tokenize", "/detokenize"):
        return body
    def over(value, cap: int) -> bool:
        return type(value) in (int, float) and value > cap

    if path == "/infill":
        if body.get("n_predict") in (None, -1, 0) or over(body.get("n_predict"), MAX_TOKENS):
            body["n_predict"] = MAX_TOKENS
        return body
    if path == "/v1/responses":
        if body.get("max_output_tokens") is None or over(body.get("max_output_tokens"), MAX_TOKENS):
            body["max_output_tokens"] = MAX_TOKENS
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if over(body.get(key), MAX_TOKENS):
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # absent or null: the server would fill the context
    if body.get("n_predict") == -1 or over(body.get("n_predict"), MAX_TOKENS):  # llama-server's max_tokens
        body["n_predict"] = MAX_TOKENS
    if over(body.get("n"), MAX_N):
        body["n"] = MAX_N
    return body


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
def test_no_5xx_and_every_error_in_its_protocols_shape(case):
    _call_and_check(case, "any")


@invalid.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
def test_invalid_bodies_are_4xx_in_their_protocols_shape(case):
    _call_and_check(case, "invalid")


@valid.parametrize()
@settings(max_examples=MAX_VALID_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
def test_valid_bodies_run_the_model_without_5xx(case):
    _call_and_check(case, "valid")


def _call_and_check(case, run: str) -> None:
    if case.body is not None and not isinstance(case.body, (bytes, str)):
        case.body = _cap(case.body, case.operation.path)
    response = case.call(timeout=120)
    num_cases[(run, case.operation.label)] = num_cases.get((run, case.operation.label), 0) + 1
    statuses[(run, response.status_code)] = statuses.get((run, response.status_code), 0) + 1
    assert response.status_code < 500, response.text
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    anthropic = case.operation.path.startswith("/v1/messages")
    if response.status_code >= 400:
        assert content_type == "application/json", content_type
        (_check_anthropic_error if anthropic else _check_error)(_strict_json(response.text))
    elif content_type.startswith("text/event-stream") and anthropic:
        lines = [line for line in _sse_lines(response.text) if line]
        events = [_strict_json(line[len("data: "):]) for line in lines[1::2]]
        assert [line[len("event: "):] for line in lines[0::2]] == [e["type"] for e in events], response.text[-500:]
        assert events[-1]["type"] in ("message_stop", "error"), response.text[-500:]
    elif content_type.startswith("text/event-stream") and case.operation.path == "/infill":
        events = [_strict_json(line[len("data: "):]) for line in _sse_lines(response.text) if line.startswith("data: ")]
        assert events and (events[-1].get("stop") is True or "error" in events[-1]), response.text[-500:]
    elif content_type.startswith("text/event-stream") and case.operation.path == "/v1/responses":
        lines = [line for line in _sse_lines(response.text) if line]
        events = [_strict_json(line[len("data: "):]) for line in lines[1::2]]
        assert [line[len("event: "):] for line in lines[0::2]] == [e["type"] for e in events], response.text[-500:]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in _sse_lines(response.text) if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            payload = _strict_json(event)
            if "error" in payload:
                _check_error(payload)
    elif content_type.startswith("application/json"):
        _strict_json(response.text)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    if not (run == "invalid" and response.status_code < 400 and body_is_valid(case)):
        checks.append(negative_data_rejection)
    case.validate_response(response, checks=checks)


def test_the_server_is_whole_after_the_fuzzing(live_server):
    """Runs after the fuzz cases (pytest keeps file order): alive, idle, a clean log."""
    assert sum(num_cases.values()) > 0, "no fuzz case ran"
    print(f"\nfuzz cases: {sum(num_cases.values())}; by pass and operation: {dict(sorted(num_cases.items()))}"
          f"\nby pass and status: {dict(sorted(statuses.items()))}")
    assert live_server.process.poll() is None, live_server.log()[-4000:]
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    deadline = time.monotonic() + 10
    while True:
        lines = httpx.get(f"{live_server.url}/metrics", headers=headers, timeout=30).text.splitlines()
        if "localllm_kv_blocks_used 0.0" in lines and "localllm_requests_running 0.0" in lines:
            break
        assert time.monotonic() < deadline, "the server still holds KV blocks or sequences after the fuzzing"
        time.sleep(0.1)
    assert httpx.get(f"{live_server.url}/health", timeout=30).json()["status"] == "ok"
    log = live_server.log()
    assert "Traceback" not in log and "ERROR" not in log and "RuntimeWarning" not in log, log[-4000:]
