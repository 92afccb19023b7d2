"""--runner auto's rule (engine.choose_runner) on faked machines: the torch runner on an
NVIDIA GPU that torch can use when llama.cpp has no GPU offload and the architecture has a
model, and on a CPU whose native kernels run a leading tier and read the whole file in place;
llama.cpp otherwise, each with the reason it gives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from localllm.engine import engine  # noqa: E402
from localllm.engine.engine import AutoProbe, choose_runner  # noqa: E402
from localllm.runners import device  # noqa: E402

GPU = "NVIDIA GeForce RTX 4060 Laptop GPU"


def test_no_gpu_and_no_native_kernels_is_llama_cpp():
    assert choose_runner("qwen2", AutoProbe(None, False, False, None)) == (
        "llamacpp", "llama.cpp on the CPU: this install lacks the torch runner's native kernels or PyTorch "
                    "(`localllm doctor` says which; the kernels build with localllm where a C compiler is)")


def test_a_cpu_without_the_vector_kernels_is_llama_cpp():
    assert choose_runner("qwen2", AutoProbe(None, False, False, "scalar")) == (
        "llamacpp", "llama.cpp on the CPU: the torch runner leads it only with its vector kernels (AVX2 and up), "
                    "and this CPU's are scalar")


@pytest.mark.parametrize("tier", ["avx2", "avxvnni", "avx512vnni"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_a_vector_tier_and_a_file_read_in_place_is_the_torch_runner(arch, tier):
    assert choose_runner(arch, AutoProbe(None, False, False, tier), []) == (
        "torch", f"the torch runner on the CPU: its {tier} kernels read every tensor of this file in place "
                 "(exact seeds and drafting, prefix hits that give the cold answer)")


def test_avx512_vnni_with_a_format_it_would_convert_is_llama_cpp():
    assert choose_runner("qwen2", AutoProbe(None, False, False, "avx512vnni"), ["F16", "Q2_K"]) == (
        "llamacpp", "llama.cpp on the CPU: the torch runner's kernels do not read this file's F16, Q2_K "
                    "matrices in their own blocks")


@pytest.mark.parametrize("arch", ["phi3", "bert", None])
def test_avx512_vnni_and_an_architecture_without_a_torch_model_is_llama_cpp(arch):
    assert choose_runner(arch, AutoProbe(None, False, False, "avx512vnni"), []) == (
        "llamacpp", f"llama.cpp on the CPU: the torch runner has no model for the {arch!r} architecture")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_a_gpu_and_a_cpu_only_llama_cpp_is_the_torch_runner(arch):
    name, why = choose_runner(arch, AutoProbe(GPU, True, False))
    assert name == "torch"
    assert why == f"the torch runner on {GPU} (decode steps as CUDA graphs): this llama.cpp has no GPU offload"


def test_without_triton_the_torch_runner_says_it_has_no_graphs():
    name, why = choose_runner("qwen2", AutoProbe(GPU, False, False))
    assert name == "torch" and "without CUDA graphs: Triton is not installed" in why


def test_a_llama_cpp_with_gpu_offload_keeps_the_model():
    assert choose_runner("qwen2", AutoProbe(GPU, True, True, "avx512vnni")) == (
        "llamacpp", f"llama.cpp on {GPU}: this llama.cpp offloads to the GPU")


@pytest.mark.parametrize("arch", ["phi3", "bert", None])
def test_an_architecture_without_a_torch_model_stays_on_llama_cpp_and_says_how_to_get_the_gpu(arch):
    name, why = choose_runner(arch, AutoProbe(GPU, True, False))
    assert name == "llamacpp"
    assert why == (f"llama.cpp on the CPU: the torch runner has no model for the {arch!r} architecture and this "
                   "llama.cpp has no GPU offload; `localllm doctor` prints how to rebuild it with CUDA")


LINUX_FLAGS = {
    "scalar": "fpu sse sse2 ssse3 sse4_1 sse4_2",
    "avx2": "sse4_2 avx f16c fma avx2 bmi2",
    "avxvnni": "sse4_2 avx f16c fma avx2 avx_vnni",
    "avx512vnni": "avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx_vnni",
}


@pytest.mark.parametrize("tier", list(LINUX_FLAGS))
def test_the_tier_from_the_flags_is_what_the_kernels_pick(tier):
    features = device.cpu_features_from_cpuinfo(f"flags\t\t: {LINUX_FLAGS[tier]}\n")
    assert device.native_tier_of("x86_64", features) == tier


def test_avx512_without_vnni_is_avx2_and_arm_is_scalar():
    features = device.cpu_features_from_cpuinfo("flags : avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl\n")
    assert device.native_tier_of("x86_64", features) == "avx2"
    assert device.native_tier_of("aarch64", ("neon", "dotprod")) == "scalar"


def test_the_rules_formats_are_what_the_kernels_read_in_place():
    from localllm.runners.torch import native

    assert engine.CPU_IN_PLACE == set(native.BLOCK_TYPES) | set(native.K_TYPES)
    assert engine.CPU_IN_PLACE_EMBEDDING == set(native.BLOCK_TYPES)


def test_the_probe_agrees_with_the_kernels_on_this_cpu():
    from localllm.runners.torch import native

    if native.library() is None:
        assert engine.cpu_tier() is None or native.why_unavailable()
    else:
        assert engine.cpu_tier() == native.isa()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_file_of_float_matrices_is_not_read_in_blocks(dtype, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", dtype=dtype)
    assert engine.formats_not_in_place(path) == [dtype.upper()]


@pytest.mark.model
def test_both_test_models_are_read_in_place(qwen_path, gemma_path):
    assert engine.formats_not_in_place(qwen_path) == []
    assert engine.formats_not_in_place(gemma_path) == []


@pytest.mark.parametrize("probe", [AutoProbe(None, False, False, "avx512vnni"), AutoProbe(GPU, True, False)])
def test_a_split_model_stays_on_llama_cpp_where_torch_would_lead(probe):
    assert choose_runner("qwen2", probe, [], split_count=3) == (
        "llamacpp", "llama.cpp: the torch runner does not read a model split into 3 files")
    assert choose_runner("qwen2", AutoProbe(None, False, False, "scalar"), [], split_count=3)[1].endswith(
        "and this CPU's are scalar")
