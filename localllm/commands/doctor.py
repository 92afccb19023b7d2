"""`localllm doctor`: what this machine and this install can run, and the command that fixes
an install whose llama.cpp cannot use the GPU the machine has.

The report is one dict (``--json`` prints it as it is); the text form is rendered from it.
Memory figures are bytes. Every probe that fails is reported in its section, and the command
always exits 0: it is the command to run when something else is broken.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from localllm import __version__, paths
from localllm import memory as kv_memory
from localllm.config import SchedulerConfig, physical_cores
from localllm.errors import LocalLLMError
from localllm.runners import device

DEFAULT_SEQS = SchedulerConfig().max_num_seqs
KV_DTYPES_SHOWN = ("f16", "q8_0")  # the default, and the one that holds twice the tokens


def doctor(as_json: bool = False) -> int:
    report = collect()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report), end="")
    return 0


# -- collecting --------------------------------------------------------------------------------


def _probe(fn, *args):
    """fn's answer; a probe that fails becomes {"error": ...} in the report, never a crash."""
    try:
        return fn(*args)
    except Exception as e:  # doctor runs on broken installs: report everything, stop at nothing
        return {"error": f"{type(e).__name__}: {e}"}


def _native_report() -> dict:
    """Whether the torch runner can call its native kernels, and which block formats they read
    in place here (imports torch: only here)."""
    from localllm.runners.torch import native

    return {"usable": native.available(), "why_not": native.why_unavailable(),
            "k_quants": native.vector_loops(), "isa": native.isa(), "isa_detected": native.isa_detected()}


NATIVE_ALL = "built; Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K read in place"
NATIVE_NO_K = "built; Q4_0, Q5_0, Q8_0 read in place (Q4_K, Q5_K, Q6_K converted: the scalar tier has no vector loops)"


def _tier(use: dict) -> str:
    """The kernels' instruction-set tier, and the CPU's own where LOCALLLM_NATIVE_ISA lowered it."""
    if use["isa"] == use["isa_detected"]:
        return use["isa"]
    return f"{use['isa']} (forced by LOCALLLM_NATIVE_ISA; the CPU's best is {use['isa_detected']})"


def _llama_report() -> dict:
    from localllm.runners.llamacpp import backend_report  # imports llama_cpp: only here

    return backend_report()


def collect() -> dict:
    cpu = _probe(device.cpu_info)
    memory = _probe(device.memory_info)
    report = {
        "localllm": __version__,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.system(), "machine": platform.machine(), "description": platform.platform()},
        "cpu": asdict(cpu) if isinstance(cpu, device.CPUInfo) else cpu,
        "memory": asdict(memory) if isinstance(memory, device.MemoryInfo) else memory,
        "gpus": {
            "nvidia_driver": device.has_nvidia_driver(),
            "nvidia_smi": _probe(device.nvidia_gpus),
            "apple_silicon": device.is_apple_silicon(),
            "rosetta": device.is_rosetta(),
            "torch": _probe(device.torch_devices),
        },
        # The torch runner's C kernels (native/), built by the package build with a compiler.
        "native_kernels": importlib.util.find_spec("localllm._native") is not None,
        "native_kernel_use": _probe(_native_report),
        "llama_cpp": _probe(_llama_report),
        "defaults": {"max_num_seqs": DEFAULT_SEQS, "headroom_base": kv_memory.HEADROOM_BASE,
                     "headroom_share": kv_memory.HEADROOM_SHARE,
                     # Where the CPU computes the steps, the engine chooses each one's threads
                     # (engine/threads.py) in this range, unless --threads N fixes them.
                     "threads": {"adaptive": True, "min": 1, "max": physical_cores()}},
    }
    report["models"] = _probe(_models, report)
    report["advice"] = _advice(report)
    return report


def _ram_available(report: dict) -> int | None:
    memory = report["memory"]
    return memory.get("available") if isinstance(memory, dict) else None


def _placement(report: dict) -> tuple[str, str, int | None]:
    """Where the llama.cpp runner puts a model's layers: (device, memory kind, free bytes)."""
    llama = report["llama_cpp"]
    gpus = [d for d in llama.get("devices") or () if d["type"] in ("GPU", "IGPU")]
    if llama.get("gpu_offload") and gpus:
        names = " + ".join(f"{d['name']} ({d['description']})" for d in gpus)
        return names, "VRAM" if gpus[0]["type"] == "GPU" else "GPU memory", sum(d["memory_free"] for d in gpus)
    return "CPU", "RAM", _ram_available(report)


