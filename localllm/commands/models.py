"""`localllm pull` / `ls` / `rm` / `show`, and what a MODEL argument means everywhere."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from localllm import paths
from localllm.catalog import Catalog, parse_hub_name
from localllm.errors import ModelLoadError, UsageError
from localllm.store import ModelStore


def open_store() -> ModelStore:
    return ModelStore(paths.models_manifest())


def resolve(name: str, store: ModelStore, catalog: Catalog) -> Path:
    """The file to load for MODEL: a path to a file; an installed model's name; a catalog alias
    or hub name that is installed. Anything else is a usage error that says how to get it."""
    path = Path(name).expanduser()
    if path.exists():
        return path  # the loader says what is wrong with a directory or a non-GGUF file
    installed = store.get(name)
    if installed is None:
        try:
            ref = parse_hub_name(name, catalog)
        except UsageError:
            ref = None
        if ref is not None:
            installed = store.get(ref.name)
            if installed is None:
                raise UsageError(f"{name} is not installed yet; run `localllm pull {name}`")
    if installed is None:
        if name.lower().endswith(".gguf") or "/" in name or name.startswith("."):
            raise ModelLoadError(f"model file {name} does not exist; give the path to a .gguf file, "
                                 "or a name from `localllm ls`")
        raise UsageError(f"no model {name!r}: not a file, not installed, not in the catalog; "
                         "`localllm ls` lists installed models, `localllm pull NAME` installs one")
    if not installed.is_present:
        raise ModelLoadError(f"{installed.name} is installed but its file {installed.path} is gone; "
                             f"run `localllm pull {installed.name}` again, or `localllm rm {installed.name}`")
    return installed.path


def pull(name: str, catalog: Catalog, quiet: bool = False) -> int:
    from localllm import hub

    store = open_store()
    path = Path(name).expanduser()
    if path.is_file() or name.lower().endswith(".gguf") and not parse_hub_name(name, catalog):
        if not path.is_file():
            raise ModelLoadError(f"model file {name} does not exist; give the path to a .gguf file")
        model = hub.import_local(path, store)
        print(f"imported {model.name}: {model.path} (not copied) · {_size(model.size_bytes)}")
        return 0
    ref = parse_hub_name(name, catalog)
    if ref is None:
        raise UsageError(f"{name!r} is not a catalog alias, an hf.co/OWNER/REPO[:QUANT], an "
                         "OWNER/REPO/FILE.gguf or a .gguf path; `localllm pull --list` shows the catalog")
    model = hub.pull(ref, store, progress=not quiet)
    print(f"pulled {model.name}: {model.path} · {_size(model.size_bytes)}"
          + (f" · {len(model.files)} files" if len(model.files) > 1 else ""))
    return 0


def list_catalog(catalog: Catalog) -> int:
    rows = [("ALIAS", "REPO", "QUANTS", "CONTEXT", "LICENSE")]
    for alias, spec in catalog.models.items():
        rows.append((alias + (" *" if alias == catalog.default else ""), spec.repo, ",".join(spec.files),
                     f"{spec.context:,}" if spec.context else "-", spec.license or "-"))
    _table(rows)
    print("* the default model of `localllm chat`")
    return 0


def ls(as_json: bool = False) -> int:
    from localllm.gguf import read_info

    store = open_store()
    rows, records = [("NAME", "QUANT", "SIZE", "ARCH", "PARAMS", "CONTEXT", "SOURCE")], []
    for model in store.list():
        record = {"name": model.name, "files": model.files, "source": model.source,
                  "size_bytes": model.size_bytes, "present": model.is_present}
        if model.is_present:
            try:
                info = read_info(model.path)
                record.update(quant=info.file_type or model.quant, architecture=info.architecture,
                              parameters=info.parameters, context_length=info.context_length,
                              size_bytes=info.size_bytes)
            except ModelLoadError as e:
                record["error"] = str(e)
        records.append(record)
        rows.append((model.name, record.get("quant") or model.quant or "-", _size(record["size_bytes"]),
                     record.get("architecture", "missing" if not model.is_present else "unreadable"),
                     _params(record.get("parameters")),
                     f"{record['context_length']:,}" if record.get("context_length") else "-",
                     model.repo if model.source == "hub" else str(model.path.parent)))
    if as_json:
        json.dump(records, sys.stdout, indent=2)
        print()
    elif len(rows) == 1:
        print("no models installed; `localllm pull qwen2.5-coder:0.5b` installs a small one "
              "(`localllm pull --list` shows the catalog)")
    else:
        _table(rows)
    return 0


def rm(name: str, yes: bool = False) -> int:
    from localllm import hub

    store = open_store()
    model = store.get(name)
    if model is None:
        raise UsageError(f"no installed model {name!r}; `localllm ls` lists them")
    what = "its files in the Hugging Face cache" if model.source == "hub" else "the entry (your file stays)"
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"`localllm rm {name}` asks before deleting; add -y to remove it without asking")
        answer = input(f"Remove {name} ({_size(model.size_bytes)}, {what})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("kept")
            return 0
    # A file another installed name also points at (an alias and its hf.co name) stays.
    shared = [f for other in store.list() if other.name != name for f in other.files]
    freed = hub.remove_files(model, keep=shared)
    store.remove(name)
    print(f"removed {name}" + (f" · freed {_size(freed)}" if freed else ""))
    return 0


def show(name: str, catalog: Catalog, as_json: bool = False, template: bool = False) -> int:
    from localllm.gguf import read_info

    store = open_store()
    path = resolve(name, store, catalog)
    info = read_info(path)
    installed = store.get(name)
    record = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(info).items()},
              "model_name": info.name,  # general.name, what the file calls itself
              "name": installed.name if installed else name, "path": str(path),
              "source": installed.source if installed else "path",
              "repo": installed.repo if installed else "",
              "kv_bytes_per_token": info.kv_bytes_per_token()}
    if template:
        print(info.chat_template or "(this model has no chat template)")
        return 0
    if as_json:
        json.dump(record, sys.stdout, indent=2)
        print()
        return 0
    lines = [
        ("name", record["name"]), ("model", info.name or "-"), ("file", record["path"]),
        ("source", record["source"] + (f" ({record['repo']})" if record["repo"] else "")),
        ("architecture", info.architecture), ("parameters", _params(info.parameters)),
        ("quant", info.file_type or "-"), ("size", _size(info.size_bytes)),
        ("context", f"{info.context_length:,}" if info.context_length else "-"),
        ("layers", str(info.block_count)), ("KV per token", f"{info.kv_bytes_per_token():,} bytes (f16)"),
        ("license", info.license or (installed.license if installed and installed.license else "-")),
        ("chat template", f"{len(info.chat_template):,} characters (--template prints it)"
         if info.chat_template else "none (chat needs one; completions work)"),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


def _size(n: int | None) -> str:
    if not n:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _params(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())

