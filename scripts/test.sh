#!/usr/bin/env bash
# The test command: installs localllm and its test needs into .venv, assembles the real
# GGUF test models (sha256-checked, cached in ~/.cache/localllm-test-models), runs pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -q` (`--full`: the heavy cases at
# full size, docs/testing.md); the 25 slowest cases are listed at the end of every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
# llama-cpp-python builds llama.cpp from source the first time (minutes); pip caches the wheel.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/python scripts/test_models.py
# The chat app's end-to-end test drives it in a real terminal: tmux (Debian's package).
if ! command -v tmux >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q tmux >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q tmux >/dev/null 2>&1) || true
fi
export LOCALLLM_REQUIRE_MODELS=1
set +e
.venv/bin/python -m pytest "${@:--q}" --durations=25
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