def _auto_runner(report: dict, arch: str | None, path, split_count: int = 1) -> tuple[str, str, bool]:
    """The runner `--runner auto` gives a model of ``arch`` at ``path`` here, why, and whether
    on the GPU (engine.choose_runner, on what this report already probed: the native kernels'
    tier as loaded, LOCALLLM_NATIVE_ISA included)."""
    from localllm.engine.engine import CPU_LEADING_TIERS, AutoProbe, choose_runner, formats_not_in_place

    torch_report, llama = report["gpus"]["torch"], report["llama_cpp"]
    gpus = torch_report.get("cuda") or [] if isinstance(torch_report, dict) else []
    cuda = gpus[0]["name"] if gpus else None
    graphs = False
    if cuda is not None:
        from localllm.runners.torch import triton_attention

        graphs = triton_attention.available()
    use = report["native_kernel_use"]
    tier = use.get("isa") if isinstance(use, dict) and use.get("usable") else None
    leads = cuda is None and tier in CPU_LEADING_TIERS and split_count == 1
    not_in_place = formats_not_in_place(path) if leads else ()
    probe = AutoProbe(cuda, graphs, bool(llama.get("gpu_offload")), tier)
    runner, why = choose_runner(arch, probe, not_in_place, split_count)
    return runner, why, runner == "torch" and cuda is not None


def _models(report: dict) -> list[dict]:
    from localllm.gguf_check import check_model
    from localllm.store import ModelStore

    entries = []
    for model in ModelStore(paths.models_manifest()).list():
        entry: dict = {"name": model.name, "path": str(model.path), "files": model.files}
        entries.append(entry)
        if not model.is_present:
            missing = next(f for f in model.files if not Path(f).is_file())
            entry["error"] = f"its file {missing} is gone; `localllm rm {model.name}` forgets it"
            continue
        try:
            info = check_model(model.path)
        except LocalLLMError as e:
            entry["error"] = str(e)
            continue
        kv = info.kv_bytes_per_token(2)
        entry.update({
            "architecture": info.architecture, "file_type": info.file_type, "parameters": info.parameters,
            "trained_context": info.context_length, "sliding_window": info.sliding_window,
            "file_bytes": info.size_bytes, "weights_bytes": info.tensor_bytes, "kv_bytes_per_token": kv,
        })
        runner, why, on_gpu = _auto_runner(report, info.architecture, model.path, info.split_count)
        entry.update({"runner": runner, "runner_why": why})
        where, kind, budget = _placement(report)
        if runner == "torch":  # on the CPU or on CUDA, never where llama.cpp offloads
            where, kind, budget = "CPU", "RAM", _ram_available(report)
        if on_gpu:
            gpu = report["gpus"]["torch"]["cuda"][0]
            where, kind, budget = f"CUDA ({gpu['name']})", "VRAM", gpu["memory_free"]
        if kind != "RAM" and budget is not None and info.tensor_bytes > budget:
            entry["note"] = f"does not fit in {where}'s free memory; the runner falls back to the CPU"
            where, kind, budget = "CPU", "RAM", _ram_available(report)
        entry.update({"device": where, "memory_kind": kind, "memory_available": budget})
        if kv is not None:
            entry["kv_pool"] = {dtype: _pool(info, dtype, runner, budget, kind) for dtype in KV_DTYPES_SHOWN}
    return entries


def _pool(info, kv_dtype: str, runner: str, budget: int | None, kind: str) -> dict:
    """The KV pool a start without --ctx gets on ``runner`` (localllm.memory's rule), or why it
    cannot start."""
    try:
        plan = kv_memory.plan(info, kv_dtype, runner, None, budget, kind)
    except LocalLLMError as e:
        return {"error": str(e)}
    return {"tokens": plan.tokens, "kv_bytes_per_token": plan.kv_bytes_per_token, "kv_bytes": plan.kv_bytes,
            "limited_by": plan.limited_by,
            "summary": kv_memory.describe_pool(plan.tokens, plan.kv_bytes, kv_dtype)}


def _llama_requirement() -> str:
    """The llama-cpp-python this localllm was installed with, pin included."""
    try:
        for req in importlib.metadata.requires("localllm") or ():
            if req.replace("_", "-").lower().startswith("llama-cpp-python"):
                return req.split(";")[0].strip()
    except importlib.metadata.PackageNotFoundError:
        pass
    return "llama-cpp-python"


def _in_pipx() -> bool:
    return (Path(sys.prefix) / "pipx_metadata.json").is_file()  # pipx writes it into each venv


