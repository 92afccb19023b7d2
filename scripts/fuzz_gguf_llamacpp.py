"""Which well-formed but lying GGUF files make llama.cpp kill the process, and does
localllm's check (localllm.runners.llamacpp.check_gguf) refuse every one of them first?

Each edit of tests/gguf_mutations.py is applied to the tiny models of tests/tiny_gguf.py
and handed, in a forked child, to llama.cpp as localllm would: a vocab_only load, a full
load, a context, one decode. A child that dies by a signal (GGML_ASSERT/GGML_ABORT:
SIGABRT; a bad read: SIGSEGV) or hangs is a crash; a crash on a file the check accepted
is a finding. Prints a table and exits 1 if there is any finding.

    nice -n 19 .venv/bin/python scripts/fuzz_gguf_llamacpp.py [--arch qwen2 --arch gemma3] [--only TEXT]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import llama_cpp as L  # noqa: E402
from gguf_mutations import read_model, semantic_mutations  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

from localllm.errors import ModelLoadError  # noqa: E402
from localllm.runners.llamacpp import _init_backend, check_gguf  # noqa: E402

TIMEOUT_S = 30


def _child(path: str) -> None:
    """Runs in the forked child: what localllm asks of llama.cpp. Exit codes: 0 ran,
    3 load refused, 4 context refused, 5 decode failed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(path.encode(), params)
    if model:
        L.llama_model_free(model)
    params.vocab_only = False
    params.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), params)
    if not model:
        os._exit(3)
    cparams = L.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_threads = cparams.n_threads_batch = 1
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        os._exit(4)
    vocab = L.llama_model_get_vocab(model)
    text = b"Hello world <|im_start|> <start_of_turn>\n"
    tokens = (L.llama_token * 64)()
    n = L.llama_tokenize(vocab, text, len(text), tokens, 64, True, True)
    if n <= 0:
        os._exit(0)
    for i in range(n):  # localllm reads every piece it streams
        buf = ctypes_buf = (ctypes.c_char * 64)()
        L.llama_token_to_piece(vocab, tokens[i], ctypes_buf, 64, 0, True)
        del buf
    rc = L.llama_decode(ctx, L.llama_batch_get_one(tokens, n))
    os._exit(0 if rc == 0 else 5)


import ctypes  # noqa: E402  (used by the child)


def run_llamacpp(path: Path) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            _child(str(path))
        finally:
            os._exit(6)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "HANG"
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return f"SIG{signal.Signals(os.WTERMSIG(status)).name[3:]}"
    return {0: "ran", 3: "load refused", 4: "context refused", 5: "decode failed"}.get(
        os.WEXITSTATUS(status), f"exit {os.WEXITSTATUS(status)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=["qwen2", "llama", "gemma3"])
    ap.add_argument("--only", help="run only the edits whose label contains this text")
    ap.add_argument("--show-all", action="store_true", help="print every case, not only crashes")
    args = ap.parse_args()
    _init_backend()
    findings = crashes = total = refused = 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        for arch in args.arch or ["qwen2", "llama", "gemma3"]:
            base = read_model(write_tiny_gguf(Path(d) / f"{arch}.gguf", arch))
            for label, model in semantic_mutations(base):
                if args.only and args.only not in label:
                    continue
                path = Path(d) / "case.gguf"
                path.write_bytes(model.to_bytes())
                total += 1
                try:
                    check_gguf(path)
                    verdict = "accepted"
                except ModelLoadError as e:
                    verdict = "refused"
                    refused += 1
                    reason = str(e).split(": ", 1)[-1][:110]
                outcome = run_llamacpp(path)
                crashed = outcome.startswith("SIG") or outcome == "HANG"
                crashes += crashed
                finding = crashed and verdict == "accepted"
                findings += finding
                if finding or args.show_all or (crashed and verdict == "refused"):
                    mark = "FINDING" if finding else ""
                    print(f"{arch:7} {label[:60]:60} llama.cpp: {outcome:15} check: {verdict:8} {mark}"
                          + (f"  ({reason})" if verdict == "refused" and args.show_all else ""), flush=True)
    print(f"{total} files, {refused} refused by the check, {crashes} crash llama.cpp, "
          f"{findings} crash it although the check accepted them; {time.monotonic() - t0:.0f} s")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
