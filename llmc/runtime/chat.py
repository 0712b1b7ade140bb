"""Chat templates: messages -> the prompt's token ids, rendered as transformers renders them
(sandboxed Jinja with trim_blocks and lstrip_blocks, `add_generation_prompt`, `raise_exception`)
and tokenized without adding special tokens, as `apply_chat_template(tokenize=True)` does."""

from __future__ import annotations

from pathlib import Path

from llmc.errors import LlmcError, RequestError, check_unicode, first_line
from llmc.runtime.llm import Prompt


# The template variables the renderer sets itself (and raise_exception, its global).
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})


class ChatTemplate:
    def __init__(self, text: str, source: Path):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(text)
        except TemplateError as exc:
            raise LlmcError(f"chat template {source} does not parse ({first_line(exc)}); fix it or pass another "
                            "with --chat-template FILE") from None

    @classmethod
    def of(cls, llm, override: str | Path | None = None) -> "ChatTemplate | None":
        """The override's template, else the engine's; None when it has none."""
        path = Path(override) if override else llm.engine.files.chat_template
        if path is None:
            return None
        try:
            return cls(path.read_text(), path)
        except OSError as exc:
            raise LlmcError(f"cannot read chat template {path} ({first_line(exc)})") from None

    def prompt(self, llm, messages: list[dict], variables: dict | None = None) -> Prompt:
        """The messages rendered and tokenized: a RequestError says what is wrong with them.
        `variables`: more of the template's variables (a request's chat_template_kwargs, e.g.
        Qwen3's enable_thinking); the ones the renderer sets are refused."""
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_unicode(value, f"messages[{i}].{key}", RequestError)
        given = dict(variables or {})
        if taken := sorted(set(given) & RESERVED):
            raise RequestError(f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets "
                               f"{', '.join(sorted(RESERVED))}")
        try:
            text = self.template.render(**given, messages=messages, add_generation_prompt=True, bos_token="",
                                        eos_token="")
        except Exception as exc:  # the template's own raise_exception, or a message it cannot handle
            raise RequestError(f"the chat template cannot render these messages ({first_line(exc)})") from None
        check_unicode(text, "the rendered chat prompt", RequestError)  # a surrogate from deeper in a message
        return Prompt(text, llm.encode(text, add_special_tokens=False))
