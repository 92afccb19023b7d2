"""Models pulled from the Hugging Face Hub into its standard cache, and local files imported.

The only module that imports huggingface_hub, and only inside functions, so `localllm --help`
stays fast. Pulled files live in the hub's own cache (``HF_HUB_CACHE`` / ``HF_HOME``), shared
with every other tool that reads it:

    models--OWNER--REPO/blobs/<sha256>                  the bytes (an LFS file's name is its sha256)
    models--OWNER--REPO/snapshots/<commit>/FILE      -> ../../blobs/<sha256>
    models--OWNER--REPO/refs/main                       <commit>

Why the bytes are not fetched by ``hf_hub_download`` itself: in huggingface_hub 2.x (2.4.0
checked) it downloads into a process-unique temporary file that it deletes when the call fails,
so a pull that was interrupted starts again at byte 0. We fetch each blob into
``blobs/<sha256>.incomplete``, a stable name, with huggingface_hub's own ``http_get`` (its progress
bar, retries and Range requests), check the sha256, move it into place, and then let
``hf_hub_download`` link the snapshot exactly as it always does.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from localllm.catalog import HubRef, pick_file, quant_of, split_parts
from localllm.errors import DownloadError, LocalLLMError, ModelLoadError, UsageError
from localllm.files import fsync_dir, fsync_file, write_atomic
from localllm.gguf import GGUFInfo, read_info
from localllm.gguf_check import check_model
from localllm.store import InstalledModel, ModelStore

REVISION = "main"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


@dataclass(frozen=True)
class _Plan:
    """What one pull fetches: a commit, the files in order (split parts), and for each file the
    sha256 it must have and who says so ("the catalog" or "the hub")."""

    commit: str
    files: list[str]
    expected: dict[str, tuple[str, str]]
    quant: str


def pull(ref: HubRef, store: ModelStore, *, progress: bool = True, endpoint: str | None = None,
         cache_dir: Path | None = None) -> InstalledModel:
    """Download ``ref``'s GGUF file (all parts of a split one) into the Hugging Face cache,
    verify each file's sha256 and that the model reads as GGUF, and record it in ``store``.

    A download that was interrupted resumes where it stopped. Offline (``HF_HUB_OFFLINE=1``) or
    with the hub out of reach, a model already in the cache is resolved from it.
    ``endpoint`` and ``cache_dir`` default to what huggingface_hub reads from the environment
    (``HF_ENDPOINT``, ``HF_HUB_CACHE`` / ``HF_HOME``) when it is imported.
    """
    cache = _cache_dir(cache_dir)
    previous = store.get(ref.name)
    # Files the manifest says we verified already: not hashed again (a pull of a complete model is quick).
    trusted = dict(zip(previous.files, previous.sha256)) if previous and previous.source == "hub" else {}
    downloaded: list[Path] = []
    with _translated_errors(ref, endpoint, cache):
        try:
            plan = _plan(ref, endpoint)
        except _unreachable() as e:
            return _pull_cached(ref, store, cache, trusted, e)
        paths, shas = [], []
        for name in plan.files:
            path, sha, is_new = _fetch(ref.repo, name, plan, cache=cache, endpoint=endpoint,
                                       progress=progress, trusted=trusted)
            paths.append(path)
            shas.append(sha)
            if is_new:
                downloaded.append(path)
        _write_ref(_storage(cache, ref.repo), REVISION, plan.commit)
    try:
        info = check_model(paths[0])  # checks every part of a split model too
    except ModelLoadError as e:
        for path in downloaded:  # the hub's bytes, but no model: leave nothing of this pull behind
            _unlink_cached(path)
            _tidy(path)
        raise ModelLoadError(f"{ref.name} is no model localllm can load, so the files this pull "
                             f"downloaded were deleted again: {e}") from None
    return _record(store, ref, paths, shas, plan.commit, plan.quant, info)


def import_local(path: Path, store: ModelStore) -> InstalledModel:
    """Record a GGUF file on disk as a model, where it is (nothing is copied). A part of a
    split model brings all its parts, which must lie next to it. The name is the file's stem."""
    path = Path(path).expanduser().absolute()
    if not path.is_file():
        raise ModelLoadError(f"{path} {'is a folder' if path.is_dir() else 'does not exist'}; "
                             "give the path of a .gguf file")
    names = split_parts(path.name)
    files = [path.with_name(n) for n in names] if names else [path]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{path.name} is one of {len(files)} parts of a split model, and "
                             f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in {path.parent}; "
                             "put all the parts in one folder and import again")
    info = check_model(files[0])
    name = _SPLIT_SUFFIX.sub("", files[0].stem)
    existing = store.get(name)
    if existing is not None and existing.files != [str(f) for f in files]:
        raise UsageError(f"a model named {name!r} is installed already ({existing.files[0]}); "
                         f"rename {path.name}, or remove the other with `localllm rm {name}`")
    model = InstalledModel(name=name, files=[str(f) for f in files], source="local",
                           quant=quant_of(files[0].name) or info.file_type or "",
                           size_bytes=sum(f.stat().st_size for f in files), license=info.license or "")
    store.add(model)
    return model


