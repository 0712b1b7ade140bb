import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmc.runtime.detokenize import IncrementalDetokenizer, find_stop, stop_holdback

EOS = "<|eos|>"
CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "A naive cafe serves coffee; the end is near, said the fox.",
    "Tokenizers split words into pieces and pieces into bytes.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    # Byte-level BPE with a small vocabulary: unseen characters (accents, CJK, emoji) fall back to
    # single-byte tokens, so multibyte characters really are split across tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    return tok


def _stream(tokenizer, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_ascii_deltas_concatenate_to_full_decode(tokenizer):
    ids = tokenizer.encode("Hello world, the quick brown fox.").ids
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert deltas[-1] == ""  # nothing was held back


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café 東京 🙂"
    ids = tokenizer.encode(text).ids
    # The test only means something if some character really is split across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)

    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete


def test_prompt_context(tokenizer):
    prompt = tokenizer.encode("The quick brown").ids
    generated = tokenizer.encode(" fox naïve 🙂 café").ids
    deltas = _stream(tokenizer, generated, prompt_ids=prompt)
    assert "".join(deltas) == tokenizer.decode(generated) == " fox naïve 🙂 café"


def test_special_tokens(tokenizer):
    eos = tokenizer.token_to_id(EOS)
    ids = tokenizer.encode("Hello").ids + [eos] + tokenizer.encode(" world").ids
    assert "".join(_stream(tokenizer, ids)) == "Hello world"
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == tokenizer.decode(
        ids, skip_special_tokens=False
    )


def test_trailing_partial_character_comes_out_on_flush(tokenizer):
    ids = tokenizer.encode("ok 🙂").ids[:-2]  # cut the emoji's bytes short
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids)


def test_random_token_streams_match_full_decode(tokenizer):
    # Random ids include stray UTF-8 continuation bytes and special tokens: the invariant still holds.
    rng = np.random.default_rng(0)
    vocab = tokenizer.get_vocab_size()
    for _ in range(200):
        ids = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


class _CountingTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small(tokenizer):
    ids = tokenizer.encode("naïve café 東京 🙂 " * 50).ids
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, prompt_ids=tokenizer.encode("The quick brown fox").ids)
    for i in ids:
        detok.add(i)
    assert len(ids) > 300
    assert max(counting.sizes) <= 10  # the window spans at most one split character plus context
    assert detok.text == tokenizer.decode(ids)


def test_find_stop():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("hello world", [], 0) is None
    assert find_stop("a STOP b END", ["END", "STOP"], 0) == 2  # earliest start wins, not list order
    # Text before start - longest_stop + 1 was searched by earlier calls and is skipped.
    assert find_stop("STOP and more text", ["STOP"], start=10) is None
    assert find_stop("xxSTOP", ["STOP"], start=5) == 2


def test_stop_found_across_delta_boundaries(tokenizer):
    text = "Hello world, the end is near."
    stop = "lo wor"  # the pre-tokenizer splits at the space, so this straddles two deltas
    full = ""
    found = None
    for delta in _stream(tokenizer, tokenizer.encode(text).ids):
        assert stop not in delta
        start, full = len(full), full + delta
        found = find_stop(full, [stop, "never"], start)
        if found is not None:
            break
    assert found == text.index(stop)


def test_stop_holdback():
    assert stop_holdback("Hello wo", ["world"]) == 2
    assert stop_holdback("Hello", ["xyz"]) == 0
    assert stop_holdback("ab", ["abc"]) == 2
    assert stop_holdback("xab", ["abc", "bq"]) == 2
    assert stop_holdback("xa", ["abc", "bq"]) == 1
    assert stop_holdback("abc", ["abc"]) == 0  # a complete stop is find_stop's job
    assert stop_holdback("anything", ["\n"]) == 0
    assert stop_holdback("", ["abc"]) == 0


def test_streaming_never_leaks_part_of_a_stop(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stops = ["lazy dog", "quiet"]  # "lazy" and " dog" arrive as separate deltas
    want = "The quick brown fox jumps over the "
    emitted, full = "", ""
    held = 0
    for delta in _stream(tokenizer, tokenizer.encode(text).ids):
        start, full = len(full), full + delta
        hit = find_stop(full, stops, start)
        if hit is not None:
            emitted += full[len(emitted) : hit]
            break
        hold = stop_holdback(full, stops)
        held = max(held, hold)
        emitted += full[len(emitted) : len(full) - hold]
        assert want.startswith(emitted)  # no piece of "lazy" ever went out
    assert emitted == want
    assert held >= len("lazy")  # the tail was withheld while it could still become the stop
