"""logits_indices: one engine graph returns the logits of the tokens a step names ([N, V]), equal to
transformers' at those positions: each row's last token (the default), a few positions per row,
every position of a row, in a prefill and in a later step over the paged past."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import BLOCK_SIZE, FAMILIES
from llmc.errors import RequestError
from llmc.plugins.cpu.library import library_path
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams

ATOL = 1e-4
PROMPT_LENS = (23, 9, 40)  # 40 > tiny-mistral's sliding window (16); all span many 4-token blocks
CHUNK_LENS = (5, 1, 7)  # the second step: a chunk per row over its cached prompt


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    """[S, V]: transformers' logits at every position of `ids`."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


class _Rows:
    """Sequences on disjoint, shuffled blocks, and the padded step that computes a chunk of each."""

    def __init__(self, engine: Engine, seqs: list[list[int]], seed: int):
        self.engine, self.seqs = engine, seqs
        width = -(-max(map(len, seqs)) // BLOCK_SIZE)
        ids = np.random.default_rng(seed).choice(np.arange(1, engine.num_blocks), len(seqs) * width, replace=False)
        self.tables = ids.reshape(len(seqs), width).astype(np.int32)
        self.greedy_steps = 0

    def step(self, past: list[int], counts: list[int], logits_indices=None) -> tuple[np.ndarray, int]:
        """(logits, S) of computing tokens past[b]:past[b] + counts[b] of each row b."""
        seq = max(counts)
        ids = np.zeros((len(self.seqs), seq), np.int64)
        pos = np.zeros((len(self.seqs), seq), np.int64)
        for b, (s, p, n) in enumerate(zip(self.seqs, past, counts)):
            ids[b, :n] = s[p:p + n]
            pos[b] = np.minimum(p + np.arange(seq), p + n - 1)  # padding holds the row's last position
        logits = self.engine.forward(ids, pos, np.array(past, np.int32), np.array(counts, np.int32), self.tables,
                                     logits_indices)
        greedy = self.engine.greedy_tokens(logits)
        if greedy is not None:  # the graph's argmax, where it has the output, is each row's argmax
            np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))
        self.greedy_steps += greedy is not None
        return logits.copy(), seq


@pytest.mark.parametrize("recipe", FAMILIES)
def test_logits_at_chosen_positions_match_hf(recipe, engines, hf_models):
    hf, _ = hf_models(recipe)
    engine = Engine(engines(recipe))
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, engine.spec.vocab_size, n + c).tolist() for n, c in zip(PROMPT_LENS, CHUNK_LENS)]
    ref = [_hf_logits(hf, s) for s in seqs]
    rows = _Rows(engine, seqs, seed=8)
    zeros, prompts = [0] * len(seqs), list(PROMPT_LENS)

    # (a) The default: each row's last valid token of a ragged prefill, one row of logits per row.
    logits, seq = rows.step(zeros, prompts)
    assert logits.shape == (len(seqs), engine.spec.vocab_size)
    for b, n in enumerate(prompts):
        np.testing.assert_allclose(logits[b], ref[b][n - 1], atol=ATOL, rtol=0)

    # (b) The last 3 tokens of each row, rows asked for in reverse order.
    wanted = [(b, j) for b in reversed(range(len(seqs))) for j in range(prompts[b] - 3, prompts[b])]
    logits, seq = rows.step(zeros, prompts, [b * seq + j for b, j in wanted])
    assert logits.shape == (len(wanted), engine.spec.vocab_size)
    for row, (b, j) in zip(logits, wanted):
        np.testing.assert_allclose(row, ref[b][j], atol=ATOL, rtol=0)

    # (c) Every position of one row (the shortest, padded to the longest) of the batch.
    logits, seq = rows.step(zeros, prompts, 1 * seq + np.arange(prompts[1]))
    np.testing.assert_allclose(logits, ref[1][:prompts[1]], atol=ATOL, rtol=0)

    # (c) A later step over the paged past: every new token of every row.
    logits, seq = rows.step(prompts, list(CHUNK_LENS),
                            np.concatenate([b * max(CHUNK_LENS) + np.arange(c) for b, c in enumerate(CHUNK_LENS)]))
    expected = np.concatenate([r[n:n + c] for r, n, c in zip(ref, prompts, CHUNK_LENS)])
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
    assert engine.io.greedy_tokens == (library_path() is not None) and rows.greedy_steps == 4 * engine.io.greedy_tokens


