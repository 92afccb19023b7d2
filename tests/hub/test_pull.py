"""localllm.hub against a fake hub on a loopback port: pulls by alias and by hf.co name, resume,
sha256 checks, offline use, a full disk, split files, hub errors, import and removal."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fake_hub import GOOD_TOKEN, tiny_gguf

from localllm.catalog import Catalog, parse_hub_name
from localllm.errors import DownloadError, ModelLoadError, UsageError
from localllm.hub import import_local, pull, remove_files
from localllm.store import InstalledModel

GEMMA_SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_REPO, GEMMA_FILE = "acme/gemma-3-270m-GGUF", "gemma-3-270m-q4_k_m.gguf"
TINY_REPO = "acme/tiny-GGUF"
MiB = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_catalog(tmp_path: Path, alias: str, repo: str, files: dict[str, str], sha256: dict[str, str],
                  license: str = "") -> Catalog:
    path = tmp_path / "models.toml"
    path.write_text(f'[models."{alias}"]\nrepo = "{repo}"\n'
                    f"files = {{ {', '.join(f'{q} = {f!r}' for q, f in files.items())} }}\n"
                    f"sha256 = {{ {', '.join(f'{f!r} = {s!r}' for f, s in sha256.items())} }}\n"
                    f'license = "{license}"\n')
    return Catalog.load(path)


@pytest.fixture
def tiny_repo(hub_env):
    """Three quants of a tiny GGUF, and a README that is no model."""
    files = {"tiny-Q4_K_M.gguf": tiny_gguf(64 * 1024, 1), "tiny-Q8_0.gguf": tiny_gguf(96 * 1024, 2),
             "tiny-IQ2_XS.gguf": tiny_gguf(32 * 1024, 3), "README.md": b"# tiny\n"}
    repo = hub_env.hub.add_repo(TINY_REPO, files)
    return files, repo.commit


def pull_tiny(hub_env, name: str, **kwargs) -> InstalledModel:
    ref = parse_hub_name(name, Catalog({}, ""))
    return pull(ref, hub_env.store, progress=False, endpoint=hub_env.hub.url, **kwargs)


# --- 1. a catalog alias, with the real model ----------------------------------------------------


@pytest.mark.model
def test_pull_by_catalog_alias_lands_in_the_hf_cache(hub_env, gemma_path, tmp_path):
    commit = hub_env.hub.add_repo(GEMMA_REPO, {GEMMA_FILE: gemma_path}).commit
    catalog = write_catalog(tmp_path, "gemma3:270m", GEMMA_REPO, {"Q4_K_M": GEMMA_FILE}, {GEMMA_FILE: GEMMA_SHA},
                            license="gemma")

    model = pull(parse_hub_name("gemma3:270m", catalog), hub_env.store, progress=False, endpoint=hub_env.hub.url)

    storage = hub_env.storage(GEMMA_REPO)
    path = storage / "snapshots" / commit / GEMMA_FILE
    size = gemma_path.stat().st_size
    assert model == InstalledModel(name="gemma3:270m", files=[str(path)], source="hub", repo=GEMMA_REPO,
                                   revision=commit, quant="Q4_K_M", sha256=[GEMMA_SHA], size_bytes=size,
                                   license="gemma")
    assert hub_env.store.list() == [model]
    assert json.loads((hub_env.home / "data" / "models.json").read_text())["models"][0]["files"] == [str(path)]
    assert os.readlink(path) == f"../../blobs/{GEMMA_SHA}"
    assert filecmp.cmp(path, gemma_path, shallow=False)
    assert hub_env.cache_files(GEMMA_REPO) == [f"blobs/{GEMMA_SHA}", "refs/main", f"snapshots/{commit}/{GEMMA_FILE}"]
    assert (storage / "refs" / "main").read_text() == commit
    assert hub_env.hub.bytes_sent(GEMMA_FILE) == size  # fetched exactly once


# --- 2. hf.co names ---------------------------------------------------------------------------


def test_pull_by_hub_name_with_and_without_quant(hub_env, tiny_repo):
    files, commit = tiny_repo
    snapshot = hub_env.storage(TINY_REPO) / "snapshots" / commit

    q8 = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:q8_0")
    default = pull_tiny(hub_env, f"hf.co/{TINY_REPO}")

    assert q8 == InstalledModel(name=f"hf.co/{TINY_REPO}:Q8_0", files=[str(snapshot / "tiny-Q8_0.gguf")],
                                source="hub", repo=TINY_REPO, revision=commit, quant="Q8_0",
                                sha256=[sha(files["tiny-Q8_0.gguf"])], size_bytes=96 * 1024)
    assert default == InstalledModel(name=f"hf.co/{TINY_REPO}:Q4_K_M", files=[str(snapshot / "tiny-Q4_K_M.gguf")],
                                     source="hub", repo=TINY_REPO, revision=commit, quant="Q4_K_M",
                                     sha256=[sha(files["tiny-Q4_K_M.gguf"])], size_bytes=64 * 1024)
    assert (snapshot / "tiny-Q8_0.gguf").read_bytes() == files["tiny-Q8_0.gguf"]
    assert (snapshot / "tiny-Q4_K_M.gguf").read_bytes() == files["tiny-Q4_K_M.gguf"]
    assert [m.name for m in hub_env.store.list()] == [f"hf.co/{TINY_REPO}:Q4_K_M", f"hf.co/{TINY_REPO}:Q8_0"]
    assert hub_env.hub.gets("tiny-IQ2_XS.gguf") == [] and hub_env.hub.gets("README.md") == []


def test_pull_by_owner_repo_file(hub_env, tiny_repo):
    files, commit = tiny_repo
    model = pull_tiny(hub_env, f"{TINY_REPO}/tiny-IQ2_XS.gguf")
    assert (model.name, model.quant, model.sha256) == (f"{TINY_REPO}/tiny-IQ2_XS.gguf", "IQ2_XS",
                                                       [sha(files["tiny-IQ2_XS.gguf"])])


def test_pulling_a_complete_model_again_downloads_nothing(hub_env, tiny_repo):
    first = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    num_requests = len(hub_env.hub.requests)
    again = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    assert again == first
    # Only the file list is asked for: no HEAD, no GET of the file.
    assert [(r.method, r.path) for r in hub_env.hub.requests[num_requests:]] == [
        ("GET", f"/api/models/{TINY_REPO}/revision/main")]


def test_progress_bar_shows_size_and_speed(hub_env, tiny_repo, capfd, monkeypatch):
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub draws bars on a non-terminal then
    pull(parse_hub_name(f"hf.co/{TINY_REPO}:Q8_0", Catalog({}, "")), hub_env.store, progress=True,
         endpoint=hub_env.hub.url)
    bar = capfd.readouterr().err
    assert "tiny-Q8_0.gguf: 100%" in bar and "98.3k/98.3k" in bar and "B/s]" in bar
    pull_tiny(hub_env, f"hf.co/{TINY_REPO}:IQ2_XS")
    assert capfd.readouterr().err == ""


def test_cdn_redirect_keeps_the_token_at_the_hub(hub_env, monkeypatch):
    data = tiny_gguf(256 * 1024)
    hub_env.hub.add_repo("acme/gated-GGUF", {"g-Q4_K_M.gguf": data}, gated=True)
    hub_env.hub.redirect = True
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)

    model = pull_tiny(hub_env, "hf.co/acme/gated-GGUF")

    assert model.path.read_bytes() == data
    auth = {(r.method, r.path.split("/")[1]): r.authorization for r in hub_env.hub.requests}
    assert auth == {("GET", "api"): f"Bearer {GOOD_TOKEN}", ("HEAD", "acme"): f"Bearer {GOOD_TOKEN}",
                    ("GET", "cdn"): None}


# --- 3. resume ----------------------------------------------------------------------------------


@pytest.mark.model
def test_interrupted_pull_resumes_instead_of_starting_over(hub_env, gemma_path, tmp_path):
    hub_env.hub.add_repo(GEMMA_REPO, {GEMMA_FILE: gemma_path})
    catalog = write_catalog(tmp_path, "gemma3:270m", GEMMA_REPO, {"Q4_K_M": GEMMA_FILE}, {GEMMA_FILE: GEMMA_SHA})
    ref = parse_hub_name("gemma3:270m", catalog)
    size = gemma_path.stat().st_size
    served = hub_env.hub.file(GEMMA_REPO, GEMMA_FILE)
    served.drop_after = 100 * MiB + 12345  # the connection breaks mid-file ...
    served.fail_after_drop = 1  # ... and huggingface_hub's own retry finds the hub down: the pull fails

    with pytest.raises(DownloadError, match="answered 503 .*what was downloaded is kept, and the next pull "
                                            "resumes from there"):
        pull(ref, hub_env.store, progress=False, endpoint=hub_env.hub.url)

    partial = hub_env.storage(GEMMA_REPO) / "blobs" / f"{GEMMA_SHA}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept <= 100 * MiB + 12345
    assert hub_env.cache_files(GEMMA_REPO) == [f"blobs/{GEMMA_SHA}.incomplete"]
    assert hub_env.store.list() == []

    model = pull(ref, hub_env.store, progress=False, endpoint=hub_env.hub.url)

    last = hub_env.hub.gets(GEMMA_FILE)[-1]
    assert (last.range, last.status, last.bytes_sent) == (f"bytes={kept}-", 206, size - kept)
    assert hub_env.hub.bytes_sent(GEMMA_FILE) < 1.1 * size
    assert model.sha256 == [GEMMA_SHA] and filecmp.cmp(model.path, gemma_path, shallow=False)
    assert not partial.exists()


def test_dropped_connection_is_resumed_within_one_pull(hub_env):
    """huggingface_hub's http_get retries a broken stream with a Range request, from the last
    whole chunk it wrote (DOWNLOAD_CHUNK_SIZE, 10 MiB)."""
    from huggingface_hub import constants

    data = tiny_gguf(40 * MiB)
    hub_env.hub.add_repo(TINY_REPO, {"tiny-Q4_K_M.gguf": data})
    hub_env.hub.file(TINY_REPO, "tiny-Q4_K_M.gguf").drop_after = 25 * MiB

    model = pull_tiny(hub_env, f"hf.co/{TINY_REPO}")

    resumed_at = 25 * MiB // constants.DOWNLOAD_CHUNK_SIZE * constants.DOWNLOAD_CHUNK_SIZE
    assert [(r.range, r.status, r.bytes_sent) for r in hub_env.hub.gets("tiny-Q4_K_M.gguf")] == [
        (None, 200, 25 * MiB), (f"bytes={resumed_at}-", 206, 40 * MiB - resumed_at)]
    assert model.path.read_bytes() == data


def test_killed_pull_resumes_in_the_next_process(hub_env):
    data = tiny_gguf(40 * MiB)
    hub_env.hub.add_repo(TINY_REPO, {"tiny-Q4_K_M.gguf": data})
    served = hub_env.hub.file(TINY_REPO, "tiny-Q4_K_M.gguf")
    served.stall_after = 21 * MiB
    code = ("from localllm import paths\nfrom localllm.catalog import HubRef\nfrom localllm.hub import pull\n"
            "from localllm.store import ModelStore\n"
            f"pull(HubRef({TINY_REPO!r}, quant='Q4_K_M'), ModelStore(paths.models_manifest()), progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert served.stalled.wait(60), "the pull never reached the pause"
        partial = hub_env.storage(TINY_REPO) / "blobs" / f"{sha(data)}.incomplete"
        # http_get writes whole 10 MiB chunks: wait until the first two are on disk, then kill.
        for _ in range(200):
            if partial.exists() and partial.stat().st_size == 20 * MiB:
                break
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
    finally:
        served.release.set()
    assert partial.stat().st_size == 20 * MiB

    model = pull_tiny(hub_env, f"hf.co/{TINY_REPO}")

    assert [(r.range, r.status) for r in hub_env.hub.gets("tiny-Q4_K_M.gguf")][-1] == (f"bytes={20 * MiB}-", 206)
    assert hub_env.hub.gets("tiny-Q4_K_M.gguf")[-1].bytes_sent == 20 * MiB
    assert hub_env.hub.bytes_sent("tiny-Q4_K_M.gguf") < 1.1 * len(data)
    assert model.path.read_bytes() == data and not partial.exists()


# --- 4. sha256 --------------------------------------------------------------------------------


def test_catalog_sha_that_the_hub_contradicts_downloads_nothing(hub_env, tiny_repo, tmp_path):
    files, _ = tiny_repo
    wrong = "0" * 64
    catalog = write_catalog(tmp_path, "tiny", TINY_REPO, {"Q4_K_M": "tiny-Q4_K_M.gguf"}, {"tiny-Q4_K_M.gguf": wrong})

    with pytest.raises(ModelLoadError) as e:
        pull(parse_hub_name("tiny", catalog), hub_env.store, progress=False, endpoint=hub_env.hub.url)

    assert str(e.value) == (
        f"tiny-Q4_K_M.gguf in {TINY_REPO}: the catalog expects sha256 {wrong}, but the hub's file has "
        f"{sha(files['tiny-Q4_K_M.gguf'])}, so nothing was downloaded. The file changed on the hub after the "
        f"catalog was written: `localllm pull {TINY_REPO}/tiny-Q4_K_M.gguf` takes the hub's version")
    assert hub_env.hub.gets("tiny-Q4_K_M.gguf") == []
    assert hub_env.cache_files(TINY_REPO) == [] and hub_env.store.list() == []


@pytest.mark.parametrize("fault", ["hub advertises a wrong sha256", "bytes damaged on the way"])
def test_bytes_that_do_not_match_are_deleted(hub_env, tiny_repo, fault):
    files, _ = tiny_repo
    served = hub_env.hub.file(TINY_REPO, "tiny-Q8_0.gguf")
    true_sha = sha(files["tiny-Q8_0.gguf"])
    if fault == "bytes damaged on the way":
        served.corrupt = True
        damaged = bytearray(files["tiny-Q8_0.gguf"])
        damaged[len(damaged) // 2] ^= 0xFF
        expected, actual = true_sha, sha(bytes(damaged))
    else:
        served.advertised_sha256 = expected = "ab" * 32
        actual = true_sha

    with pytest.raises(ModelLoadError) as e:
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")

    assert str(e.value) == (f"tiny-Q8_0.gguf from {TINY_REPO} has sha256 {actual}, but the hub says {expected}, "
                            "so the file was deleted; it was damaged on the way: pull again")
    assert hub_env.hub.bytes_sent("tiny-Q8_0.gguf") == 96 * 1024  # it was downloaded, then thrown away
    assert hub_env.cache_files(TINY_REPO) == [] and hub_env.store.list() == []


def test_catalog_sha_checked_after_download(hub_env, tiny_repo, tmp_path):
    """The hub agrees with the catalog, but the bytes that arrive match neither."""
    files, _ = tiny_repo
    hub_env.hub.file(TINY_REPO, "tiny-Q4_K_M.gguf").corrupt = True
    good = sha(files["tiny-Q4_K_M.gguf"])
    catalog = write_catalog(tmp_path, "tiny", TINY_REPO, {"Q4_K_M": "tiny-Q4_K_M.gguf"}, {"tiny-Q4_K_M.gguf": good})

    with pytest.raises(ModelLoadError) as e:
        pull(parse_hub_name("tiny", catalog), hub_env.store, progress=False, endpoint=hub_env.hub.url)
    assert re.fullmatch(
        f"tiny-Q4_K_M.gguf from {TINY_REPO} has sha256 [0-9a-f]{{64}}, but the catalog says {good}, so the file "
        f"was deleted; the file may have changed on the hub since the catalog was written: `localllm pull "
        f"{TINY_REPO}/tiny-Q4_K_M.gguf` checks it against the hub's own hash instead", str(e.value)), str(e.value)
    assert hub_env.cache_files(TINY_REPO) == [] and hub_env.store.list() == []


def test_damaged_file_already_in_the_cache_is_caught_and_replaced(hub_env, tiny_repo):
    files, commit = tiny_repo
    model = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    hub_env.store.remove(model.name)  # no manifest entry vouches for it now
    blob = Path(os.path.realpath(model.path))
    blob.write_bytes(b"GGUF" + b"\0" * 100)  # another tool, or a disk, spoiled it

    with pytest.raises(ModelLoadError, match="tiny-Q8_0.gguf from .* but the hub says"):
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    assert not blob.exists() and not model.path.is_symlink()

    again = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    assert again == model and model.path.read_bytes() == files["tiny-Q8_0.gguf"]


# --- 5. names that do not match ---------------------------------------------------------------


def test_unknown_quant_lists_the_quants_there_are(hub_env, tiny_repo):
    with pytest.raises(UsageError) as e:
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q5_K_M")
    assert str(e.value) == (f"{TINY_REPO} has no Q5_K_M GGUF file; the quants there are: IQ2_XS, Q4_K_M, Q8_0 "
                            f"(pull one with hf.co/{TINY_REPO}:QUANT)")
    assert hub_env.cache_files(TINY_REPO) == []


def test_catalog_file_missing_from_the_repo(hub_env, tiny_repo, tmp_path):
    catalog = write_catalog(tmp_path, "tiny", TINY_REPO, {"Q4_K_M": "tiny-q4_k_m-old.gguf"}, {})
    with pytest.raises(UsageError) as e:
        pull(parse_hub_name("tiny", catalog), hub_env.store, progress=False, endpoint=hub_env.hub.url)
    assert str(e.value) == (f"{TINY_REPO} has no file tiny-q4_k_m-old.gguf (the catalog entry 'tiny' names it); "
                            f"the quants there are: IQ2_XS, Q4_K_M, Q8_0 (pull one with "
                            f"`localllm pull hf.co/{TINY_REPO}:QUANT`)")


# --- 6. offline ---------------------------------------------------------------------------------


@pytest.mark.model
def test_offline_pull_resolves_from_the_cache_and_the_model_runs(hub_env, gemma_path, tmp_path):
    hub_env.hub.add_repo(GEMMA_REPO, {GEMMA_FILE: gemma_path})
    catalog = write_catalog(tmp_path, "gemma3:270m", GEMMA_REPO, {"Q4_K_M": GEMMA_FILE}, {GEMMA_FILE: GEMMA_SHA})
    online = pull(parse_hub_name("gemma3:270m", catalog), hub_env.store, progress=False, endpoint=hub_env.hub.url)
    num_requests = len(hub_env.hub.requests)

    # A fresh interpreter, so huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE as it does for a user.
    code = ("import json, dataclasses\nfrom pathlib import Path\nfrom localllm import paths\n"
            "from localllm.catalog import Catalog, parse_hub_name\nfrom localllm.hub import pull\n"
            "from localllm.store import ModelStore\n"
            f"ref = parse_hub_name('gemma3:270m', Catalog.load(Path({str(tmp_path / 'models.toml')!r})))\n"
            "print(json.dumps(dataclasses.asdict(pull(ref, ModelStore(paths.models_manifest()), progress=False))))\n")
    proc = hub_env.run_python(code, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert InstalledModel(**json.loads(proc.stdout)) == online
    assert len(hub_env.hub.requests) == num_requests  # not one request reached the hub

    from localllm.config import CacheConfig, EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=online.path, cache=CacheConfig(n_ctx=512), n_threads=2))
    try:
        out = engine.generate([engine.tokenizer.encode("The capital of France is")],
                              SamplingParams(temperature=0.0, max_tokens=4))[0]
    finally:
        engine.close()
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    assert out.text.strip()


def test_offline_in_process_uses_the_cache_or_says_what_is_missing(hub_env, tiny_repo, monkeypatch):
    from huggingface_hub import constants

    online = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    num_requests = len(hub_env.hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    assert pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0") == online
    with pytest.raises(DownloadError) as e:
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}:IQ2_XS")
    assert str(e.value) == (f"HF_HUB_OFFLINE is set, and hf.co/{TINY_REPO}:IQ2_XS is not in the Hugging Face "
                            f"cache {hub_env.cache}; unset HF_HUB_OFFLINE and pull again")
    assert len(hub_env.hub.requests) == num_requests


def test_unreachable_hub_falls_back_to_the_cache(hub_env, tiny_repo):
    online = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    ref = parse_hub_name(f"hf.co/{TINY_REPO}:Q8_0", Catalog({}, ""))
    assert pull(ref, hub_env.store, progress=False, endpoint=dead) == online

    with pytest.raises(DownloadError) as e:
        pull(parse_hub_name("hf.co/acme/never-pulled", Catalog({}, "")), hub_env.store, progress=False, endpoint=dead)
    assert str(e.value) == ("the hub cannot be reached (ConnectError), and hf.co/acme/never-pulled:Q4_K_M is not in "
                            f"the Hugging Face cache {hub_env.cache}; check the connection (or HF_ENDPOINT, proxy "
                            "settings) and pull again")


# --- 7. a full disk ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real 20 MiB filesystem (tmpfs). Mounting needs root; test_full_disk_file_size_limit
    covers the same code path without it."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_file_bigger_than_the_disk_is_refused_before_downloading(hub_env, small_disk):
    hub_env.hub.add_repo(TINY_REPO, {"tiny-Q4_K_M.gguf": tiny_gguf(30 * MiB)})
    cache = small_disk / "hub"

    with pytest.raises(DownloadError, match=r"^tiny-Q4_K_M.gguf needs 31.5 MB more disk space in .*small/hub/"
                                            r"models--acme--tiny-GGUF/blobs, and 2\d.\d MB is free; free some space, "
                                            r"or set HF_HUB_CACHE \(or HF_HOME\) to a folder on a larger disk"):
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}", cache_dir=cache)
    assert hub_env.hub.gets("tiny-Q4_K_M.gguf") == []
    assert [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock" and p.name != "CACHEDIR.TAG"] == []


def test_disk_filling_up_mid_download_leaves_no_partial_file(hub_env, small_disk):
    data = tiny_gguf(16 * MiB)
    hub_env.hub.add_repo(TINY_REPO, {"tiny-Q4_K_M.gguf": data})
    served = hub_env.hub.file(TINY_REPO, "tiny-Q4_K_M.gguf")
    served.stall_after = 1 * MiB
    cache = small_disk / "hub"
    filler = small_disk / "filler"

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(pull_tiny, hub_env, f"hf.co/{TINY_REPO}", cache_dir=cache)
        assert served.stalled.wait(30)
        # Something else takes the disk while the download waits on the network.
        filler.write_bytes(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - 4 * MiB))
        served.release.set()
        with pytest.raises(DownloadError) as e:
            job.result(60)

    assert re.fullmatch(
        r"the disk ran out of space in .*/small/hub/models--acme--tiny-GGUF/blobs after [1-4]\.\d MB of "
        r"tiny-Q4_K_M.gguf \(No space left on device\); it needs 16.8 MB in all and 4.2 MB is free now that the "
        r"partial file is removed; free some space, or set HF_HUB_CACHE \(or HF_HOME\) to a folder on a larger "
        r"disk, and pull again", str(e.value)), str(e.value)
    blobs = cache / "models--acme--tiny-GGUF" / "blobs"
    assert list(blobs.iterdir()) == [] and hub_env.store.list() == []

    filler.unlink()
    model = pull_tiny(hub_env, f"hf.co/{TINY_REPO}", cache_dir=cache)
    assert model.path.read_bytes() == data


def test_full_disk_file_size_limit(hub_env):
    """The same failure without root: RLIMIT_FSIZE makes the write fail with EFBIG."""
    hub_env.hub.add_repo(TINY_REPO, {"tiny-Q4_K_M.gguf": tiny_gguf(24 * MiB)})
    code = ("import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))\n"
            "from localllm import paths\nfrom localllm.catalog import HubRef\nfrom localllm.hub import pull\n"
            "from localllm.errors import LocalLLMError\nfrom localllm.store import ModelStore\n"
            f"try:\n    pull(HubRef({TINY_REPO!r}, quant='Q4_K_M'), ModelStore(paths.models_manifest()),"
            " progress=False)\n"
            "except LocalLLMError as e:\n    print(type(e).__name__, e)\n")
    proc = hub_env.run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("DownloadError the disk ran out of space in ")
    assert "(File too large); it needs 25.2 MB in all" in proc.stdout
    assert hub_env.cache_files(TINY_REPO) == [] and hub_env.store.list() == []


# --- 8. split files -----------------------------------------------------------------------------


def test_split_model_pulls_every_part_in_order(hub_env):
    parts = {f"big-Q4_K_M-0000{i + 1}-of-00003.gguf": tiny_gguf(48 * 1024, i, split=(i, 3)) for i in range(3)}
    commit = hub_env.hub.add_repo("acme/big-GGUF", {**parts, "big-Q8_0.gguf": tiny_gguf(1024, 9)}).commit

    model = pull_tiny(hub_env, "hf.co/acme/big-GGUF")

    snapshot = hub_env.storage("acme/big-GGUF") / "snapshots" / commit
    assert model.files == [str(snapshot / name) for name in parts]
    assert model.sha256 == [sha(data) for data in parts.values()]
    assert model.size_bytes == 3 * 48 * 1024 and model.quant == "Q4_K_M"
    assert [Path(f).read_bytes() for f in model.files] == list(parts.values())


def test_split_model_with_a_part_missing_on_the_hub(hub_env):
    hub_env.hub.add_repo("acme/big-GGUF", {"big-Q4_K_M-00001-of-00002.gguf": tiny_gguf(1024, split=(0, 2))})
    with pytest.raises(UsageError, match="^acme/big-GGUF has no file big-Q4_K_M-00002-of-00002.gguf; the quants "
                                         "there are: Q4_K_M"):
        pull_tiny(hub_env, "hf.co/acme/big-GGUF")
    assert hub_env.hub.gets("big-Q4_K_M-00001-of-00002.gguf") == []


def test_pulled_file_that_is_no_gguf_model_is_not_kept(hub_env):
    hub_env.hub.add_repo(TINY_REPO, {"tiny-Q4_K_M.gguf": b"<html>an error page, saved as a model</html>"})
    with pytest.raises(ModelLoadError, match=f"^hf.co/{TINY_REPO}:Q4_K_M is no model localllm can load, so the "
                                             "files this pull downloaded were deleted again: .*tiny-Q4_K_M.gguf "
                                             "is not a GGUF file"):
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}")
    assert hub_env.cache_files(TINY_REPO) == [] and hub_env.store.list() == []


# --- 9. hub errors, import, removal -----------------------------------------------------------


@pytest.mark.parametrize("token", [None, "hf_not_granted"])
def test_gated_repo_says_how_to_log_in(hub_env, monkeypatch, token):
    hub_env.hub.add_repo("acme/gated-GGUF", {"g-Q4_K_M.gguf": tiny_gguf()}, gated=True)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(DownloadError) as e:
        pull_tiny(hub_env, "hf.co/acme/gated-GGUF")
    assert str(e.value) == (f"hf.co/acme/gated-GGUF is gated: accept its conditions at {hub_env.hub.url}/acme/"
                            "gated-GGUF while logged in, then run `hf auth login` or set HF_TOKEN with a token of "
                            "that account, and pull again")
    assert e.value.exit_code == 1


def test_gated_repo_with_a_granted_token(hub_env, monkeypatch):
    hub_env.hub.add_repo("acme/gated-GGUF", {"g-Q4_K_M.gguf": tiny_gguf()}, gated=True)
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    assert pull_tiny(hub_env, "hf.co/acme/gated-GGUF").path.read_bytes() == tiny_gguf()


def test_missing_repo(hub_env):
    with pytest.raises(UsageError) as e:
        pull_tiny(hub_env, "hf.co/acme/no-such-GGUF")
    assert str(e.value) == (f"hf.co/acme/no-such-GGUF was not found on {hub_env.hub.url}: check the name "
                            "(OWNER/REPO); if it is a private repo, run `hf auth login` or set HF_TOKEN")


def test_file_listed_but_missing_answers_404(hub_env, tiny_repo):
    hub_env.hub.file(TINY_REPO, "tiny-Q8_0.gguf").gone = True
    with pytest.raises(UsageError) as e:
        pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    assert str(e.value) == (f"hf.co/{TINY_REPO} has no file tiny-Q8_0.gguf; `localllm pull hf.co/{TINY_REPO}` "
                            "takes its Q4_K_M file, and an unknown quant lists the ones there are")
    assert hub_env.cache_files(TINY_REPO) == []


def test_import_local_records_the_file_where_it_is(hub_env, tmp_path):
    path = tmp_path / "models" / "my-model-Q5_K_M.gguf"
    path.parent.mkdir()
    path.write_bytes(tiny_gguf(8192))

    model = import_local(path, hub_env.store)

    assert model == InstalledModel(name="my-model-Q5_K_M", files=[str(path)], source="local", quant="Q5_K_M",
                                   size_bytes=8192)
    assert hub_env.store.get("my-model-Q5_K_M") == model
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["models.json", "my-model-Q5_K_M.gguf"]
    assert remove_files(model) == 0 and path.read_bytes() == tiny_gguf(8192)

    other = tmp_path / "elsewhere" / "my-model-Q5_K_M.gguf"
    other.parent.mkdir()
    other.write_bytes(tiny_gguf(4096))
    with pytest.raises(UsageError, match=f"^a model named 'my-model-Q5_K_M' is installed already \\({path}\\); "
                                         "rename my-model-Q5_K_M.gguf, or remove the other with `localllm rm"):
        import_local(other, hub_env.store)
    assert import_local(path, hub_env.store) == model  # importing the same file again changes nothing


def test_import_local_split_and_refusals(hub_env, tmp_path):
    for i in range(2):
        (tmp_path / f"m-0000{i + 1}-of-00002.gguf").write_bytes(tiny_gguf(2048, i, split=(i, 2)))
    model = import_local(tmp_path / "m-00002-of-00002.gguf", hub_env.store)
    assert (model.name, model.files) == ("m", [str(tmp_path / "m-00001-of-00002.gguf"),
                                              str(tmp_path / "m-00002-of-00002.gguf")])

    (tmp_path / "x-00001-of-00002.gguf").write_bytes(tiny_gguf(split=(0, 2)))
    with pytest.raises(ModelLoadError, match="^x-00001-of-00002.gguf is one of 2 parts of a split model, and "
                                             "x-00002-of-00002.gguf is not in "):
        import_local(tmp_path / "x-00001-of-00002.gguf", hub_env.store)

    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match=r"junk.gguf is not a GGUF file \(bad magic b'PK\\x03\\x04'"):
        import_local(tmp_path / "junk.gguf", hub_env.store)
    (tmp_path / "v4.gguf").write_bytes(b"GGUF" + (4).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ModelLoadError, match="v4.gguf is not a valid GGUF file: GGUF version 4 is not supported"):
        import_local(tmp_path / "v4.gguf", hub_env.store)
    with pytest.raises(ModelLoadError, match="nothing.gguf does not exist"):
        import_local(tmp_path / "nothing.gguf", hub_env.store)
    assert [m.name for m in hub_env.store.list()] == ["m"]


def test_remove_files_deletes_only_that_models_blobs(hub_env, tiny_repo):
    from huggingface_hub import scan_cache_dir

    files, commit = tiny_repo
    q8 = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    q4 = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q4_K_M")

    assert remove_files(q8) == 96 * 1024
    assert hub_env.cache_files(TINY_REPO) == sorted([f"blobs/{sha(files['tiny-Q4_K_M.gguf'])}", "refs/main",
                                                     f"snapshots/{commit}/tiny-Q4_K_M.gguf"])
    assert q4.path.read_bytes() == files["tiny-Q4_K_M.gguf"]
    scan = scan_cache_dir(hub_env.cache)
    assert scan.warnings == [] and [r.nb_files for r in scan.repos] == [1]

    assert remove_files(q4) == 64 * 1024
    assert not hub_env.storage(TINY_REPO).exists()
    assert scan_cache_dir(hub_env.cache).repos == frozenset()


def test_remove_files_keeps_files_another_installed_model_uses(hub_env, tiny_repo, tmp_path):
    files, _ = tiny_repo
    catalog = write_catalog(tmp_path, "tiny", TINY_REPO, {"Q4_K_M": "tiny-Q4_K_M.gguf"}, {})
    alias = pull(parse_hub_name("tiny", catalog), hub_env.store, progress=False, endpoint=hub_env.hub.url)
    by_name = pull_tiny(hub_env, f"hf.co/{TINY_REPO}")
    assert alias.files == by_name.files  # one file in the cache, two names for it

    assert remove_files(by_name, keep=alias.files) == 0
    assert alias.path.read_bytes() == files["tiny-Q4_K_M.gguf"]


def test_remove_files_keeps_a_blob_another_snapshot_links_to(hub_env, tiny_repo):
    files, first_commit = tiny_repo
    old = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    new_commit = hub_env.hub.new_commit(TINY_REPO)  # main moves on; the file is unchanged
    new = pull_tiny(hub_env, f"hf.co/{TINY_REPO}:Q8_0")
    assert new.revision == new_commit and os.path.realpath(new.path) == os.path.realpath(old.path)
    assert hub_env.hub.bytes_sent("tiny-Q8_0.gguf") == 96 * 1024  # the blob was linked, not fetched again

    assert remove_files(new) == 0
    assert old.path.read_bytes() == files["tiny-Q8_0.gguf"]
    assert hub_env.cache_files(TINY_REPO) == [f"blobs/{sha(files['tiny-Q8_0.gguf'])}",
                                              f"snapshots/{first_commit}/tiny-Q8_0.gguf"]