def _pip_install(in_pipx: bool, python: str) -> str:
    return "pipx runpip localllm install" if in_pipx else f"{python} -m pip install"


def reinstall_command(cmake_args: str, in_pipx: bool, requirement: str, python: str) -> str:
    """The command that rebuilds llama-cpp-python with a GPU backend, for this install."""
    return (f'CMAKE_ARGS="{cmake_args}" {_pip_install(in_pipx, python)} '
            f"--force-reinstall --no-cache-dir {requirement}")


def _advice(report: dict) -> list[str]:
    llama, gpus = report["llama_cpp"], report["gpus"]
    requirement, in_pipx = _llama_requirement(), _in_pipx()
    advice = []
    if "error" in llama:
        advice.append(f"llama.cpp cannot be loaded ({llama['error']}); reinstall it: "
                      f"{_pip_install(in_pipx, sys.executable)} --force-reinstall --no-cache-dir {requirement}")
    elif not llama.get("gpu_offload"):
        if gpus["nvidia_driver"]:
            torch_report = gpus["torch"] if isinstance(gpus["torch"], dict) else {}
            if not torch_report.get("cuda"):
                how = "--force-reinstall " if torch_report.get("installed") else ""
                advice.append("an NVIDIA GPU is present and no PyTorch here can use it: install PyTorch (its Linux "
                              f"wheels carry CUDA): {_pip_install(in_pipx, sys.executable)} {how}torch gguf "
                              "safetensors; --runner auto then runs Qwen2, Llama and Gemma 3 models on the GPU "
                              "through the torch runner, with no CUDA toolkit")
            command = reinstall_command("-DGGML_CUDA=on", in_pipx, requirement, sys.executable)
            line = f"an NVIDIA GPU is present but this llama.cpp has no GPU offload; rebuild it with CUDA: {command}"
            if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
                line += " (the build needs the CUDA toolkit: nvcc is not on PATH)"
            advice.append(line)
        if gpus["apple_silicon"]:
            if gpus["rosetta"]:
                advice.append("this Python runs under Rosetta (x86_64), so llama.cpp cannot use Metal; "
                              "install localllm with an arm64 Python")
            command = reinstall_command("-DGGML_METAL=on", in_pipx, requirement, sys.executable)
            advice.append(f"Apple silicon is present but this llama.cpp has no GPU offload; rebuild it with Metal: {command}")
    if report["models"] == []:
        advice.append("no models installed; `localllm pull qwen2.5-coder:0.5b` installs a small one")
    return advice


# -- rendering ---------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def _yes(flag) -> str:
    return "yes" if flag else "no"


def _threads_line(threads: dict) -> str:
    n = threads["max"]
    cores = f"{n} physical core{'' if n == 1 else 's'}"
    return (f"  threads: chosen per step from the machine's load, {threads['min']}–{n} ({cores}); "
            "--threads N fixes them")


