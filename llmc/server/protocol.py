"""The OpenAI request bodies `llmc serve` accepts, checked field by field, and the error body.

A field that is wrong answers 400 with OpenAI's error shape naming the field (`param`); what the
runtime refuses later (a prompt over the context, a bad stop list) answers the same way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from llmc.runtime.sampling import MAX_LOGPROBS, SamplingParams


# How pydantic names the members of these models' unions in an error's location (`prompt`'s,
# `stop`'s): not part of the field's path that an error body names.
UNION_MEMBERS = {"str", "int", "list[int]", "list[str]", "list[list[int]]"}

# The values of the unimplemented fields that leave the output as it is.
_NO_EFFECT = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
              "logit_bias": (None, {}), "best_of": (None, 1), "echo": (False,), "suffix": (None, ""),
              "tools": (None, []), "response_format": (None, {"type": "text"})}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields llmc has no use for

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Fields that change the output, which llmc does not implement: taken at the value that
    # changes nothing, refused otherwise (ignoring them would answer another question).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """A field sent as null takes its default, as in OpenAI's API: `"temperature": null` was a
        400 saying None is not a number."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator(*_NO_EFFECT, check_fields=False)  # fields only one endpoint has are declared on its request
    @classmethod
    def _unimplemented(cls, value, info: ValidationInfo):
        neutral = _NO_EFFECT[info.field_name]
        if info.field_name == "best_of":  # the best n of n is all n
            neutral = (*neutral, info.data.get("n"))
        if value not in neutral:
            raise ValueError(f"llmc does not implement {info.field_name}; leave it out")
        return value

    @property
    def token_limit_field(self) -> str:
        """The field that holds the request's token limit, which a refusal about it names."""
        return "max_tokens"

    @property
    def token_limit(self) -> int | None:
        return getattr(self, self.token_limit_field)

    def sampling(self, index: int, default_max_tokens: int) -> SamplingParams:
        """The i-th of the request's n choices: seeded choices get seeds of their own."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.token_limit or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k,
                              seed=None if self.seed is None else self.seed + index, stop=stop,
                              ignore_eos=self.ignore_eos, logprobs=self.top_logprobs_wanted)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many top log-probabilities per token the request asks for (None: no logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)  # one prompt, or several
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's completions default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: text, or token ids, each."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool calls...: passed to the template as given

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # chat's newer name for max_tokens
    tools: list | None = None
    response_format: dict | None = None
    # More variables for the chat template (vLLM's extension), e.g. Qwen3's {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
