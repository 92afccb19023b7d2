"""The CLI's edge: each model command's options become the EngineConfig it passes on (the
command itself is replaced, so nothing loads a model)."""

from __future__ import annotations

import logging
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


@pytest.fixture
def fresh_logger():
    """The package's logger with no handler yet, as in a new process; restored after."""
    logger = logging.getLogger("localllm")
    saved = logger.handlers[:], logger.level
    logger.handlers.clear()
    yield logger
    logger.handlers[:], logger.level = saved[0], saved[1]


@pytest.mark.parametrize("value, level", [(None, "INFO"), ("debug", "DEBUG"), (" Warning ", "WARNING"),
                                          ("", "INFO")])
def test_localllm_log_sets_the_level(fresh_logger, monkeypatch, value, level):
    if value is None:
        monkeypatch.delenv("LOCALLLM_LOG", raising=False)
    else:
        monkeypatch.setenv("LOCALLLM_LOG", value)
    cli._log_to_stderr()
    assert fresh_logger.level == getattr(logging, level)


def test_an_unknown_localllm_log_logs_at_info_and_says_so(fresh_logger, monkeypatch, capsys):
    monkeypatch.setenv("LOCALLLM_LOG", "verbose")
    cli._log_to_stderr()
    assert fresh_logger.level == logging.INFO
    assert capsys.readouterr().err == (
        "localllm: WARNING: LOCALLLM_LOG=verbose is not one of debug, info, warning, error; logging at info\n")
