"""Chat templates: messages -> the prompt's token ids, rendered as transformers renders them and
tokenized without adding special tokens, as `apply_chat_template(tokenize=True)` does.

transformers' renderer is sandboxed Jinja with trim_blocks and lstrip_blocks, the loop-controls
extension (`break`, `continue`) and its `{% generation %}` tag (SmolLM3's template marks the
assistant's turns with it), a `tojson` that keeps non-ASCII text as it is, the globals
`raise_exception` and `strftime_now` (Llama 3.1's date line), and as variables the tokenizer's
special tokens (`bos_token`: Gemma's and Llama 3's templates open with it) beside
`add_generation_prompt` and `tools` / `documents` (None: the server takes no tools). The same environment is built here without importing transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from llmc.errors import LlmcError, RequestError, check_unicode, first_line
from llmc.runtime.prompts import Prompt

# The template variables the renderer sets itself (and raise_exception, its global).
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                      "raise_exception"})
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # transformers' special_tokens_map


def _environment():
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers tracks the assistant's text with it
        (return_assistant_tokens_mask); rendering, it is its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


class ChatTemplate:
    def __init__(self, text: str, source: Path):
        from jinja2.exceptions import TemplateError

        try:
            self.template = _environment().from_string(text)
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

    def render(self, messages: list[dict], special_tokens: dict[str, str], variables: dict | None = None) -> str:
        """The messages as the template writes them: a RequestError says what is wrong with them.
        `special_tokens`: the tokenizer's (SPECIAL_TOKENS, those it has); `variables`: more of the
        template's variables (a request's chat_template_kwargs, e.g. Qwen3's enable_thinking); the
        ones the renderer sets are refused."""
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_unicode(value, f"messages[{i}].{key}", RequestError)
        given = dict(variables or {})
        if taken := sorted(set(given) & RESERVED):
            raise RequestError(f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets "
                               f"{', '.join(sorted(RESERVED))}", field="chat_template_kwargs")
        try:
            # tools and documents None, not undefined, as transformers passes them (`tools is none`).
            text = self.template.render(**{**special_tokens, **given}, messages=messages, tools=None, documents=None,
                                        add_generation_prompt=True)
        except Exception as exc:  # the template's own raise_exception, or a message it cannot handle
            raise RequestError(f"the chat template cannot render these messages ({first_line(exc)})",
                               field="messages") from None
        check_unicode(text, "the rendered chat prompt", RequestError)  # a surrogate from deeper in a message
        return text

    def prompt(self, llm, messages: list[dict], variables: dict | None = None) -> Prompt:
        """The messages rendered with the engine's special tokens, and tokenized."""
        tokenizer = llm.engine.manifest.tokenizer
        special = {name: getattr(tokenizer, name) for name in SPECIAL_TOKENS if getattr(tokenizer, name) is not None}
        text = self.render(messages, special, variables)
        return Prompt(text, llm.encode(text, add_special_tokens=False))