def remove_files(model: InstalledModel, keep: Iterable[str] = ()) -> int:
    """Delete a pulled model's files from the Hugging Face cache and return the bytes freed:
    its snapshot links, and their blobs unless another snapshot still links to them. Files of
    an imported model are the person's own and are never deleted (0).

    ``keep``: files other installed models use (an alias and its hf.co name can share one),
    which stay."""
    if model.source != "hub":
        return 0
    kept = set(keep)
    freed = 0
    for f in model.files:
        if f not in kept:
            freed += _unlink_cached(Path(f))
            _tidy(Path(f))
    return freed


# --- planning and fetching --------------------------------------------------------------------


def _plan(ref: HubRef, endpoint: str | None) -> _Plan:
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).model_info(ref.repo, revision=REVISION, files_metadata=True)
    if not info.sha:
        raise DownloadError(f"{endpoint or 'the hub'} gave no commit for {ref.repo}; it does not answer like "
                            "the Hugging Face Hub: check HF_ENDPOINT")
    siblings = {s.rfilename: s for s in info.siblings or []}
    first = ref.file or pick_file(ref.repo, list(siblings), ref.quant)
    files = split_parts(first) or [first]
    for f in files:
        if f not in siblings:
            source = f" (the catalog entry {ref.alias!r} names it)" if ref.alias else ""
            raise UsageError(f"{ref.repo} has no file {f}{source}; the quants there are: "
                             f"{_quants(siblings)} (pull one with `localllm pull hf.co/{ref.repo}:QUANT`)")
    expected = {}
    for f in files:
        hub_sha = siblings[f].lfs.sha256 if siblings[f].lfs else None
        catalog_sha = ref.spec.sha256.get(f) if ref.spec else None
        if catalog_sha and hub_sha and catalog_sha != hub_sha:
            raise ModelLoadError(f"{f} in {ref.repo}: the catalog expects sha256 {catalog_sha}, but the hub's "
                                 f"file has {hub_sha}, so nothing was downloaded. The file changed on the hub "
                                 f"after the catalog was written: `localllm pull {ref.repo}/{f}` takes the "
                                 "hub's version")
        if catalog_sha:
            expected[f] = (catalog_sha, "the catalog")
        elif hub_sha:
            expected[f] = (hub_sha, "the hub")
    return _Plan(info.sha, files, expected, ref.quant or quant_of(first) or "")


