#!/usr/bin/env bash
# The install check: builds localllm's sdist and wheel, installs the wheel into a clean
# environment in a temporary folder (with pipx when it is on PATH, else a fresh venv), and
# runs `localllm --version` and `localllm doctor` from that install, away from this tree.
# Any failure stops it with a "check_install: FAILED" line. pip's cache is used as it is,
# so llama-cpp-python's wheel, built once on this machine, is not built again.
#   PYTHON=python3.12 scripts/check_install.sh    # the interpreter of the clean environment
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$SECONDS
BASE_PY=${PYTHON:-python3}
BUILD_PY=.venv/bin/python
[ -x "$BUILD_PY" ] || BUILD_PY=$BASE_PY
unset PIP_NO_CACHE_DIR PYTHONPATH

fail() {
  echo "check_install: FAILED: $*" >&2
  exit 1
}

work=$(mktemp -d "${TMPDIR:-/tmp}/localllm-check-install.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== build (sdist and wheel)"
if "$BUILD_PY" -c "import build" 2>/dev/null; then
  "$BUILD_PY" -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log" >&2; fail "python -m build"; }
else  # no `build` package: a wheel only
  "$BUILD_PY" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$root" \
    || fail "pip wheel"
fi
wheel=$(ls "$work"/dist/localllm-*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || fail "no wheel was built"
ls -l "$work"/dist | sed 1d
# The files a wheel without its package data would lack.
"$BUILD_PY" - "$wheel" <<'EOF' || fail "the wheel is incomplete"
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["localllm/cli.py", "localllm/gguf.py", "localllm/runners/llamacpp.py", "localllm/runners/device.py",
        "localllm/models.toml", "localllm/tui/chat.tcss", "localllm/py.typed",
        "localllm/data/eval.txt"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"the wheel lacks {', '.join(missing)}")
# With a C compiler here the build must have made the torch runner's native kernels.
import shutil
if (shutil.which("cc") or shutil.which("gcc")) and not any(n.startswith("localllm/_native") for n in names):
    sys.exit("the wheel lacks localllm/_native although a C compiler is here (see the build log)")
EOF

echo "== install $(basename "$wheel")"
# torch is a dependency, and an unpinned one is the CUDA build on Linux (several GB): the
# install takes the torch build the test environment holds (the CPU one there), from pip's
# cache or its find-links, as a machine without a GPU is told to in the README.
: >"$work/constraints.txt"
torch_version=$("$BUILD_PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ -n "$torch_version" ]; then
  echo "torch==$torch_version" >"$work/constraints.txt"
  echo "torch held at $torch_version (the test environment's build)"
fi
cd "$work"  # nothing below may import the source tree
if command -v pipx >/dev/null 2>&1; then
  export PIPX_HOME="$work/pipx" PIPX_BIN_DIR="$work/bin" PIPX_MAN_DIR="$work/man"
  pipx install --python "$(command -v "$BASE_PY")" --pip-args="--constraint $work/constraints.txt" "$wheel" >"$work/install.log" 2>&1 \
    || { tail -n 30 "$work/install.log" >&2; fail "pipx install"; }
  localllm=$work/bin/localllm
  installed_py=$PIPX_HOME/venvs/localllm/bin/python
  echo "installed with pipx into $PIPX_HOME"
else
  "$BASE_PY" -m venv "$work/venv" || fail "$BASE_PY -m venv"
  "$work/venv/bin/python" -m pip install --disable-pip-version-check --constraint "$work/constraints.txt" "$wheel" >"$work/install.log" 2>&1 \
    || { tail -n 30 "$work/install.log" >&2; fail "pip install of the wheel"; }
  localllm=$work/venv/bin/localllm
  installed_py=$work/venv/bin/python
  echo "installed with pip into a fresh venv ($work/venv)"
fi
[ -x "$localllm" ] || fail "the install has no localllm command"
where=$("$installed_py" -c "import localllm; print(localllm.__file__)")
case $where in
  "$work"/*) ;;
  *) fail "localllm was imported from $where, not from the install" ;;
esac

echo "== localllm --version"
version=$("$localllm" --version) || fail "localllm --version"
echo "$version"
expected=$(grep -E '^__version__ = ' "$root/localllm/__init__.py" | cut -d'"' -f2)
[ "$version" = "localllm $expected" ] || fail "localllm --version said '$version', expected 'localllm $expected'"

echo "== localllm doctor"
export LOCALLLM_HOME="$work/home"
"$localllm" doctor >"$work/doctor.txt" 2>"$work/doctor.err" || { cat "$work/doctor.txt" "$work/doctor.err" >&2; fail "localllm doctor"; }
cat "$work/doctor.txt"
[ ! -s "$work/doctor.err" ] || { cat "$work/doctor.err" >&2; fail "localllm doctor wrote to stderr"; }
grep -q '^  llama-cpp-python: ' "$work/doctor.txt" || fail "localllm doctor: llama.cpp does not load in the install"
grep -q '^  GPU offload: ' "$work/doctor.txt" || fail "localllm doctor: no GPU offload line"
# torch, gguf and the native kernels come with the install: the torch runner is there for auto.
grep -q '^  torch: [0-9]' "$work/doctor.txt" || fail "localllm doctor: torch does not import in the install"
if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then
  grep -q "^  torch runner's native kernels: .*; tier " "$work/doctor.txt" \
    || fail "localllm doctor: the torch runner's native kernels are not usable in the install"
fi
"$localllm" doctor --json | "$installed_py" -c "import json, sys; r = json.load(sys.stdin); assert r['llama_cpp']['version']" \
  || fail "localllm doctor --json"

echo "check_install: OK in $((SECONDS - start)) s"
