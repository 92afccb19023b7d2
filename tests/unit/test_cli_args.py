"""The CLI's edge: each model command's options become the EngineConfig it passes on (the
command itself is replaced, so nothing loads a model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm import cli

# command line -> the module whose entry point receives the EngineConfig first
COMMANDS = [
    (["run", "m.gguf", "hi"], "localllm.commands.run.run"),
    (["bench", "m.gguf"], "localllm.commands.bench.bench"),
    (["serve", "--model", "m.gguf"], "localllm.commands.serve.serve"),
    (["chat", "m.gguf"], "localllm.commands.chat.chat"),
]


@pytest.fixture
def engine_configs(monkeypatch) -> list:
    """The EngineConfigs the commands were called with, in order."""
    seen = []
    monkeypatch.setattr(cli, "_model_path", lambda name: Path(name))
    for _, target in COMMANDS:
        monkeypatch.setattr(target, lambda config, *args, **kwargs: seen.append(config) or 0)
    return seen


@pytest.mark.parametrize("argv, target", COMMANDS, ids=[c[0][0] for c in COMMANDS])
def test_no_spec_turns_speculative_decoding_off(engine_configs, argv, target):
    assert cli.main(argv) == 0
    assert cli.main([*argv, "--no-spec"]) == 0
    assert [c.speculative for c in engine_configs] == [True, False]


@pytest.mark.parametrize("command", [c[0][0] for c in COMMANDS])
def test_no_spec_is_in_the_help_of_every_model_command(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert "--no-spec             turn off prompt-lookup speculative decoding\n" in capsys.readouterr().out