def _fetch(repo: str, name: str, plan: _Plan, *, cache: Path, endpoint: str | None, progress: bool,
           trusted: dict[str, str]) -> tuple[Path, str, bool]:
    """One file of the plan into the cache: (its snapshot path, its sha256, whether it was downloaded)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    storage = _storage(cache, repo)
    expected = plan.expected.get(name)
    pointer = storage / "snapshots" / plan.commit / name
    if pointer.exists():
        return pointer, _verify_cached(pointer, expected, trusted, repo), False

    url = hf_hub_url(repo, name, revision=plan.commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    if not meta.etag:
        raise DownloadError(f"{url} came without an ETag, so it is not served like the Hugging Face Hub "
                            "serves files: check HF_ENDPOINT and any proxy")
    if expected is None and _SHA256.fullmatch(meta.etag):
        expected = (meta.etag, "the hub")  # an LFS file's ETag is its sha256
    headers = build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN address: the token stays with the hub
    blob = storage / "blobs" / meta.etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    # As hf_hub_download does: a repo folder without snapshots/ is one huggingface_hub's cache
    # scan calls corrupt, and a killed pull leaves only blobs/*.incomplete behind.
    pointer.parent.mkdir(parents=True, exist_ok=True)
    lock = cache / ".locks" / storage.name / f"{meta.etag}.lock"  # the lock hf_hub_download takes too
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        is_new = not blob.exists()
        if is_new:
            sha = _download(meta.location, headers, blob, meta.size, expected, repo, name, progress)
        else:
            sha = _verify(blob, expected, repo, name)
    # The blob is in place, so this only links snapshots/<commit>/<name> to it (no bytes move).
    path = Path(hf_hub_download(repo, name, revision=plan.commit, cache_dir=cache, endpoint=endpoint))
    return path, sha, is_new


def _download(url: str, headers: dict[str, str], blob: Path, size: int | None, expected: tuple[str, str] | None,
              repo: str, name: str, progress: bool) -> str:
    """Fetch ``url`` into ``blob``, resuming ``blob.incomplete`` if an earlier pull left one;
    the blob appears only once its sha256 is right. Returns the sha256."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import silent_tqdm

    partial = blob.with_name(blob.name + ".incomplete")
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:
        partial.unlink()
        have = 0
    if size is not None:
        free = shutil.disk_usage(blob.parent).free
        if free < size - have:
            raise DownloadError(f"{name} needs {_fmt(size - have)} more disk space in {blob.parent}, and "
                                f"{_fmt(free)} is free; free some space, or set HF_HUB_CACHE (or HF_HOME) to a "
                                "folder on a larger disk, and pull again")
    try:
        with open(partial, "ab") as f:
            # resume_size makes http_get ask for a Range; it rewinds the file if the server ignores it.
            http_get(url, f, resume_size=have, headers=headers, expected_size=size, displayed_filename=name,
                     tqdm_class=None if progress else silent_tqdm)
    except OSError as e:
        if e.errno not in _DISK_FULL:
            raise
        written = partial.stat().st_size if partial.exists() else 0
        partial.unlink(missing_ok=True)  # no half file stays behind
        free = shutil.disk_usage(blob.parent).free
        need = f"{_fmt(size)} in all" if size is not None else "more"
        raise DownloadError(f"the disk ran out of space in {blob.parent} after {_fmt(written)} of {name} "
                            f"({e.strerror}); it needs {need} and {_fmt(free)} is free now that the partial "
                            "file is removed; free some space, or set HF_HUB_CACHE (or HF_HOME) to a folder "
                            "on a larger disk, and pull again") from None
    actual = _sha256(partial)
    if expected is not None and actual != expected[0]:
        partial.unlink()
        raise _mismatch(repo, name, expected, actual)
    fsync_file(partial)  # the blob's name promises its bytes: they reach the disk before it appears
    os.replace(partial, blob)
    fsync_dir(blob.parent)
    return actual


def _verify(blob: Path, expected: tuple[str, str] | None, repo: str, name: str) -> str:
    """Check a blob that was in the cache before this pull (another tool may have put it there)."""
    actual = _sha256(blob)
    if expected is not None and actual != expected[0]:
        blob.unlink()
        raise _mismatch(repo, name, expected, actual)
    return actual


def _verify_cached(pointer: Path, expected: tuple[str, str] | None, trusted: dict[str, str], repo: str) -> str:
    """The sha256 of a file already in the cache: from the manifest when we verified it before,
    else hashed and checked (against the blob's name, an LFS sha256, when nothing else is known)."""
    blob_name = Path(os.path.realpath(pointer)).name
    if expected is None and _SHA256.fullmatch(blob_name):
        expected = (blob_name, "the hub")
    known = trusted.get(str(pointer))
    if known is not None and (expected is None or known == expected[0]):
        return known
    actual = _sha256(pointer)
    if expected is not None and actual != expected[0]:
        _unlink_cached(pointer)
        _tidy(pointer)
        raise _mismatch(repo, pointer.name, expected, actual)
    return actual


