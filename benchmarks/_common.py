"""What every benchmark prints next to its figures: the machine, the threads, the date."""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import test_models  # noqa: E402


def model_path(name: str = "qwen2.5-coder-0.5b") -> Path:
    return test_models.ensure(name, test_models.default_dest())


def machine() -> str:
    cpu, flags = platform.processor() or "unknown CPU", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16") if f in have]
                break
    except OSError:
        pass
    import os

    return f"{cpu} ({os.cpu_count()} CPUs; {' '.join(flags)}), {datetime.date.today().isoformat()}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def llama_without_amx() -> None:
    """llama-cpp-python's own Llama on a build with ggml's AMX kernels crashes at its first
    matmul, as the runner would (localllm/runners/llamacpp.py, amx_compiled_in): give it the
    runner's way around them, its model parameters with the extra buffers off."""
    import llama_cpp.llama_cpp as llama_cpp  # the module llama_cpp.Llama calls

    from localllm.runners.llamacpp import amx_compiled_in

    if amx_compiled_in() and not getattr(llama_cpp, "_localllm_no_amx", False):
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
        llama_cpp._localllm_no_amx = True
