"""`localllm ps` and `localllm stop NAME`: what a running `localllm serve` has loaded, and
unloading one of its models (its /api/ps and /api/stop). The standard library's HTTP only, so
both start fast."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from localllm.errors import LocalLLMError, UsageError


def _call(url: str, api_key: str | None, path: str, body: dict | None = None) -> dict:
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--url {url} is not an http:// or https:// address")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise LocalLLMError(message) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise LocalLLMError(f"no localllm server answers at {base} ({reason}); start one with `localllm serve`, "
                            "or give its address with --url") from None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def ps(url: str, api_key: str | None, as_json: bool = False) -> int:
    models = _call(url, api_key, "/api/ps")["models"]
    if as_json:
        print(json.dumps(models, indent=2))
        return 0
    rows = [("NAME", "KIND", "SIZE", "CONTEXT", "REQUESTS", "IDLE", "UNTIL UNLOAD")]
    for m in models:
        until = "pinned" if m["pinned"] else ("serving" if m["in_flight"] else _duration(m["keep_alive_left_s"]))
        if m["state"] != "loaded":
            until = m["state"]
        elif not m["pinned"] and not m["in_flight"] and m["keep_alive_left_s"] is None:
            until = "forever"
        rows.append((m["name"], m["kind"], f"{m['size'] / 2**30:.2f} GiB",
                     f"{m['context_length']:,}" if m["context_length"] else "-", str(m["in_flight"]),
                     _duration(m["idle_s"]), until))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    if not models:
        print("(no model is loaded; a request that names one loads it)")
    return 0


def stop(url: str, api_key: str | None, name: str) -> int:
    result = _call(url, api_key, "/api/stop", {"model": name})
    if not result["unloaded"]:
        loaded = [m["name"] for m in _call(url, api_key, "/api/ps")["models"]]
        raise LocalLLMError(f"{result['model']} is not loaded"
                            + (f" (loaded: {', '.join(loaded)})" if loaded else " (no model is loaded)"))
    print(f"unloaded {result['model']}")
    return 0
