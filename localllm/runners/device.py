"""What this machine offers a model: the CPU and its vector features, memory, and GPUs
(NVIDIA's driver, Apple silicon, and the devices torch sees when torch is installed).

Every probe reads the operating system's own reports (/proc on Linux, sysctl on macOS) and
answers None or an empty value where it cannot tell, never an exception. torch is optional
and imported only by ``torch_devices``.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from localllm.config import physical_cores

# x86 flags that decide llama.cpp's speed; every avx512* and amx* flag is kept as well.
_X86_FEATURES = ("avx", "avx2", "fma", "f16c", "avx_vnni")
# ARM (Linux "Features") -> the name people know.
_ARM_FEATURES = {"asimd": "neon", "asimddp": "dotprod", "asimdhp": "fp16", "i8mm": "i8mm",
                 "bf16": "bf16", "sve": "sve", "sve2": "sve2"}
_MAC_ARM_FEATURES = {"hw.optional.neon": "neon", "hw.optional.arm.FEAT_DotProd": "dotprod",
                     "hw.optional.arm.FEAT_FP16": "fp16", "hw.optional.arm.FEAT_I8MM": "i8mm",
                     "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.arm.FEAT_SME": "sme"}


@dataclass(frozen=True)
class CPUInfo:
    model: str | None
    machine: str  # x86_64, arm64, aarch64
    physical_cores: int
    logical_cores: int
    features: tuple[str, ...]  # the ones llama.cpp's kernels care about


@dataclass(frozen=True)
class MemoryInfo:
    total: int  # bytes
    available: int  # bytes a new process can take without swapping
    limit: int | None = None  # a cgroup's memory limit below the machine's, if any
    source: str = ""


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def cpu_features_from_cpuinfo(text: str) -> tuple[str, ...]:
    """The features of the first processor in /proc/cpuinfo, in the order it lists them."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags":  # x86
            return tuple(f for f in value.split()
                         if f in _X86_FEATURES or f.startswith(("avx512", "amx")))
        if key == "Features":  # ARM
            return tuple(_ARM_FEATURES[f] for f in value.split() if f in _ARM_FEATURES)
    return ()


def native_tier_of(machine: str, features: tuple[str, ...]) -> str:
    """The best tier of localllm's native kernels (native/isa.c) a CPU of these features runs,
    read from the flags alone (no library loaded): "avx512vnni", "avxvnni", "avx2" or "scalar"."""
    if machine not in ("x86_64", "AMD64", "amd64"):
        return "scalar"
    have = {f.replace("_", "") for f in features}  # Linux "avx512_vnni", macOS "avx512vnni"
    if not {"avx", "f16c", "avx2", "fma"} <= have:
        return "scalar"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"} <= have:
        return "avx512vnni"
    return "avxvnni" if "avxvnni" in have else "avx2"


def cpu_info() -> CPUInfo:
    machine = platform.machine()
    model, features = None, ()
    logical = os.cpu_count() or 1
    cores = physical_cores()
    if sys.platform.startswith("linux"):
        text = _read("/proc/cpuinfo") or ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Model") and value.strip():
                model = value.strip()
                break
        features = cpu_features_from_cpuinfo(text)
        if machine == "aarch64" and "neon" not in features:
            features = ("neon", *features)  # Advanced SIMD is part of every AArch64 CPU
    elif sys.platform == "darwin":
        model = _sysctl("machdep.cpu.brand_string")
        cores = int(_sysctl("hw.physicalcpu") or cores)
        if machine == "arm64":
            features = tuple(name for key, name in _MAC_ARM_FEATURES.items() if _sysctl(key) == "1")
        else:
            flags = " ".join(filter(None, (_sysctl("machdep.cpu.features"),
                                           _sysctl("machdep.cpu.leaf7_features")))).lower().split()
            features = tuple(f for f in dict.fromkeys(f.replace("avx1.0", "avx") for f in flags)
                             if f in _X86_FEATURES or f.startswith(("avx512", "amx")))
    return CPUInfo(model=model, machine=machine, physical_cores=cores, logical_cores=logical,
                   features=features)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes by field name."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def memory_info() -> MemoryInfo | None:
    if sys.platform.startswith("linux"):
        fields = parse_meminfo(_read("/proc/meminfo") or "")
        if "MemTotal" not in fields:
            return None
        available = fields.get("MemAvailable",
                               fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0))
        limit = _cgroup_limit()
        if limit is not None and limit < fields["MemTotal"]:
            used = int((_read("/sys/fs/cgroup/memory.current") or "0").strip() or 0)
            available = min(available, max(0, limit - used))
        else:
            limit = None
        return MemoryInfo(total=fields["MemTotal"], available=available, limit=limit, source="/proc/meminfo")
    if sys.platform == "darwin":
        total = _sysctl("hw.memsize")
        if not total:
            return None
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        page = 4096
        pages = {}
        for line in out.splitlines():
            if "page size of" in line:
                page = int("".join(c for c in line.split("page size of")[1] if c.isdigit()) or page)
            key, _, value = line.partition(":")
            if value.strip().rstrip(".").isdigit():
                pages[key.strip()] = int(value.strip().rstrip("."))
        free = sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages speculative"))
        return MemoryInfo(total=int(total), available=free * page, source="sysctl hw.memsize, vm_stat")
    return None


def _cgroup_limit() -> int | None:
    text = (_read("/sys/fs/cgroup/memory.max") or "").strip()  # cgroup v2
    return int(text) if text.isdigit() else None


def has_nvidia_driver() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists()


def nvidia_gpus() -> list[dict] | None:
    """The GPUs nvidia-smi lists (name, memory in bytes), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.stdout.splitlines():
        fields = [f.strip() for f in line.rsplit(",", 2)]  # MiB; a name may hold commas
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            gpus.append({"name": fields[0], "memory_total": int(fields[1]) << 20,
                         "memory_free": int(fields[2]) << 20})
    return gpus


def is_apple_silicon() -> bool:
    """True on an Apple-silicon Mac, also for a Python running under Rosetta."""
    return sys.platform == "darwin" and (platform.machine() == "arm64" or is_rosetta())


def is_rosetta() -> bool:
    return sys.platform == "darwin" and _sysctl("sysctl.proc_translated") == "1"


def torch_devices() -> dict:
    """The GPUs torch sees: {"installed": False} without torch; CUDA devices with names and
    memory (bytes), and whether MPS is available."""
    if importlib.util.find_spec("torch") is None:
        return {"installed": False}
    try:
        import torch
    except Exception as e:  # a broken torch install is reported, not fatal
        return {"installed": True, "error": f"import torch failed: {type(e).__name__}: {e}"}
    report: dict = {"installed": True, "version": torch.__version__,
                    "cuda_version": getattr(torch.version, "cuda", None), "cuda": [], "mps": False}
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                free, total = torch.cuda.mem_get_info(i)
                report["cuda"].append({"name": props.name, "memory_total": int(total), "memory_free": int(free)})
        mps = getattr(torch.backends, "mps", None)
        report["mps"] = bool(mps is not None and mps.is_available())
    except Exception as e:  # a driver that torch cannot talk to
        report["error"] = f"{type(e).__name__}: {e}"
    return report
