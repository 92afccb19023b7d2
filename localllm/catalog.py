"""The catalog (models.toml) and what a model name means.

A name is, in order: a path to a ``.gguf`` file that exists; an installed model's name; a
catalog alias (``qwen2.5-coder:0.5b``); ``hf.co/OWNER/REPO[:QUANT]``; ``OWNER/REPO/FILE.gguf``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from localllm.errors import UsageError

DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.I)


def _builtin_catalog() -> bytes:
    """models.toml: inside the installed package (the build copies it in), or at the top of a
    source checkout (an editable install)."""
    shipped = resources.files("localllm").joinpath("models.toml")
    if shipped.is_file():
        return shipped.read_bytes()
    return (Path(__file__).resolve().parent.parent / "models.toml").read_bytes()


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    repo: str
    files: dict[str, str]  # quant -> file (the first part of a split file)
    context: int | None = None
    license: str = ""
    notes: str = ""
    sha256: dict[str, str] = field(default_factory=dict)  # file -> sha256, where known


@dataclass(frozen=True)
class Catalog:
    models: dict[str, ModelSpec]
    default: str

    @classmethod
    def load(cls, path: Path | None = None) -> Catalog:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            raw = Path(path).read_bytes() if path is not None else _builtin_catalog()
            data = tomllib.loads(raw.decode("utf-8"))
        except (OSError, ValueError) as e:
            raise UsageError(f"the model catalog {path or 'models.toml'} cannot be read: {e}") from None
        models = {}
        for alias, entry in (data.get("models") or {}).items():
            try:
                models[alias] = ModelSpec(alias=alias, repo=entry["repo"], files=dict(entry["files"]),
                                          context=entry.get("context"), license=entry.get("license", ""),
                                          notes=entry.get("notes", ""), sha256=dict(entry.get("sha256", {})))
            except (KeyError, TypeError) as e:
                raise UsageError(f"catalog entry {alias!r} lacks {e}; it needs repo and files") from None
        default = data.get("default", "")
        if default and default not in models:
            raise UsageError(f"the catalog's default {default!r} is not one of its models")
        return cls(models, default)


@dataclass(frozen=True)
class HubRef:
    """What to pull: a repo, and either an exact file or a quant to pick from its file list."""

    repo: str
    file: str | None = None
    quant: str | None = None
    alias: str | None = None  # the catalog alias it came from
    spec: ModelSpec | None = None

    @property
    def name(self) -> str:
        """The installed model's name."""
        if self.alias:
            return self.alias if not self.quant or self.quant == DEFAULT_QUANT else f"{self.alias}-{self.quant.lower()}"
        if self.file:
            return f"{self.repo}/{self.file}"
        return f"hf.co/{self.repo}:{self.quant or DEFAULT_QUANT}"


def parse_hub_name(name: str, catalog: Catalog) -> HubRef | None:
    """A catalog alias, an ``hf.co/OWNER/REPO[:QUANT]`` or an ``OWNER/REPO/FILE.gguf``; None
    when ``name`` is none of them."""
    if name in catalog.models:
        spec = catalog.models[name]
        quant = DEFAULT_QUANT if DEFAULT_QUANT in spec.files else next(iter(spec.files))
        return HubRef(spec.repo, spec.files[quant], quant, alias=name, spec=spec)
    for prefix in ("https://huggingface.co/", "huggingface.co/", "hf.co/"):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            repo, _, quant = rest.partition(":")
            if repo.count("/") != 1 or not all(repo.split("/")):
                raise UsageError(f"{name!r}: give hf.co/OWNER/REPO or hf.co/OWNER/REPO:QUANT")
            return HubRef(repo, quant=quant.upper() or None)
    parts = name.split("/")
    looks_like_path = name.startswith(("/", ".", "~")) or Path(name).is_absolute()
    if len(parts) >= 3 and name.lower().endswith(".gguf") and not looks_like_path and not Path(name).exists():
        return HubRef("/".join(parts[:2]), file="/".join(parts[2:]))
    return None


def quant_of(filename: str) -> str | None:
    """The quant a GGUF file name says it holds: 'qwen2.5-0.5b-instruct-q4_k_m.gguf' -> 'Q4_K_M'."""
    stem = _SPLIT.sub(".gguf", Path(filename).name)[: -len(".gguf")] if filename.lower().endswith(".gguf") else filename
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def split_parts(filename: str) -> list[str] | None:
    """All parts of a split GGUF given its first part's name, or None when it is not split."""
    m = _SPLIT.search(filename)
    if m is None:
        return None
    total = int(m.group(2))
    return [filename[: m.start()] + f"-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]


def pick_file(repo: str, files: list[str], quant: str | None) -> str:
    """The GGUF of ``quant`` (Q4_K_M when None) among a repo's files: its first part when split.
    Raises UsageError listing the quants there are when it is missing."""
    want = (quant or DEFAULT_QUANT).upper()
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    by_quant: dict[str, list[str]] = {}
    for f in ggufs:
        q = quant_of(f)
        if q is not None and (_SPLIT.search(f) is None or _SPLIT.search(f).group(1) == "00001"):
            by_quant.setdefault(q, []).append(f)
    if want not in by_quant:
        have = ", ".join(sorted(by_quant)) or "none"
        raise UsageError(f"{repo} has no {want} GGUF file; the quants there are: {have} "
                         f"(pull one with hf.co/{repo}:QUANT)")
    return sorted(by_quant[want], key=len)[0]
