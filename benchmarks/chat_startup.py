"""How fast `localllm chat` opens in a real terminal (tmux): from starting the process to the
first painted screen, and to the model loaded ("ready" in the status bar). Also `localllm --help`.

    .venv/bin/python benchmarks/chat_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import machine, median, model_path

LOCALLLM = Path(sys.executable).parent / "localllm"


def tmux(socket: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True).stdout


def one_run(model: Path) -> tuple[float, float]:
    socket = f"bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX", "TMUX_PANE")}
        env.update(XDG_DATA_HOME=tmp, XDG_CACHE_HOME=tmp, TERM="xterm-256color")
        start = time.perf_counter()
        subprocess.run(["tmux", "-L", socket, "-f", "/dev/null", "new-session", "-d", "-x", "140", "-y", "40",
                        f"{LOCALLLM} chat {model}"], env=env, check=True)
        painted = ready = None
        try:
            while ready is None and time.perf_counter() - start < 60:
                screen = tmux(socket, "capture-pane", "-p")
                now = time.perf_counter() - start
                if painted is None and "Chats" in screen:
                    painted = now
                if "· ready" in screen:
                    ready = now
                time.sleep(0.01)
        finally:
            tmux(socket, "kill-server")
    return painted, ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    model = model_path()
    print(f"machine: {machine()}; Qwen2.5-Coder-0.5B; tmux 140x40")
    helps = []
    for _ in range(args.runs):
        t = time.perf_counter()
        subprocess.run([str(LOCALLLM), "--help"], capture_output=True, check=True)
        helps.append(time.perf_counter() - t)
    painted, ready = [], []
    for i in range(args.runs):
        p, r = one_run(model)
        painted.append(p)
        ready.append(r)
        print(f"run {i + 1}: first screen {p:.2f} s, model ready {r:.2f} s")
    print(f"median: `localllm --help` {median(helps):.2f} s; chat first screen {median(painted):.2f} s, "
          f"model ready {median(ready):.2f} s")


if __name__ == "__main__":
    main()
