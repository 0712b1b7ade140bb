"""User-facing errors.

Every problem a user can cause (bad model path, corrupt engine, bad sampling values, a prompt
longer than the context, ...) is raised as an LlmcError whose message is one line naming the
problem and the fix. The CLI prints it without a traceback; library users can catch it.
"""


class LlmcError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ModelError(LlmcError):
    """The model reference cannot be loaded or is not supported."""


class EngineError(LlmcError):
    """The engine directory is missing, corrupt or incompatible."""


class RequestError(LlmcError, ValueError):
    """A request (prompt or sampling parameters) is invalid."""
