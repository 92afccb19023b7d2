"""`localllm doctor` run as a subprocess with its own LOCALLLM_HOME: every line that is
deterministic on this machine is checked against what the operating system and the model
files say, read here independently of localllm."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from localllm import __version__
from localllm.commands import doctor as doctor_module
from localllm.config import physical_cores
from localllm.store import InstalledModel, ModelStore

TIMEOUT_S = 120
GIB = 2**30
IS_LINUX = sys.platform.startswith("linux")
HAS_GPU = (shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists()
           or sys.platform == "darwin")


def doctor(home: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "localllm.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**os.environ, "LOCALLLM_HOME": str(home)})
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc


def meminfo() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields


def expected_cpu_features() -> list[str]:
    """The first processor's x86 flags that matter to llama.cpp, in /proc/cpuinfo's order."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return [f for f in line.split(":", 1)[1].split()
                    if f in ("avx", "avx2", "fma", "f16c", "avx_vnni") or f.startswith(("avx512", "amx"))]
    return []


def install(home: Path, *models: InstalledModel) -> None:
    store = ModelStore(home / "data" / "models.json")  # paths.models_manifest() under LOCALLLM_HOME
    for model in models:
        store.add(model)


@pytest.mark.skipif(not IS_LINUX, reason="reads /proc")
def test_text_report_without_models(tmp_path):
    out = doctor(tmp_path).stdout
    lines = out.splitlines()
    assert lines[0] == f"localllm {__version__} doctor"
    assert f"  python: {sys.version.split()[0]} (CPython) {sys.executable}" in lines
    assert f"  cores: {physical_cores()} physical, {os.cpu_count()} logical" in lines
    features = expected_cpu_features()
    if features:
        assert f"  cpu features: {' '.join(features)}" in lines
    cores = physical_cores()
    threads = (f"  threads: chosen per step from the machine's load, 1–{cores} "
               f"({cores} physical core{'s' if cores > 1 else ''}); --threads N fixes them")
    assert lines[lines.index(threads) - 1].startswith("  cpu features: ")
    total = meminfo()["MemTotal"]
    ram = next(line for line in lines if line.startswith("  ram: "))
    assert re.fullmatch(rf"  ram: {total / GIB:.1f} GiB total, \d+\.\d GiB available", ram), ram
    assert "  torch: not installed" in lines or any(line.startswith("  torch: ") for line in lines)
    import importlib.util

    from localllm.commands.doctor import NATIVE_ALL, NATIVE_NO_K, _tier

    built = importlib.util.find_spec("localllm._native") is not None
    if built and importlib.util.find_spec("torch") is not None:
        from localllm.runners.torch import native

        want = NATIVE_ALL if native.vector_loops() else NATIVE_NO_K
        tier = _tier({"isa": native.isa(), "isa_detected": native.isa_detected()})
        assert f"  torch runner's native kernels: {want}; tier {tier}" in lines
    else:
        assert ("  torch runner's native kernels: built" in lines) == built
    assert "  llama-cpp-python: 0.3.36" in lines
    if not HAS_GPU:
        assert "  nvidia driver: no" in lines
        assert "  apple silicon: no" in lines
        assert "  GPU offload: no" in lines
        assert "  backends: CPU" in lines
        assert re.search(r"^  device 0: CPU \(.*\), CPU, \d+\.\d GiB free of \d+\.\d GiB$", out, re.M)
    assert lines[lines.index("Models (the KV cache a start without --ctx gets: free memory - weights - "
                             "headroom, up to the model's trained context)") + 1] == "  no models installed"
    assert lines[-2:] == ["Advice", "  - no models installed; `localllm pull qwen2.5-coder:0.5b` installs a small one"]