def render(report: dict) -> str:
    lines = [f"localllm {report['localllm']} doctor", "", "System"]
    py, plat, cpu, mem = report["python"], report["platform"], report["cpu"], report["memory"]
    lines.append(f"  python: {py['version']} ({py['implementation']}) {py['executable']}")
    lines.append(f"  platform: {plat['description']}")
    if "error" in cpu:
        lines.append(f"  cpu: unknown ({cpu['error']})")
    else:
        lines.append(f"  cpu: {cpu['model'] or 'unknown model'} ({cpu['machine']})")
        lines.append(f"  cores: {cpu['physical_cores']} physical, {cpu['logical_cores']} logical")
        lines.append(f"  cpu features: {' '.join(cpu['features']) or 'none of avx2, avx512, fma, f16c, neon'}")
    lines.append(_threads_line(report["defaults"]["threads"]))
    if mem is None or "error" in mem:
        lines.append(f"  ram: unknown{' (' + mem['error'] + ')' if mem else ''}")
    else:
        limit = f", limited to {_gib(mem['limit'])} by a cgroup" if mem["limit"] else ""
        lines.append(f"  ram: {_gib(mem['total'])} total, {_gib(mem['available'])} available{limit}")

    gpus = report["gpus"]
    lines += ["GPUs", f"  nvidia driver: {_yes(gpus['nvidia_driver'])}"]
    for i, gpu in enumerate(gpus["nvidia_smi"] if isinstance(gpus["nvidia_smi"], list) else ()):
        lines.append(f"  nvidia-smi {i}: {gpu['name']}, {_gib(gpu['memory_free'])} free of {_gib(gpu['memory_total'])}")
    lines.append(f"  apple silicon: {_yes(gpus['apple_silicon'])}{' (this Python runs under Rosetta)' if gpus['rosetta'] else ''}")
    torch = gpus["torch"]
    if not torch.get("installed"):
        lines.append("  torch: not installed")
    elif "version" not in torch:
        lines.append(f"  torch: {torch.get('error')}")
    else:
        lines.append(f"  torch: {torch['version']} (CUDA {torch['cuda_version'] or 'none'}), "
                     f"{len(torch['cuda'])} CUDA device(s), MPS {_yes(torch['mps'])}")
        for i, gpu in enumerate(torch["cuda"]):
            lines.append(f"  cuda:{i}: {gpu['name']}, {_gib(gpu['memory_free'])} free of {_gib(gpu['memory_total'])}")
        if "error" in torch:
            lines.append(f"  torch error: {torch['error']}")
    use = report.get("native_kernel_use") or {}
    if not report.get("native_kernels"):
        native = "not built (no C compiler at install: the pure-torch ones are used)"
    elif "error" in use:  # torch is not installed (nothing can call them), or LOCALLLM_NATIVE_ISA is refused
        native = "built" if use["error"].startswith(("ModuleNotFoundError", "ImportError")) else \
            f"built, not usable: {use['error'].split(': ', 1)[-1]}"
    elif not use["usable"]:
        native = f"not used: {use['why_not']}; rebuild them with `pip install -e .`"
    else:
        native = (NATIVE_ALL if use["k_quants"] else NATIVE_NO_K) + f"; tier {_tier(use)}"
    lines.append(f"  torch runner's native kernels: {native}")

    llama = report["llama_cpp"]
    lines.append("llama.cpp")
    if "error" in llama:
        lines.append(f"  cannot be loaded: {llama['error']}")
    else:
        lines.append(f"  llama-cpp-python: {llama['version']}")
        lines.append(f"  GPU offload: {_yes(llama['gpu_offload'])}")
        if llama["devices"] is None:
            lines.append(f"  backends: unknown ({llama['note']})")
        else:
            lines.append(f"  backends: {', '.join(llama['backends']) or 'none'}")
            for i, d in enumerate(llama["devices"]):
                lines.append(f"  device {i}: {d['name']} ({d['description']}), {d['type']}, "
                             f"{_gib(d['memory_free'])} free of {_gib(d['memory_total'])}")
        lines.append(f"  system info: {llama['system_info']}")

    lines += _render_models(report)
    if report["advice"]:
        lines.append("Advice")
        lines += [f"  - {line}" for line in report["advice"]]
    return "\n".join(lines) + "\n"


def _render_models(report: dict) -> list[str]:
    models = report["models"]
    lines = ["Models (the KV cache a start without --ctx gets: free memory - weights - headroom, "
             "up to the model's trained context)"]
    if isinstance(models, dict):
        lines.append(f"  cannot list them: {models['error']}")
        return lines
    if not models:
        lines.append("  no models installed")
        return lines
    for m in models:
        lines.append(f"  {m['name']}: {m['path']}")
        if "error" in m:
            lines.append(f"    error: {m['error']}")
            continue
        params = f"{m['parameters']:,} parameters"
        trained = f", trained context {m['trained_context']}" if m["trained_context"] else ""
        lines.append(f"    model: {m['architecture']} {m['file_type'] or ''}, {params}{trained}".replace(" ,", ","))
        lines.append(f"    runner: {m['runner']} on {m['device']} ({m['runner_why']})")
        if "note" in m:
            lines.append(f"    note: {m['note']}")
        lines.append(f"    weights: {_size(m['weights_bytes'])}")
        if "kv_pool" not in m:
            lines.append("    KV cache: unknown (the file does not describe its attention)")
            continue
        per_token = ", ".join(f"{pool['kv_bytes_per_token']:,} at {dtype}"
                              for dtype, pool in m["kv_pool"].items() if "tokens" in pool)
        lines.append(f"    KV cache: bytes per token: {per_token or 'unknown'}")
        if m["sliding_window"]:
            lines.append(f"    sliding window: {m['sliding_window']} tokens on some layers, so the real KV cache is smaller")
        room = (f"{_gib(m['memory_available'])} available {m['memory_kind']}" if m["memory_available"] is not None
                else f"{m['memory_kind']} size unknown")
        for dtype, pool in m["kv_pool"].items():
            if "error" in pool:
                lines.append(f"    --kv-dtype {dtype}: {pool['error']}")
            else:
                lines.append(f"    --kv-dtype {dtype}: {pool['summary']} (limited by {pool['limited_by']}; {room})")
    return lines
