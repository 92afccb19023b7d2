"""The installed models: a small JSON manifest in the data folder naming each model and the
files it is made of. The files themselves live in the Hugging Face cache (pulled) or where the
person keeps them (imported paths, never copied or deleted by us)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localllm.errors import UsageError
from localllm.files import write_atomic

MANIFEST_VERSION = 1


@dataclass
class InstalledModel:
    name: str  # "qwen2.5-coder:0.5b", "hf.co/OWNER/REPO:Q4_K_M", or a local file's stem
    files: list[str]  # absolute paths; the first is what llama.cpp opens (split parts follow)
    source: str  # "hub" | "local"
    repo: str = ""  # OWNER/REPO on the hub
    revision: str = ""  # the commit the files came from
    quant: str = ""
    sha256: list[str] = field(default_factory=list)  # per file, as verified
    size_bytes: int = 0
    license: str = ""

    @property
    def path(self) -> Path:
        return Path(self.files[0])

    @property
    def is_present(self) -> bool:
        return all(Path(f).is_file() for f in self.files)


class ModelStore:
    """``models.json`` in the data folder. Every change rewrites it atomically (temporary file,
    fsync, rename, folder fsync), so a crash leaves the old or the new manifest, never half of one."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def list(self) -> list[InstalledModel]:
        return sorted(self._read().values(), key=lambda m: m.name)

    def get(self, name: str) -> InstalledModel | None:
        return self._read().get(name)

    def add(self, model: InstalledModel) -> None:
        models = self._read()
        models[model.name] = model
        self._write(models)

    def remove(self, name: str) -> InstalledModel:
        models = self._read()
        model = models.pop(name, None)
        if model is None:
            raise UsageError(f"no installed model {name!r}; `localllm ls` lists them")
        self._write(models)
        return model

    def _read(self) -> dict[str, InstalledModel]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise UsageError(f"the model list {self.path} cannot be read ({e}); move it aside and "
                             "pull or import the models again") from None
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise UsageError(f"the model list {self.path} is not one this localllm writes; move it aside")
        try:
            return {m["name"]: InstalledModel(**m) for m in data.get("models", [])}
        except (TypeError, KeyError) as e:
            raise UsageError(f"the model list {self.path} is damaged ({e}); move it aside") from None

    def _write(self, models: dict[str, InstalledModel]) -> None:
        data = {"version": MANIFEST_VERSION, "models": [asdict(m) for m in models.values()]}
        write_atomic(self.path, json.dumps(data, indent=2).encode("utf-8"))