def test_greedy_tokens_from_the_graph_or_from_the_logits_decode_alike(engines):
    """An engine built without the greedy_tokens output (greedy-tokens disabled, or built before it
    existed) loads, and its greedy decoding under in-flight batching is the same."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    outputs = []
    for disabled in ((), ("greedy-tokens",)):
        llm = LLM(engines("tiny-llama", *disabled))
        assert llm.engine.io.greedy_tokens == (not disabled and library_path() is not None)
        outputs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("recipe", FAMILIES)
def test_every_position_of_one_row_like_a_scoring_pass(recipe, engines, hf_models):
    """`llmc eval`'s call: one row of S tokens, logits_indices = arange(S); then the next S' tokens
    of the same sequence over its paged past, arange(S') again."""
    hf, _ = hf_models(recipe)
    engine = Engine(engines(recipe))
    tokens = np.random.default_rng(9).integers(3, engine.spec.vocab_size, 48).tolist()
    ref = _hf_logits(hf, tokens)
    rows = _Rows(engine, [tokens], seed=10)
    first, second = 37, 11
    logits, _ = rows.step([0], [first], np.arange(first))
    np.testing.assert_allclose(logits, ref[:first], atol=ATOL, rtol=0)
    logits, _ = rows.step([first], [second], np.arange(second))
    np.testing.assert_allclose(logits, ref[first:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("indices, message", [
    ([0, 8], "logits_indices holds 8, outside the step's 2x4 token grid (row b, token j is b*4 + j): "
             "each index must be 0 to 7"),
    ([-1], "logits_indices holds -1, outside the step's 2x4 token grid"),
    ([[0, 1]], "logits_indices must be a 1-D array of integer indices into the step's 2x4 token grid"),
    ([0.0, 1.0], "got 1-D float64"),
], ids=["past_the_grid", "negative", "2-D", "float"])
def test_bad_logits_indices_are_one_line_errors(llama_engine, indices, message):
    engine = Engine(llama_engine)
    rows = _Rows(engine, [[5, 6, 7, 8], [9, 10]], seed=11)
    with pytest.raises(RequestError) as info:
        rows.step([0, 0], [4, 2], np.array(indices))
    assert message in str(info.value) and "\n" not in str(info.value)
    logits, _ = rows.step([0, 0], [4, 2], [7, 5])  # the engine still serves: nothing was bound
    assert logits.shape == (2, engine.spec.vocab_size)


def test_steady_decode_binds_nothing_and_no_indices_compute_no_logits(llama_engine, monkeypatch):
    engine = Engine(llama_engine)
    rows = _Rows(engine, [list(range(3, 23)), list(range(30, 50))], seed=12)
    rows.step([0, 0], [16, 16])
    rows.step([16, 16], [1, 1])  # the decode shape's first step binds its buffers
    made = []
    real = engine.session.io_binding
    monkeypatch.setattr(engine.session, "io_binding", lambda: (made.append(1), real())[1])
    for p in (17, 18):  # steady decode, by default and with the same number of indices given
        assert rows.step([p, p], [1, 1])[0].shape == (2, engine.spec.vocab_size)
        assert rows.step([p, p], [1, 1], [1, 0])[0].shape == (2, engine.spec.vocab_size)
    assert made == []
    # A step that samples nothing (a prefill chunk before the prompt's end) asks for no logits:
    # a new shape, bound once (each shape keeps its own binding, so going back binds nothing).
    none, _ = rows.step([19, 19], [1, 1], [])
    assert none.shape == (0, engine.spec.vocab_size) and made == [1]
