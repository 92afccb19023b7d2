"""A local HTTP server that speaks enough of the Hugging Face Hub protocol for huggingface_hub.

What the client asks and what the real hub answers, as served here:

    GET  /api/models/OWNER/REPO[/revision/REV]?blobs=True
         -> {"id", "sha", "siblings": [{"rfilename", "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}
    HEAD /OWNER/REPO/resolve/REV/FILE
         -> 200 (or 302 to /cdn/SHA256 with ``redirect=True``) with X-Repo-Commit, X-Linked-Etag (the
            LFS sha256, quoted), X-Linked-Size, ETag, Content-Length, Accept-Ranges
    GET  the same, with ``Range: bytes=START-[END]`` -> 206 and Content-Range
    errors: X-Error-Code RepoNotFound (401, as the hub answers an anonymous client),
            GatedRepo (401 without a token, 403 with one that was not granted access),
            EntryNotFound (404), RevisionNotFound (404)

Files are bytes in memory or a path on disk (the 253 MB test model is streamed from its file).
Faults are armed per file: a slow link (a pause before each chunk), drop the connection after N body bytes once (then optionally
answer the next GETs with 503), pause after N bytes until released, serve corrupted bytes
under the true hash, advertise a wrong LFS hash, or list a file whose address answers 404.
With ``redirect=True`` LFS files answer 302 to ``http://localhost:PORT/cdn/SHA256``, another
host name for the same server, as the real hub sends them to its CDN. Every request is logged
with the body bytes it actually put on the wire.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 20
GOOD_TOKEN = "hf_granted"


def tiny_gguf(size: int = 4096, seed: int = 0, *, split: tuple[int, int] | None = None) -> bytes:
    """A small well-formed GGUF file (version 3, no tensors, general.architecture = "llama",
    and for ``split=(index, count)`` the split.no / split.count keys llama.cpp's gguf-split
    writes) padded to ``size`` bytes with seed-dependent filler, so files of different seeds
    hash differently. Enough for localllm.gguf.read_info; llama.cpp could not run it."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    pairs = [string("general.architecture") + struct.pack("<I", 8) + string("llama")]
    if split is not None:
        pairs += [string("split.no") + struct.pack("<IH", 2, split[0]),  # type 2: uint16
                  string("split.count") + struct.pack("<IH", 2, split[1])]
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs)) + b"".join(pairs)
    block = hashlib.sha256(f"filler-{seed}".encode()).digest() * 2048  # 64 KiB
    return header + (block * (size // len(block) + 1))[: size - len(header)]


def sha256_of(source: bytes | Path) -> str:
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    h = hashlib.sha256()
    with open(source, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class HubFile:
    data: bytes | Path
    sha256: str = ""  # of the true bytes
    size: int = 0
    advertised_sha256: str | None = None  # what the hub claims, when it lies
    corrupt: bool = False  # serve the true length, with one byte flipped in the middle
    drop_after: int | None = None  # one shot: close the connection after this many body bytes
    fail_after_drop: int = 0  # then answer this many GETs with 503
    stall_after: int | None = None  # one shot: send this many body bytes, set `stalled`, wait for `release`, go on
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    gone: bool = False  # listed by the API, but its resolve address answers 404
    chunk_delay_s: float = 0.0  # a slow link: pause this long before each 1 MiB chunk of the body

    def __post_init__(self) -> None:
        self.sha256 = sha256_of(self.data)
        self.size = len(self.data) if isinstance(self.data, bytes) else self.data.stat().st_size

    @property
    def lfs_sha256(self) -> str:
        return self.advertised_sha256 or self.sha256

    def read(self, start: int, end: int):
        """The bytes [start, end) in chunks, with the corruption applied."""
        flip = self.size // 2 if self.corrupt else -1
        if isinstance(self.data, bytes):
            chunks = (self.data[i:min(i + CHUNK, end)] for i in range(start, end, CHUNK))
        else:
            chunks = _file_chunks(self.data, start, end)
        pos = start
        for chunk in chunks:
            if pos <= flip < pos + len(chunk):
                chunk = chunk[: flip - pos] + bytes([chunk[flip - pos] ^ 0xFF]) + chunk[flip - pos + 1:]
            pos += len(chunk)
            yield chunk


def _file_chunks(path: Path, start: int, end: int):
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            left -= len(chunk)
            yield chunk


@dataclass
class Repo:
    files: dict[str, HubFile]
    gated: bool = False
    commit: str = ""


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None
    status: int = 0
    bytes_sent: int = 0  # body bytes the server managed to hand to the socket


class FakeHub:
    """``with FakeHub() as hub: hub.add_repo("acme/tiny-GGUF", {"tiny-q4_k_m.gguf": tiny_gguf()})``;
    point huggingface_hub at ``hub.url``."""

    def __init__(self, *, redirect: bool = False):
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.redirect = redirect  # LFS files answer 302 to a CDN path, as the real hub does
        self._lock = threading.Lock()
        self._commits = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for repo in self.repos.values():
            for f in repo.files.values():
                f.release.set()
        self._server.shutdown()
        self._server.server_close()

    def add_repo(self, repo: str, files: dict[str, bytes | Path], *, gated: bool = False) -> Repo:
        self.repos[repo] = Repo({name: HubFile(data) for name, data in files.items()}, gated)
        self.new_commit(repo)
        return self.repos[repo]

    def new_commit(self, repo: str) -> str:
        """Move the repo's main to a fresh commit hash (same files unless the caller changed them)."""
        self._commits += 1
        self.repos[repo].commit = hashlib.sha1(f"{repo}@{self._commits}".encode()).hexdigest()
        return self.repos[repo].commit

    def file(self, repo: str, name: str) -> HubFile:
        return self.repos[repo].files[name]

    def gets(self, name: str) -> list[Request]:
        """The GET requests that fetched ``name``'s bytes (resolve or CDN path)."""
        shas = {f.sha256 for r in self.repos.values() for n, f in r.files.items() if n == name}
        return [r for r in self.requests if r.method == "GET" and
                (r.path.endswith("/" + name) or r.path.rsplit("/", 1)[-1] in shas)]

    def bytes_sent(self, name: str) -> int:
        return sum(r.bytes_sent for r in self.gets(name))

    def _log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_API = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
_CDN = re.compile(r"^/cdn/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def _dispatch(self, method: str) -> None:
            path = unquote(urlsplit(self.path).path)
            self.req = Request(method, path, self.headers.get("Range"), self.headers.get("Authorization"))
            # Logged before answering, and bytes counted before they are written: the client may
            # finish (and a test read the log) before this thread returns from its last write.
            hub._log(self.req)
            if m := _API.match(path):
                self._model_info(m.group(1), m.group(2) or "main")
            elif m := _RESOLVE.match(path):
                self._resolve(method, m.group(1), m.group(2), m.group(3))
            elif m := _CDN.match(path):
                self._cdn(method, m.group(1))
            else:
                self._error(404, "NotFound", "Not found")

        # --- the API -------------------------------------------------------------------------

        def _repo(self, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            if repo.gated:
                token = (self.req.authorization or "").removeprefix("Bearer ")
                if not token:
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                "access to it and be authenticated to access it. Please log in.")
                    return None
                if token != GOOD_TOKEN:
                    self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are "
                                "not in the authorized list.")
                    return None
            if revision not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None
            return repo

        def _model_info(self, repo_id: str, revision: str) -> None:
            if (repo := self._repo(repo_id, revision)) is None:
                return
            siblings = [{"rfilename": name, "size": f.size, "blobId": hashlib.sha1(f.lfs_sha256.encode()).hexdigest(),
                         "lfs": {"sha256": f.lfs_sha256, "size": f.size, "pointerSize": 134}}
                        for name, f in repo.files.items()]
            body = json.dumps({"id": repo_id, "sha": repo.commit, "private": False, "gated": repo.gated,
                               "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.req.status = 200

        def _resolve(self, method: str, repo_id: str, revision: str, name: str) -> None:
            if (repo := self._repo(repo_id, revision)) is None:
                return
            f = repo.files.get(name)
            if f is None or f.gone:
                self._error(404, "EntryNotFound", f"{name} does not exist on \"{revision}\"", commit=repo.commit)
                return
            headers = {"X-Repo-Commit": repo.commit, "X-Linked-Etag": f'"{f.lfs_sha256}"',
                       "X-Linked-Size": str(f.size), "ETag": f'"{f.lfs_sha256}"'}
            if hub.redirect:
                # The real hub sends LFS files to a CDN on another host; "localhost" is one here.
                port = hub._server.server_address[1]
                self.send_response(302)
                headers["Location"] = f"http://localhost:{port}/cdn/{f.lfs_sha256}"
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.req.status = 302
                return
            self._send_file(method, f, headers)

        def _cdn(self, method: str, sha: str) -> None:
            for repo in hub.repos.values():
                for f in repo.files.values():
                    if f.lfs_sha256 == sha:
                        self._send_file(method, f, {"ETag": f'"{sha}"'})
                        return
            self._error(404, "NotFound", "no such blob")

        # --- bytes ---------------------------------------------------------------------------

        def _send_file(self, method: str, f: HubFile, headers: dict[str, str]) -> None:
            start, end = 0, f.size
            if method == "GET" and f.fail_after_drop > 0 and f.drop_after is None:
                f.fail_after_drop -= 1
                self._error(503, "ServiceUnavailable", "try again later")
                return
            status = 200
            if method == "GET" and self.req.range:
                m = _RANGE.match(self.req.range)
                if m is None or int(m.group(1)) >= f.size:
                    self._error(416, "RangeNotSatisfiable", f"bad range {self.req.range}")
                    return
                start = int(m.group(1))
                end = min(int(m.group(2)) + 1, f.size) if m.group(2) else f.size
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            self.req.status = status
            if method == "HEAD":
                return
            drop, f.drop_after = f.drop_after, None
            stall, f.stall_after = f.stall_after, None
            try:
                for chunk in f.read(start, end):
                    if f.chunk_delay_s:
                        time.sleep(f.chunk_delay_s)
                    if drop is not None and self.req.bytes_sent + len(chunk) >= drop:
                        self._write(chunk[: drop - self.req.bytes_sent])
                        self._hang_up()
                        return
                    if stall is not None and self.req.bytes_sent + len(chunk) >= stall:
                        cut = stall - self.req.bytes_sent
                        self._write(chunk[:cut])
                        f.stalled.set()
                        f.release.wait()
                        stall, chunk = None, chunk[cut:]
                    self._write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _write(self, data: bytes) -> None:
            self.req.bytes_sent += len(data)
            try:
                self.wfile.write(data)
            except OSError:
                self.req.bytes_sent -= len(data)  # never reached the socket
                raise

        def _hang_up(self) -> None:
            """Close mid-body, as a lost connection does: the client sees the stream end early."""
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.req.status = status

    return Handler
