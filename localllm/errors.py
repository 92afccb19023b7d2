"""The one exception family. Every message names the thing, the reason and the fix."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Base of every error localllm raises on purpose.

    ``exit_code`` is what the CLI exits with: 2 for a user mistake (bad usage, bad
    input), 1 for a runtime failure.
    """

    exit_code = 1


class UsageError(LocalLLMError):
    """The user asked for something malformed: a nonsense option value, a bad parameter."""

    exit_code = 2


class ParameterError(UsageError):
    """A request's parameter has a value the engine cannot take; ``param`` names it (a door
    puts it in its error, as OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(LocalLLMError):
    """A model file is missing, is not GGUF, is truncated, or llama.cpp refused it."""

    exit_code = 2


class ContextOverflowError(LocalLLMError):
    """A request can never fit: its prompt plus max_tokens exceed the context or the KV cache."""

    exit_code = 2


class TemplateError(LocalLLMError):
    """The model's chat template is missing, or threw while rendering (it is untrusted code)."""

    exit_code = 2


class NoChatTemplateError(TemplateError):
    """The model has no chat template at all. Its message names no command or flag: each door
    adds what its caller can do instead (the CLI: run without --chat; the server: send a plain
    prompt to /v1/completions)."""


class EngineError(LocalLLMError):
    """The engine failed at run time (llama.cpp returned an error, the engine thread died)."""

    exit_code = 1


class DownloadError(LocalLLMError):
    """A pull failed: the hub cannot be reached or refused access, or the disk is full."""

    exit_code = 1


class ModelNotFound(UsageError):
    """A request named a model that is not served here (a door answers 404); the message lists
    the names that are."""


class ModelTooLarge(ModelLoadError):
    """A model cannot fit even with every model that may be unloaded unloaded; the message says
    how much it needs, how much could be free, and what to change."""


class ModelBusy(LocalLLMError):
    """The memory a model needs is held by models with requests in flight, and they stayed busy
    past the manager's wait; or an unload was asked of a model that is serving (a door: 503)."""

    exit_code = 1
