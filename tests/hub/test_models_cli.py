"""`localllm pull` / `ls` / `show` / `rm` and MODEL names, as a person types them: the real
command in a subprocess, against the fake hub, with the real GGUF test models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_pull import GEMMA_FILE, GEMMA_REPO, GEMMA_SHA

pytestmark = pytest.mark.model

ALIAS = "gemma3:test"


def localllm(hub_env, *args: str, catalog: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub_env.hub.url, "HF_HUB_CACHE": str(hub_env.cache),
           "LOCALLLM_HOME": str(hub_env.home)}
    if catalog is not None:
        env["LOCALLLM_CATALOG"] = str(catalog)
    return subprocess.run([sys.executable, "-m", "localllm.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def gemma_hub(hub_env, gemma_path, tmp_path) -> Path:
    """The real Gemma file on the fake hub, and a catalog naming it ALIAS; returns the catalog."""
    hub_env.hub.add_repo(GEMMA_REPO, {GEMMA_FILE: gemma_path})
    catalog = tmp_path / "models.toml"
    catalog.write_text(f'default = "{ALIAS}"\n[models."{ALIAS}"]\nrepo = "{GEMMA_REPO}"\n'
                       f'files = {{ Q4_K_M = "{GEMMA_FILE}" }}\nsha256 = {{ "{GEMMA_FILE}" = "{GEMMA_SHA}" }}\n'
                       'context = 32768\nlicense = "gemma"\n')
    return catalog


def test_pull_ls_show_run_rm_round_trip(hub_env, gemma_hub, gemma_path):
    missing = localllm(hub_env, "run", ALIAS, "Hello", catalog=gemma_hub)
    assert missing.returncode == 2
    assert missing.stderr.strip().endswith(f"{ALIAS} is not installed yet; run `localllm pull {ALIAS}`")

    pulled = localllm(hub_env, "pull", ALIAS, "--quiet", catalog=gemma_hub)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.startswith(f"pulled {ALIAS}: ")
    assert "253.1 MB" in pulled.stdout

    listed = localllm(hub_env, "ls", "--json", catalog=gemma_hub)
    [record] = json.loads(listed.stdout)
    assert record["name"] == ALIAS and record["source"] == "hub" and record["present"] is True
    assert (record["architecture"], record["quant"], record["context_length"]) == ("gemma3", "Q4_K_M", 32768)
    assert record["size_bytes"] == gemma_path.stat().st_size
    assert Path(record["files"][0]).read_bytes()[:4] == b"GGUF"
    table = localllm(hub_env, "ls", catalog=gemma_hub).stdout.splitlines()
    assert table[0].split() == ["NAME", "QUANT", "SIZE", "ARCH", "PARAMS", "CONTEXT", "SOURCE"]
    assert table[1].split()[:5] == [ALIAS, "Q4_K_M", "253.1", "MB", "gemma3"]
    assert table[1].split()[-2:] == ["32,768", GEMMA_REPO]

    shown = localllm(hub_env, "show", ALIAS, catalog=gemma_hub)
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) if " " in line else (line, "") for line in shown.stdout.splitlines())
    assert fields["name"].strip() == ALIAS  # the installed name, not the file's general.name
    assert fields["architecture"].strip() == "gemma3"
    assert fields["source"].strip() == f"hub ({GEMMA_REPO})"
    assert "none" in shown.stdout.split("chat template", 1)[1]

    ran = localllm(hub_env, "run", ALIAS, "The capital of France is", "--max-tokens", "4", "--temperature", "0",
                   "--threads", "2", catalog=gemma_hub)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip()

    asks = localllm(hub_env, "rm", ALIAS, catalog=gemma_hub)
    assert asks.returncode == 2 and "add -y" in asks.stderr
    assert json.loads(localllm(hub_env, "ls", "--json").stdout)[0]["name"] == ALIAS  # kept

    removed = localllm(hub_env, "rm", ALIAS, "-y", catalog=gemma_hub)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == f"removed {ALIAS} · freed 253.1 MB"
    assert json.loads(localllm(hub_env, "ls", "--json").stdout) == []
    assert not [f for f in hub_env.cache_files(GEMMA_REPO) if f.startswith("blobs/")]
    assert "no models installed" in localllm(hub_env, "ls").stdout


def test_a_local_file_is_imported_where_it_is(hub_env, qwen_path):
    imported = localllm(hub_env, "pull", qwen_path)
    assert imported.returncode == 0, imported.stderr
    name = qwen_path.name.removesuffix(".gguf")
    assert imported.stdout.startswith(f"imported {name}: {qwen_path} (not copied)")

    [record] = json.loads(localllm(hub_env, "ls", "--json").stdout)
    assert record["files"] == [str(qwen_path)] and record["source"] == "local"
    assert (record["architecture"], record["context_length"]) == ("qwen2", 32768)

    template = localllm(hub_env, "show", name, "--template")
    assert template.returncode == 0 and "<|im_start|>" in template.stdout

    assert localllm(hub_env, "rm", name, "-y").returncode == 0
    assert qwen_path.is_file()  # an imported file is the person's own: never deleted


def test_catalog_listing_and_bad_names(hub_env):
    listing = localllm(hub_env, "pull", "--list")
    assert listing.returncode == 0
    aliases = [line.split()[0] for line in listing.stdout.splitlines()[1:-1]]
    assert len(aliases) >= 12 and "qwen2.5-coder:0.5b" in aliases
    assert "qwen2.5-coder:0.5b *" in listing.stdout

    bad = localllm(hub_env, "pull", "not-a-model")
    assert bad.returncode == 2 and "not a catalog alias" in bad.stderr
    unknown = localllm(hub_env, "show", "nothing-here")
    assert unknown.returncode == 2 and "`localllm ls` lists installed models" in unknown.stderr
    no_rm = localllm(hub_env, "rm", "nothing-here", "-y")
    assert no_rm.returncode == 2 and "no installed model 'nothing-here'" in no_rm.stderr


def test_removing_one_name_keeps_a_file_another_name_uses(hub_env, tmp_path):
    from fake_hub import tiny_gguf

    hub_env.hub.add_repo("acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny_gguf(64 * 1024, 1)})
    catalog = tmp_path / "tiny.toml"
    catalog.write_text('[models."tiny:1"]\nrepo = "acme/tiny-GGUF"\nfiles = { Q4_K_M = "tiny-Q4_K_M.gguf" }\n')
    for name in ("tiny:1", "hf.co/acme/tiny-GGUF"):
        assert localllm(hub_env, "pull", name, "--quiet", catalog=catalog).returncode == 0
    both = json.loads(localllm(hub_env, "ls", "--json").stdout)
    assert [m["name"] for m in both] == ["hf.co/acme/tiny-GGUF:Q4_K_M", "tiny:1"]
    assert both[0]["files"] == both[1]["files"]

    removed = localllm(hub_env, "rm", "tiny:1", "-y", catalog=catalog)
    assert removed.stdout.strip() == "removed tiny:1"  # nothing freed: the other name uses the file
    [left] = json.loads(localllm(hub_env, "ls", "--json").stdout)
    assert left["name"] == "hf.co/acme/tiny-GGUF:Q4_K_M" and left["present"] is True