@pytest.mark.skipif(not IS_LINUX, reason="reads /proc")
def test_json_report_without_models(tmp_path):
    before = meminfo()
    report = json.loads(doctor(tmp_path, "--json").stdout)
    after = meminfo()
    assert report["localllm"] == __version__
    assert report["python"]["executable"] == sys.executable
    cpu = report["cpu"]
    assert cpu["features"] == expected_cpu_features()
    assert (cpu["physical_cores"], cpu["logical_cores"]) == (physical_cores(), os.cpu_count())
    memory = report["memory"]
    assert memory["total"] == before["MemTotal"] == after["MemTotal"]
    assert memory["source"] == "/proc/meminfo"
    if memory["limit"] is None:  # no cgroup limit: MemAvailable itself, read in between
        slack = 256 * 2**20
        low, high = sorted((before["MemAvailable"], after["MemAvailable"]))
        assert low - slack <= memory["available"] <= high + slack
    assert 0 < memory["available"] <= memory["total"]
    llama = report["llama_cpp"]
    assert llama["version"] == "0.3.36"
    assert "CPU" in llama["backends"]
    assert any(d["type"] == "CPU" for d in llama["devices"])
    assert llama["system_info"].startswith("CPU : ")
    assert report["defaults"] == {"max_num_seqs": 16, "headroom_base": 512 * 2**20, "headroom_share": 0.05,
                                  "threads": {"adaptive": True, "min": 1, "max": physical_cores()}}
    assert report["models"] == []
    if not HAS_GPU:
        assert llama["gpu_offload"] is False
        assert report["gpus"]["nvidia_driver"] is False
        assert report["gpus"]["apple_silicon"] is False
        assert report["advice"] == ["no models installed; `localllm pull qwen2.5-coder:0.5b` installs a small one"]


def _auto_on_this_cpu(path) -> tuple[str, str]:
    """What --runner auto gives ``path`` on this CPU, by engine.choose_runner (the doctor must agree)."""
    from localllm.engine import engine
    from localllm.gguf import read_info

    probe = engine.AutoProbe(None, False, False, engine.cpu_tier())
    return engine.choose_runner(read_info(path).architecture, probe, engine.formats_not_in_place(path))


@pytest.mark.model
@pytest.mark.skipif(not IS_LINUX, reason="reads /proc")
def test_estimates_for_installed_models(tmp_path, qwen_path):
    # The pinned file's KV bytes per token at f16 (2 x 24 layers x 2 KV heads x 64 x 2 bytes)
    # and tensor bytes, as the `gguf` package's own reader gives them (it takes 6 s to parse
    # the vocabulary, so they are written here; scripts/test_models.py pins the file's sha256).
    kv, weights = 2 * 24 * 2 * 64 * 2, 485_452_288
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 16)
    install(tmp_path,
            InstalledModel(name="qwen2.5-coder:0.5b", files=[str(qwen_path)], source="local"),
            InstalledModel(name="gone", files=[str(tmp_path / "gone.gguf")], source="local"),
            InstalledModel(name="junk", files=[str(junk)], source="local"))

    lines = doctor(tmp_path).stdout.splitlines()
    i = lines.index(f"  qwen2.5-coder:0.5b: {qwen_path}")
    assert lines[i + 1] == "    model: qwen2 Q4_K_M, 630,167,424 parameters, trained context 32768"
    runner, why = _auto_on_this_cpu(qwen_path)
    if not HAS_GPU:
        assert lines[i + 2] == f"    runner: {runner} on CPU ({why})"
    assert lines[i + 3] == "    weights: 485,452,288 bytes (463.0 MiB)"
    # llama.cpp's Q8_0 stores 32 values in 34 bytes: 24 layers x 2 KV heads x 128 values x 34 / 32;
    # the torch runner's int8 values and a float16 scale per token and KV head (6,144 + 192).
    q8 = "6,528" if runner == "llamacpp" else "6,336"
    assert lines[i + 4] == f"    KV cache: bytes per token: 12,288 at f16, {q8} at q8_0"
    # Memory here is far above the model's needs: the trained context is the limit.
    assert re.fullmatch(r"    --kv-dtype f16: 32,768 tokens \(384 MiB, f16\): 8 conversations of 4k, "
                        r"or 1 of 32k \(limited by the model's trained context; \d+\.\d GiB available (RAM|VRAM)\)",
                        lines[i + 5]), lines[i + 5]
    q8_pool = "204 MiB" if runner == "llamacpp" else "198 MiB"
    assert re.fullmatch(rf"    --kv-dtype q8_0: 32,768 tokens \({q8_pool}, q8_0\): 8 conversations of 4k, "
                        r"or 1 of 32k \(limited by the model's trained context; .*\)", lines[i + 6]), lines[i + 6]
    assert lines[lines.index(f"  gone: {tmp_path / 'gone.gguf'}") + 1] == (
        f"    error: its file {tmp_path / 'gone.gguf'} is gone; `localllm rm gone` forgets it")
    assert lines[lines.index(f"  junk: {junk}") + 1] == (
        f"    error: {junk} is not a valid GGUF file: it claims 18446744073709551615 key-value pairs, more than "
        "its 24 bytes could hold; download it again or convert the model again")

    report = json.loads(doctor(tmp_path, "--json").stdout)
    assert [m["name"] for m in report["models"]] == ["gone", "junk", "qwen2.5-coder:0.5b"]
    qwen = report["models"][2]
    assert {k: qwen[k] for k in ("architecture", "file_type", "parameters", "trained_context", "file_bytes",
                                 "weights_bytes", "kv_bytes_per_token", "runner")} == {
        "architecture": "qwen2", "file_type": "Q4_K_M", "parameters": 630_167_424, "trained_context": 32768,
        "file_bytes": qwen_path.stat().st_size, "weights_bytes": weights, "kv_bytes_per_token": kv,
        "runner": runner if not HAS_GPU else qwen["runner"]}
    budget = qwen["memory_available"]
    if qwen["memory_kind"] == "RAM":
        assert budget == report["memory"]["available"]
    assert qwen["kv_pool"]["f16"] == {
        "tokens": 32768, "kv_bytes_per_token": kv, "kv_bytes": 32768 * kv, "limited_by": "the model's trained context",
        "summary": "32,768 tokens (384 MiB, f16): 8 conversations of 4k, or 1 of 32k"}
    assert qwen["kv_pool"]["q8_0"]["kv_bytes_per_token"] == (6528 if qwen["runner"] == "llamacpp" else 6336)