def _pull_cached(ref: HubRef, store: ModelStore, cache: Path, trusted: dict[str, str],
                 reason: Exception) -> InstalledModel:
    """The hub is out of reach: resolve ``ref`` from the files the cache holds for ``main``."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    ref_file = _storage(cache, ref.repo) / "refs" / REVISION
    commit = ref_file.read_text().strip() if ref_file.is_file() else ""
    snapshot = _storage(cache, ref.repo) / "snapshots" / commit
    first = ref.file
    if first is None and commit and snapshot.is_dir():
        cached = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
        try:
            first = pick_file(ref.repo, cached, ref.quant)
        except UsageError:
            first = None
    if first is None:
        raise _not_cached(ref, cache, reason)
    paths, shas = [], []
    for name in split_parts(first) or [first]:
        try:
            path = Path(hf_hub_download(ref.repo, name, revision=REVISION, cache_dir=cache, local_files_only=True))
        except LocalEntryNotFoundError:
            raise _not_cached(ref, cache, reason) from None
        catalog_sha = ref.spec.sha256.get(name) if ref.spec else None
        shas.append(_verify_cached(path, (catalog_sha, "the catalog") if catalog_sha else None, trusted, ref.repo))
        paths.append(path)
    return _record(store, ref, paths, shas, commit, ref.quant or quant_of(first) or "", read_info(paths[0]))


def _record(store: ModelStore, ref: HubRef, paths: list[Path], shas: list[str], commit: str, quant: str,
            info: GGUFInfo) -> InstalledModel:
    model = InstalledModel(name=ref.name, files=[str(p) for p in paths], source="hub", repo=ref.repo,
                           revision=commit, quant=quant or info.file_type or "", sha256=shas,
                           size_bytes=sum(p.stat().st_size for p in paths),
                           license=(ref.spec.license if ref.spec else "") or info.license or "")
    store.add(model)
    return model


# --- errors -----------------------------------------------------------------------------------


def _unreachable() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be asked at all (then the cache answers)."""
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    return OfflineModeIsEnabled, httpx2.ConnectError, httpx2.TimeoutException


@contextmanager
def _translated_errors(ref: HubRef, endpoint: str | None, cache: Path) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions, as LocalLLMErrors that say what to do."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    hub = (endpoint or constants.ENDPOINT).rstrip("/")
    login = "run `hf auth login` or set HF_TOKEN"
    resume = "what was downloaded is kept, and the next pull resumes from there"
    try:
        yield
    except LocalLLMError:
        raise
    except GatedRepoError:
        raise DownloadError(f"hf.co/{ref.repo} is gated: accept its conditions at {hub}/{ref.repo} while logged "
                            f"in, then {login} with a token of that account, and pull again") from None
    except RepositoryNotFoundError:
        raise UsageError(f"hf.co/{ref.repo} was not found on {hub}: check the name (OWNER/REPO); "
                         f"if it is a private repo, {login}") from None
    except RevisionNotFoundError:
        raise UsageError(f"hf.co/{ref.repo} has no branch {REVISION!r} on {hub}") from None
    except RemoteEntryNotFoundError as e:
        file = str(e.response.url).rsplit("/", 1)[-1] if e.response is not None else ref.file
        raise UsageError(f"hf.co/{ref.repo} has no file {file}; `localllm pull hf.co/{ref.repo}` takes its "
                         "Q4_K_M file, and an unknown quant lists the ones there are") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        if status == 401:
            raise DownloadError(f"{hub} refused the token sent for hf.co/{ref.repo} (401): it is wrong or "
                                f"expired; {login} with a valid one") from None
        if status == 403:
            raise DownloadError(f"{hub} refused access to hf.co/{ref.repo} (403): the token lacks permission "
                                f"for it; {login} with a token that can read it") from None
        raise DownloadError(f"{hub} answered {status} for hf.co/{ref.repo}; try again later ({resume})") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        raise _not_cached(ref, cache, e) from None
    except httpx2.TransportError as e:
        raise DownloadError(f"the download of hf.co/{ref.repo} from {hub} broke off ({type(e).__name__}: {e}); "
                            f"check the connection (or HF_ENDPOINT, proxy settings) and pull again: {resume}") from None
    except PermissionError as e:
        raise DownloadError(f"cannot write {e.filename or cache} ({e.strerror}); make the Hugging Face cache "
                            "writable, or set HF_HUB_CACHE (or HF_HOME) to a folder you can write, and pull "
                            "again") from None
    except OSError as e:  # e.g. huggingface_hub's size check when the server sent too few bytes
        raise DownloadError(f"pulling hf.co/{ref.repo} into {cache} failed ({e}); pull again: {resume}") from None


