"""`localllm cache ls|stats|clear`: the on-disk prefix cache, without loading a model."""

from __future__ import annotations

import json
import sys
import time

from localllm import paths
from localllm.commands.models import _size, _table
from localllm.config import PREFIX_CACHE_SIZE
from localllm.engine.prefix_store import PrefixIndex
from localllm.errors import UsageError


def _index() -> PrefixIndex:
    return PrefixIndex(paths.prefix_cache_dir())


def _entries(index: PrefixIndex):
    if not index.path.exists():
        return []
    try:
        return index.entries()
    except Exception as e:  # sqlite3.Error, OSError: the index is unreadable
        raise UsageError(f"the prefix-cache index {index.path} cannot be read ({e}); "
                         "`localllm cache clear` starts it afresh") from None


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def ls(as_json: bool = False) -> int:
    index = _index()
    entries = _entries(index)
    if as_json:
        json.dump([{"key": e.key, "model": e.model_name, "model_digest": e.model, "tokens": e.num_tokens,
                    "bytes": e.size, "created": e.created, "last_used": e.last_used} for e in entries],
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not entries:
        print(f"the prefix cache is empty ({index.directory})")
        return 0
    rows = [("KEY", "MODEL", "TOKENS", "SIZE", "LAST USED")]
    rows += [(e.key[:12], e.model_name or e.model[:12], f"{e.num_tokens:,}", _size(e.size), _ago(e.last_used))
             for e in entries]
    _table(rows)
    return 0


def stats(as_json: bool = False) -> int:
    index = _index()
    entries = _entries(index)
    per_model: dict[str, list] = {}
    for e in entries:
        per_model.setdefault(e.model_name or e.model[:12], []).append(e)
    report = {
        "directory": str(index.directory),
        "entries": len(entries),
        "bytes": sum(e.size for e in entries),
        "tokens": sum(e.num_tokens for e in entries),
        "default_budget_bytes": PREFIX_CACHE_SIZE,
        "models": {name: {"entries": len(es), "bytes": sum(e.size for e in es),
                          "tokens": sum(e.num_tokens for e in es)} for name, es in per_model.items()},
    }
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"prefix cache: {index.directory}")
    print(f"  {report['entries']} entries · {report['tokens']:,} tokens · {_size(report['bytes']) if report['bytes'] else '0 B'}"
          f" of {_size(PREFIX_CACHE_SIZE)} (the default budget; --prefix-cache-size sets it)")
    for name, m in report["models"].items():
        print(f"  {name}: {m['entries']} entries · {m['tokens']:,} tokens · {_size(m['bytes'])}")
    return 0


def clear(yes: bool = False) -> int:
    index = _index()
    if not index.directory.exists():
        print("the prefix cache is empty")
        return 0
    if not yes and sys.stdin.isatty():
        entries = _entries(index) if index.path.exists() else []
        answer = input(f"Remove {len(entries)} prefix-cache entries "
                       f"({_size(sum(e.size for e in entries))})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("kept")
            return 0
    try:
        count, freed = index.clear()
    except Exception:  # an unreadable index: remove the whole directory's files instead
        count, freed = _remove_all(index)
    print(f"removed {count} entries" + (f" · freed {_size(freed)}" if freed else ""))
    return 0


def _remove_all(index: PrefixIndex) -> tuple[int, int]:
    index.close()
    count = freed = 0
    for path in list(index.entries_dir.glob("*")) + [index.path, index.path.with_name(index.path.name + "-wal"),
                                                      index.path.with_name(index.path.name + "-shm")]:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        if path.parent == index.entries_dir:
            count += 1
            freed += size
    return count, freed
