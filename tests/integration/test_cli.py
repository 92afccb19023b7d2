"""The `localllm` command run as a subprocess on the real GGUF files: what it prints, and how
it fails (exit 2, one `localllm: error:` line on stderr, never a traceback)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from localllm import __version__
from localllm.config import physical_cores

TIMEOUT_S = 180
FIB = "def fibonacci(n):"
FIB_ARGS = ["--temperature", "0", "--max-tokens", "40", "--threads", "2"]
TIMING_LINE = re.compile(
    r"TTFT \d+ ms · prompt (\d+) tokens \((\d+) cached\) at \d+\.\d tokens/s · "
    r"(\d+) generated at \d+\.\d tokens/s · finish (\w+)"
)


def localllm(*args, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "localllm.cli", *map(str, args)],
        input=stdin if stdin is not None else b"", capture_output=True, timeout=TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    return proc


def gpu_computes_steps() -> bool:
    """Whether this llama.cpp build puts the model's layers on a GPU (then no CPU threads are chosen)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def assert_usage_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    """Exit 2, exactly one `localllm: error:` line naming the problem, nothing else."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("localllm: error: "), lines[0]
    assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def fib_json(qwen_path) -> dict:
    """The greedy 40-token completion of FIB, as --json gives it."""
    proc = localllm("run", qwen_path, FIB, *FIB_ARGS, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_version_and_help():
    proc = localllm("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"localllm {__version__}\n" == "localllm 0.1.0\n"
    proc = localllm("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "run" in proc.stdout and "bench" in proc.stdout


def test_run_streams_text_and_one_timing_line(qwen_path, fib_json):
    proc = localllm("run", qwen_path, FIB, *FIB_ARGS)
    assert proc.returncode == 0, proc.stderr
    assert "return" in proc.stdout
    # The streamed text is exactly the --json text, then one newline.
    assert proc.stdout == fib_json["text"] + "\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    m = TIMING_LINE.fullmatch(lines[0])
    assert m, lines[0]
    assert m.groups() == ("4", "0", "40", "length")


def test_run_json(fib_json):
    assert set(fib_json) == {"text", "finish_reason", "prompt_tokens", "cached_tokens",
                             "disk_cached_tokens", "completion_tokens", "timings"}
    assert "return" in fib_json["text"]
    assert fib_json["finish_reason"] == "length"
    assert (fib_json["prompt_tokens"], fib_json["cached_tokens"], fib_json["completion_tokens"]) == (4, 0, 40)
    timings = fib_json["timings"]
    assert set(timings) == {"load_s", "ttft_s", "tpot_s", "prompt_tokens_per_s", "decode_tokens_per_s"}
    assert all(isinstance(v, float) and v > 0 for v in timings.values()), timings


def test_run_json_is_one_object_and_nothing_on_stderr(qwen_path):
    proc = localllm("run", qwen_path, FIB, "--temperature", "0", "--max-tokens", "4", "--threads", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.endswith("}\n") and proc.stdout.count("\n") == 1
    assert json.loads(proc.stdout)["completion_tokens"] == 4


def test_run_stop_string_ends_before_it(qwen_path, fib_json):
    proc = localllm("run", qwen_path, FIB, *FIB_ARGS, "--json", "--stop", "return")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "stop"
    full = fib_json["text"]
    assert out["text"] == full[:full.index("return")]
    assert "return" not in out["text"]


def test_run_reads_prompt_from_stdin(qwen_path, fib_json):
    proc = localllm("run", qwen_path, "-", *FIB_ARGS, "--json", stdin=FIB.encode())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_tokens"] == 4
    assert out["text"] == fib_json["text"]


def test_run_chat(qwen_path):
    proc = localllm("run", qwen_path, "What is the capital of France? Answer in one sentence.",
                    "--chat", "--temperature", "0", "--max-tokens", "40", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    m = TIMING_LINE.fullmatch(proc.stderr.rstrip("\n"))
    assert m and m.group(4) == "stop", proc.stderr


def test_run_on_a_terminal_that_cannot_encode_the_text(qwen_path):
    """An ASCII-only stdout gets "?" for the characters it lacks, not a UnicodeEncodeError."""
    proc = localllm("run", qwen_path, "Write the French word for coffee, with its accent.", "--chat",
                    "--temperature", "0", "--max-tokens", "20", "--threads", "2",
                    env={"PYTHONIOENCODING": "ascii"})
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0
    assert "caf?" in proc.stdout  # greedy: "Le café", the é replaced


def test_bench_json(qwen_path):
    proc = localllm("bench", qwen_path, "--concurrency", "1,2", "--prompt-tokens", "32",
                    "--max-tokens", "8", "--json", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["threads"] == 2 and report["batch_tokens"] == 256 and report["speculative"] is True
    # --threads 2 fixes them: every step ran on 2 (none on a GPU build, where the GPU computes them).
    threads = 0 if gpu_computes_steps() else 2
    assert report["threads_adaptive"] is False
    results = report["results"]
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        c = r["concurrency"]
        assert r["requests"] == c
        assert r["output_tokens"] == c * 8
        assert r["preemptions"] == 0
        for key in ("wall_s", "output_tokens_per_s", "decode_tokens_per_s",
                    "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s"):
            assert r[key] > 0, (key, r)
        assert r["ttft_p95_s"] >= r["ttft_p50_s"] and r["tpot_p95_s"] >= r["tpot_p50_s"]
        assert 0 <= r["draft_accepted"] <= r["draft_proposed"]
        assert (r["threads_decode"], r["threads_prefill"]) == (threads, threads)


def test_bench_reports_the_threads_the_engine_chose(qwen_path):
    """Without --threads the engine chooses them per step, from 1 to the physical cores."""
    if gpu_computes_steps():
        pytest.skip("this llama.cpp offloads every layer to the GPU: the engine chooses no CPU threads")
    proc = localllm("bench", qwen_path, "--concurrency", "1", "--prompt-tokens", "32", "--max-tokens", "8",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["threads"] == physical_cores() and report["threads_adaptive"] is True
    [r] = report["results"]
    assert 1 <= r["threads_decode"] <= report["threads"] and 1 <= r["threads_prefill"] <= report["threads"]


def test_bench_no_spec_proposes_no_drafts(qwen_path):
    proc = localllm("bench", qwen_path, "--concurrency", "1", "--prompt-tokens", "32", "--max-tokens", "8",
                    "--json", "--threads", "2", "--no-spec")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["speculative"] is False
    assert [(r["draft_proposed"], r["draft_accepted"]) for r in report["results"]] == [(0, 0)]


# -- failures: exit 2, one line that names the problem -----------------------------------


def test_missing_model_file(tmp_path):
    assert_usage_error(localllm("run", tmp_path / "nope.gguf", "hi"), "does not exist")


def test_model_path_is_a_directory(tmp_path):
    assert_usage_error(localllm("run", tmp_path, "hi"), "is not a file")


def test_model_file_is_not_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model\n" * 100)
    assert_usage_error(localllm("run", junk, "hi"), "is not a GGUF file")


def test_truncated_gguf_is_refused_without_crashing(tmp_path, gemma_path):
    truncated = tmp_path / "truncated.gguf"
    with open(gemma_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    # It must be refused (by the GGUF check before llama.cpp sees it); a crash (negative
    # return code, abort) fails here.
    assert_usage_error(localllm("run", truncated, "hi", "--threads", "2"), "truncated")


def test_prompt_longer_than_context(qwen_path):
    prompt = " ".join(f"word{i}" for i in range(700))  # about 2,700 tokens
    proc = localllm("run", qwen_path, prompt, "--ctx", "512", "--threads", "2")
    assert_usage_error(proc, "raise --ctx")
    assert "the context holds 512" in proc.stderr


def test_chat_on_a_model_without_template(gemma_path):
    proc = localllm("run", gemma_path, "hi", "--chat", "--threads", "2")
    assert_usage_error(proc, "has no chat template")
    assert "run without --chat" in proc.stderr  # the CLI's own hint (the server gives its own)


def test_stdin_that_is_not_utf8(qwen_path):
    # PYTHONIOENCODING=utf-8 makes sys.stdin strict, as a UTF-8 desktop locale does.
    proc = localllm("run", qwen_path, "-", "--max-tokens", "2", stdin=b"def f\xff(",
                    env={"PYTHONIOENCODING": "utf-8"})
    assert_usage_error(proc, "standard input is not UTF-8")


@pytest.mark.parametrize("args, needle", [
    (["run", "M", "hi", "--max-tokens", "-3"], "--max-tokens: -3 must be 1 or more"),
    (["run", "M", "hi", "--temperature", "abc"], "--temperature: 'abc' is not a number"),
    (["run", "M", "hi", "--top-p", "5"], "top_p=5.0 is invalid"),
    (["run", "M", "hi", "--ctx", "0"], "--ctx: 0 must be 1 or more"),
    (["run", "M", "hi", "--stop", ""], "stop strings must be non-empty"),
    (["run", "M", "hi", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["bench", "M", "--concurrency", "1,x"], "--concurrency: '1,x' is not a comma-separated list"),
    (["bench", "M", "--concurrency", "0"], "must list whole numbers of 1 or more"),
])
def test_nonsense_options(qwen_path, args, needle):
    args = [qwen_path if a == "M" else a for a in args]
    assert_usage_error(localllm(*args), needle)