def _not_cached(ref: HubRef, cache: Path, reason: Exception) -> DownloadError:
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(reason, OfflineModeIsEnabled):
        why, fix = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE and pull again"
    else:
        why, fix = (f"the hub cannot be reached ({type(reason).__name__})",
                    "check the connection (or HF_ENDPOINT, proxy settings) and pull again")
    return DownloadError(f"{why}, and {ref.name} is not in the Hugging Face cache {cache}; {fix}")


def _mismatch(repo: str, name: str, expected: tuple[str, str], actual: str) -> ModelLoadError:
    sha, source = expected
    if source == "the catalog":
        fix = (f"the file may have changed on the hub since the catalog was written: `localllm pull {repo}/{name}` "
               "checks it against the hub's own hash instead")
    else:
        fix = "it was damaged on the way: pull again"
    return ModelLoadError(f"{name} from {repo} has sha256 {actual}, but {source} says {sha}, "
                          f"so the file was deleted; {fix}")


# --- files ------------------------------------------------------------------------------------


def _unlink_cached(pointer: Path) -> int:
    """Remove a snapshot link, and its blob unless another snapshot of the repo links to it.
    Returns the bytes freed. Nothing outside an HF cache layout is touched."""
    snapshot = _snapshot_of(pointer)
    if snapshot is None:
        return 0
    storage = snapshot.parent.parent
    if not pointer.is_symlink():  # a cache without symlinks holds the file itself
        if not pointer.is_file():
            return 0
        size = pointer.stat().st_size
        pointer.unlink()
        return size
    blob = Path(os.path.abspath(pointer.parent / os.readlink(pointer)))
    pointer.unlink()
    if blob.parent != storage / "blobs" or not os.path.lexists(blob):
        return 0
    for other in (storage / "snapshots").rglob("*"):
        if other.is_symlink() and Path(os.path.abspath(other.parent / os.readlink(other))) == blob:
            return 0
    size = 0 if blob.is_symlink() else blob.stat().st_size  # a link into a shared store frees nothing here
    blob.unlink()
    return size


def _tidy(pointer: Path) -> None:
    """After a file left a snapshot: drop folders it leaves empty, refs to a snapshot that is
    gone (huggingface_hub's cache scan calls those corrupt), and the repo folder once empty."""
    snapshot = _snapshot_of(pointer)
    if snapshot is None:
        return
    storage = snapshot.parent.parent
    folder = pointer.parent
    while folder != snapshot.parent and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    if snapshot.exists():
        return
    for ref in (storage / "refs").rglob("*"):
        if ref.is_file() and ref.read_text().strip() == snapshot.name:
            ref.unlink()
    snapshots, blobs = storage / "snapshots", storage / "blobs"
    if not (snapshots.is_dir() and any(snapshots.iterdir())) and not (blobs.is_dir() and any(blobs.iterdir())):
        shutil.rmtree(storage)


def _snapshot_of(pointer: Path) -> Path | None:
    """``.../models--O--R/snapshots/<commit>`` above ``pointer``, or None outside an HF cache."""
    for parent in pointer.parents:
        if parent.parent.name == "snapshots" and parent.parent.parent.name.startswith("models--"):
            return parent
    return None


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> = commit, atomically: offline, huggingface_hub finds the snapshot through it.
    The temporary file lies in the repo folder, not in refs/, where huggingface_hub's cache scan
    would read one left by a killed pull as a ref to a missing commit."""
    path = storage / "refs" / revision
    if path.is_file() and path.read_text().strip() == commit:
        return
    write_atomic(path, commit.encode(), tmp_dir=storage)


def _storage(cache: Path, repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo, repo_type="model")


def _cache_dir(cache_dir: Path | None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser().resolve()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def _quants(names) -> str:
    found = {quant_of(n) for n in names if n.lower().endswith(".gguf")} - {None}
    return ", ".join(sorted(found)) or "none"


def _fmt(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} GB"
