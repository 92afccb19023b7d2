"""--runner auto's rule (engine.choose_runner) on faked machines: the torch runner on an
NVIDIA GPU that torch can use when llama.cpp has no GPU offload and the architecture has a
model; llama.cpp otherwise, each with the reason it gives."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from localllm.engine.engine import AutoProbe, choose_runner  # noqa: E402

GPU = "NVIDIA GeForce RTX 4060 Laptop GPU"


def test_no_gpu_is_llama_cpp():
    assert choose_runner("qwen2", AutoProbe(None, False, False)) == (
        "llamacpp", "llama.cpp: no NVIDIA GPU that torch can use")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_a_gpu_and_a_cpu_only_llama_cpp_is_the_torch_runner(arch):
    name, why = choose_runner(arch, AutoProbe(GPU, True, False))
    assert name == "torch"
    assert why == f"the torch runner on {GPU} (decode steps as CUDA graphs): this llama.cpp has no GPU offload"


def test_without_triton_the_torch_runner_says_it_has_no_graphs():
    name, why = choose_runner("qwen2", AutoProbe(GPU, False, False))
    assert name == "torch" and "without CUDA graphs: Triton is not installed" in why


def test_a_llama_cpp_with_gpu_offload_keeps_the_model():
    assert choose_runner("qwen2", AutoProbe(GPU, True, True)) == (
        "llamacpp", f"llama.cpp on {GPU}: this llama.cpp offloads to the GPU")


@pytest.mark.parametrize("arch", ["phi3", "bert", None])
def test_an_architecture_without_a_torch_model_stays_on_llama_cpp_and_says_how_to_get_the_gpu(arch):
    name, why = choose_runner(arch, AutoProbe(GPU, True, False))
    assert name == "llamacpp"
    assert why == (f"llama.cpp on the CPU: the torch runner has no model for the {arch!r} architecture and this "
                   "llama.cpp has no GPU offload; `localllm doctor` prints how to rebuild it with CUDA")