def test_reinstall_commands():
    assert doctor_module.reinstall_command("-DGGML_CUDA=on", False, "llama-cpp-python==0.3.36", "/venv/bin/python") == (
        'CMAKE_ARGS="-DGGML_CUDA=on" /venv/bin/python -m pip install --force-reinstall --no-cache-dir '
        "llama-cpp-python==0.3.36")
    assert doctor_module.reinstall_command("-DGGML_METAL=on", True, "llama-cpp-python==0.3.36", "/x/python") == (
        'CMAKE_ARGS="-DGGML_METAL=on" pipx runpip localllm install --force-reinstall --no-cache-dir '
        "llama-cpp-python==0.3.36")


def test_gpu_without_offload_gets_the_rebuild_command(tmp_path, monkeypatch):
    """An NVIDIA driver and Apple silicon, with the CPU-only llama.cpp installed here."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    monkeypatch.setattr(doctor_module.device, "has_nvidia_driver", lambda: True)
    monkeypatch.setattr(doctor_module.device, "is_apple_silicon", lambda: True)
    monkeypatch.setattr(doctor_module, "_llama_report", lambda: {
        "version": "0.3.36", "gpu_offload": False, "max_devices": 1, "system_info": "CPU : AVX2 = 1",
        "backends": ["CPU"], "devices": [], "note": None})
    report = doctor_module.collect()
    python = sys.executable
    torch_line, cuda, metal = report["advice"][:3]
    installed = report["gpus"]["torch"].get("installed")  # (the test extras have torch, without CUDA here)
    assert torch_line == ("an NVIDIA GPU is present and no PyTorch here can use it: install PyTorch (its Linux "
                          f"wheels carry CUDA): {python} -m pip install {'--force-reinstall ' if installed else ''}"
                          "torch gguf safetensors; --runner auto then runs Qwen2, Llama and Gemma 3 models on the "
                          "GPU through the torch runner, with no CUDA toolkit")
    assert cuda.startswith("an NVIDIA GPU is present but this llama.cpp has no GPU offload; rebuild it with CUDA: "
                           f'CMAKE_ARGS="-DGGML_CUDA=on" {python} -m pip install --force-reinstall '
                           "--no-cache-dir llama-cpp-python==0.3.36")
    assert metal == ("Apple silicon is present but this llama.cpp has no GPU offload; rebuild it with Metal: "
                     f'CMAKE_ARGS="-DGGML_METAL=on" {python} -m pip install --force-reinstall '
                     "--no-cache-dir llama-cpp-python==0.3.36")
    text = doctor_module.render(report)
    assert "  nvidia driver: yes\n" in text and "  apple silicon: yes" in text
    assert f"  - {cuda}\n" in text and text.endswith(f"  - {metal}\n  - {report['advice'][3]}\n")


def test_broken_llama_cpp_is_reported_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))

    def broken():
        raise OSError("libllama.so: cannot open shared object file")

    monkeypatch.setattr(doctor_module, "_llama_report", broken)
    report = doctor_module.collect()
    assert report["llama_cpp"] == {"error": "OSError: libllama.so: cannot open shared object file"}
    assert report["advice"][0] == (
        "llama.cpp cannot be loaded (OSError: libllama.so: cannot open shared object file); reinstall it: "
        f"{sys.executable} -m pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36")
    assert "llama.cpp\n  cannot be loaded: OSError: libllama.so: cannot open shared object file\n" in (
        doctor_module.render(report))
