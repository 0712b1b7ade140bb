"""What a request may ask for, checked before it queues: the prompt's forms, its tokens against the
model's vocabulary, and its length against the engine's context and KV pool. Each problem is a
one-line RequestError naming the field to fix. Reads nothing a step changes, so a server calls it
off its event loop while a step runs.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from llmc.errors import RequestError, check_unicode
from llmc.runtime.kv_cache import blocks_for

# Texts from this many characters up are tokenized with the GIL released (see encode).
LONG_TEXT = 10_000

FORMS = "a prompt may be a non-empty str, or a non-empty list of int token ids"


class Prompt(NamedTuple):
    """A prompt checked and tokenized: its text (None when given as ids) and ids."""
    text: str | None
    ids: list[int]


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) >= LONG_TEXT:  # encode holds the GIL throughout (seconds for megabytes); encode_batch does not
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def tokenize(tokenizer, prompt: str | Sequence[int] | Prompt) -> Prompt:
    """The prompt checked and tokenized; anything else is a RequestError saying what a prompt may be."""
    if isinstance(prompt, Prompt):
        return prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty; pass at least one character of text", field="prompt")
        check_unicode(prompt, "prompt", RequestError, FORMS)
        return Prompt(prompt, encode(tokenizer, prompt))
    if isinstance(prompt, (bytes, bytearray)):  # a sequence of ints: it would run as one token id per byte
        raise RequestError(f"prompt is {type(prompt).__name__}; decode it to a str first ({FORMS})", field="prompt")
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence):
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):  # a bool is an int, never a token
                raise RequestError(f"prompt token {i} is {t!r:.40} ({type(t).__name__}), not an int token id; "
                                   f"{FORMS}", field="prompt")
        ids = [int(t) for t in prompt]
    else:
        kind = (f"a {prompt.ndim}-D numpy array of {prompt.dtype}" if isinstance(prompt, np.ndarray)
                else "None" if prompt is None else f"of type {type(prompt).__name__}")
        raise RequestError(f"prompt is {kind}; {FORMS}", field="prompt")
    if not ids:
        raise RequestError("prompt is empty; pass at least one token id", field="prompt")
    return Prompt(None, ids)


def as_batch(prompts) -> tuple[list, bool]:
    """(the prompts as a list, whether one prompt was given rather than a list of them)."""
    if isinstance(prompts, Prompt):
        single = True
    elif isinstance(prompts, np.ndarray):
        single = prompts.ndim != 2  # a 2-D array is a batch of token-id rows
    elif isinstance(prompts, (list, tuple)):  # a batch, unless it is one prompt of (would-be) token ids
        single = len(prompts) > 0 and isinstance(prompts[0], (int, float, np.number, np.bool_))
    else:
        single = True  # a str, or a bad prompt that tokenize explains
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise RequestError("no prompts given; pass a string or a list of strings")
    return batch, single


def check_fits(prompt: Prompt, params, *, tokenizer, vocab_size: int, max_context: int,
               block_size: int, pool_blocks: int) -> None:
    """The prompt's tokens are in the vocabulary, and it and its max_tokens fit the context and the pool."""
    text, ids = prompt
    if len(ids) >= max_context:
        raise RequestError(f"prompt is {len(ids)} tokens but the engine's max context is {max_context}; "
                           "shorten the prompt or rebuild with a larger --max-context", field="prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None and text is not None:  # the tokenizer knows tokens the model has no embedding for
        raise RequestError(f"the prompt encodes to token {tokenizer.id_to_token(bad)!r} (id {bad}), "
                           f"outside the model's vocabulary (0..{vocab_size - 1}); remove it from the prompt",
                           field="prompt")
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", field="prompt")
    if len(ids) + params.max_tokens > max_context:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                           f"engine's max context {max_context}; lower max_tokens to {max_context - len(ids)} or less",
                           field="max_tokens")
    worst = blocks_for(len(ids) + params.max_tokens, block_size)
    if worst > pool_blocks:
        raise RequestError(f"request needs up to {worst} KV blocks but the pool has {pool_blocks}; "
                           "raise kv_cache_blocks / kv_cache_bytes or lower max_tokens", field="max_tokens")
