#!/usr/bin/env bash
# The torch runner's checks on an NVIDIA GPU, in one run (docs/testing.md, "On a GPU"): the
# CUDA-marked and Triton tests, the engine's integration tests on the torch runner, and
# benchmarks/torch_cuda.py. Each step has a time limit and its log goes to $OUT/<step>.log;
# a failed step does not stop the next.
#
#   OUT=/tmp/cuda_check bash scripts/cuda_check.sh
#
# The test models come from LOCALLLM_TEST_MODELS (scripts/test_models.py). On a machine that
# cannot fetch them, scripts/shape_alike_gguf.py builds files of the same shape there (same
# metadata and vocabulary, same tensor types and shapes, random weights): what they show is
# speed and the engine's bookkeeping, not what the real weights answer, so the tests that
# check an answer's content are expected to fail on them.
set -uo pipefail
OUT=${OUT:-/tmp/cuda_check}
PY=${PYTHON:-python3}
MODELS=${LOCALLLM_TEST_MODELS:-$HOME/.cache/localllm-test-models}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name (limit ${limit} s)"
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - start)) s"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
}

step gpu 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  lscpu | grep -E 'Model name|^CPU\(s\)'; $PY -c 'import torch, triton; print(\"torch\", torch.__version__,
  \"triton\", triton.__version__, torch.cuda.get_device_name())'"
step kernels "${KERNELS_S:-120}" "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_triton_attention.py \
  tests/integration/test_torch_graphs.py tests/integration/test_torch_cuda_forward.py tests/unit/test_runner_choice.py \
  tests/unit/test_torch_devices.py tests/unit/test_torch_attention.py
# shellcheck disable=SC2086  # BENCH_ARGS is words
TAIL=45 step bench "${BENCH_S:-240}" "$PY" benchmarks/torch_cuda.py --file "$MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
  ${BENCH_ARGS:---rounds 3} --json "$OUT/bench.json"
TAIL=12 step bench_gemma "${BENCH_S:-240}" "$PY" benchmarks/torch_cuda.py --file "$MODELS/gemma-3-270m-q4_k_m.gguf" \
  ${BENCH_ARGS:---rounds 3} --json "$OUT/bench_gemma.json"
TAIL=30 step engine "${ENGINE_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -rf -k "torch and not sampling_with_drafts" \
  tests/integration/test_engine.py tests/integration/test_prefix_store_engine.py tests/integration/test_spec_decode_engine.py
