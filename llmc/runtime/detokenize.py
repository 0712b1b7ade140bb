"""Streaming detokenization and stop-string helpers.

Decoding the whole output after every token is O(n) per token; IncrementalDetokenizer decodes
only a short window of recent ids (the prefix-offset / read-offset technique): `prefix_offset`
marks where the window starts and `read_offset` where the already-emitted text ends. The text of
the new tokens is decode(window) minus decode(window up to read_offset). Decoding with a little
left context matters: decoders such as Metaspace render a token differently at the very start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["IncrementalDetokenizer", "find_stop", "stop_holdback"]

# Prompt tokens kept as left context for decoding the first generated tokens.
_PROMPT_CONTEXT = 5

# What a decoder produces for an incomplete UTF-8 sequence; seeing it at the end of the window
# means a multibyte character is split across tokens and more bytes are on the way.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    The concatenation of everything `add` and `flush` return equals
    `tokenizer.decode(generated_ids, skip_special_tokens=...)`, and no delta ends inside a
    multibyte character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Only the tail of the prompt is ever decoded, so only the tail is kept.
        self._ids: list[int] = [int(i) for i in (prompt_ids or [])[-_PROMPT_CONTEXT:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is split)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return text still held back at the end of generation.

        Only non-empty when the output ends in an incomplete UTF-8 sequence, which a full decode
        also renders as U+FFFD.
        """
        return self._emit(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _emit(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        prefix = self._prefix_text
        window = self._decode(self._prefix_offset, len(self._ids))
        # A skipped special token adds nothing; a trailing U+FFFD is half a character.
        if len(window) <= len(prefix) or (window.endswith(_REPLACEMENT) and not final):
            return ""
        delta = window[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        self._chunks.append(delta)
        return delta


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index where the earliest stop string begins in text, or None.

    `start` is where the text not yet searched begins (its length before the latest delta). An
    earlier match would have been found by an earlier call, so only text from
    start - longest_stop + 1 on is searched: enough to catch a stop that straddles the boundary.
    """
    if not stops:
        return None
    begin = max(0, start - max(len(s) for s in stops) + 1)
    best: int | None = None
    for stop in stops:
        i = text.find(stop, begin)
        if i != -1 and (best is None or i < best):
            best = i
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text to withhold from a stream: the longest suffix that is
    a proper prefix of some stop string, since the next delta could complete that stop."""
    hold = 0
    for stop in stops:
        # Only lengths beyond the current best can change the answer.
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
