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
    """A request (prompt or sampling parameters) is invalid. `field` names the request field it is
    about (a sampling parameter, "prompt", "messages", ...; None: the request as a whole), which is
    what a server reports as the error's `param`."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for wrapping
    a library's multi-line error into one of ours."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_unicode(text: str, what: str, error: type[LlmcError] = LlmcError, hint: str = "") -> None:
    """Raise `error` when `text` holds an unpaired surrogate (valid in a Python str, not in Unicode):
    the tokenizer would reject it with a TypeError that names neither the text nor the fix."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise error(f"{what} has an unpaired surrogate {text[exc.start]!r} at index {exc.start}, which is not "
                    f"valid Unicode; remove it{f' ({hint})' if hint else ''}") from None
