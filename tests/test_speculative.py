"""Speculative decoding: lossless against plain decoding, in flight, for both proposers."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from llmc.errors import LlmcError, RequestError
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.llm import LLM
from llmc.runtime.request import Request
from llmc.runtime.sampling import Draws, Sampler, SamplingParams, distribution, sample_from, verify
from llmc.runtime.speculative import EPOCH, PROBE_STEPS, NgramProposer, Speculator, _Bucket
from llmc.runtime.step import Row

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=48, chunk_size=16)
# code-small repeats itself after this prompt (and copies from its input: docs/speculative.md),
# so prompt lookup finds proposals it accepts.
REPETITIVE = "        self.assertEqual("


@pytest.fixture(scope="module")
def code_engines(engines):
    return engines("code-small"), engines("code-draft")


@pytest.fixture(scope="module")
def narrow_draft(engines):
    """code-draft whose LM head scores only the 512 most frequent tokens (--draft-vocab)."""
    return engines("code-draft", draft_vocab=512)


def _mixed_workload(llm: LLM):
    """24 requests over held-out-style code: shared prefixes (prefix hits), prompts longer than a
    chunk, repetitive prompts (n-gram hits), exact max_tokens, stop tokens and stop strings."""
    base = ("def read_config(path):\n    with open(path) as f:\n        return f.read()\n\n"
            "def write_config(path, text):\n    with open(path, 'w') as f:\n        f.write(text)\n\n")
    tails = ["def read_lines(path):\n", "class Config:\n    def __init__(self, path):\n", "import os\n\n",
             "for i in range(10):\n    print(i)\n", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "if __name__ == '__main__':\n"]
    rng = np.random.default_rng(0)
    prompts, params = [], []
    for i in range(24):
        text = (base if i % 2 == 0 else "") + tails[i % len(tails)] * int(rng.integers(1, 4))
        prompts.append(llm.encode(text))
        params.append(SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=i % 3 != 0))
    return prompts, params


def _with_stops(prompts, params, plain):
    """Give some requests a stop string or stop token taken from the middle of their plain
    output, so speculative runs must stop inside an accepted run exactly where plain ones do."""
    out = list(params)
    for i in range(0, len(params), 4):
        text = plain[i].text
        if len(text) > 12:
            out[i] = SamplingParams(max_tokens=params[i].max_tokens, stop=text[len(text) // 2:len(text) // 2 + 3])
    for i in range(2, len(params), 4):
        ids = plain[i].token_ids
        if len(ids) > 4:
            out[i] = SamplingParams(max_tokens=params[i].max_tokens, stop_token_ids=[ids[len(ids) // 2]],
                                    ignore_eos=True)
    return out


def _run_in_flight(llm: LLM, prompts, params):
    outputs, pending, step = {}, list(range(len(prompts))), 0
    while pending or llm.has_unfinished():
        while pending and pending[0] <= 2 * step:  # arrivals spread over the first steps
            i = pending.pop(0)
            outputs[i] = llm.output(llm.add_request(prompts[i], params[i]))
        llm.step()
        step += 1
        llm.blocks.check([r.block_table for r in llm.scheduler.running])
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("proposer", ["ngram", "draft", "draft-vocab"])
def test_greedy_speculation_in_flight_matches_plain_decoding(code_engines, narrow_draft, proposer):
    target, draft = code_engines
    spec = {"ngram": "ngram", "draft": str(draft), "draft-vocab": str(narrow_draft)}[proposer]
    plain_llm = LLM(target, enable_prefix_caching=False)
    prompts, params = _mixed_workload(plain_llm)
    plain = [plain_llm.generate(p, sp) for p, sp in zip(prompts, params)]
    params = _with_stops(prompts, params, plain)
    plain = [plain_llm.generate(p, sp) for p, sp in zip(prompts, params)]
    assert {o.finish_reason for o in plain} == {"stop", "length"}

    # Not adaptive, so every step speculates; a pool small enough to preempt. The narrow draft
    # drafts every row itself; the other takes prompt lookup's proposals where there are some.
    llm = LLM(target, speculative=spec, num_speculative_tokens=4, speculative_adaptive=False,
              draft_prompt_lookup=proposer != "draft-vocab", kv_cache_blocks=48, **SMALL)
    outs = _run_in_flight(llm, prompts, params)
    for i, (a, b) in enumerate(zip(plain, outs)):
        assert b.token_ids == a.token_ids, i
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason), i
    proposed = sum(o.metrics.proposed_tokens for o in outs)
    accepted = sum(o.metrics.accepted_tokens for o in outs)
    assert 0 < accepted < proposed  # both verification paths ran
    assert llm.scheduler.num_preemptions > 0
    # The engine's counts (the server's metrics) see each prompt once and each kept token once,
    # through preemption and recompute and whatever verification kept.
    assert llm.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert llm.generated_tokens == sum(len(o.token_ids) for o in outs)
    assert any(o.prefix_hit_tokens > 0 for o in outs)
    assert llm.blocks.num_free == llm.blocks.capacity  # rolled-back and finished blocks all returned
    llm.blocks.check([])
    if proposer != "ngram":
        blocks = llm.speculator.proposer.blocks
        assert blocks.num_free == blocks.capacity


def test_a_narrow_draft_proposes_only_its_tokens_and_sampling_stays_plain_decodings(code_engines, narrow_draft):
    from llmc.contract.engine_dir import open_engine

    target, _ = code_engines
    kept = open_engine(narrow_draft).manifest.lm_head_tokens
    assert len(kept) == 512 and list(kept) == sorted(set(kept))
    llm = LLM(target, speculative=str(narrow_draft), speculative_adaptive=False, draft_prompt_lookup=False)
    proposer = llm.speculator.proposer
    assert proposer.engine.forward_rows([Row([5], 0, [1])]).shape == (1, 512)
    proposed = []
    propose = proposer.propose

    def spy(rows, ks):
        caught_up = propose(rows, ks)
        for r in rows:
            proposed.extend(r.proposal)
        return caught_up
    proposer.propose = spy
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    first = llm.generate("def main():\n", params)
    assert first.token_ids == llm.generate("def main():\n", params).token_ids and len(first.token_ids) == 30
    assert first.token_ids == LLM(target).generate("def main():\n", params).token_ids  # plain decoding's
    assert proposed and set(proposed) <= set(kept)
    assert first.metrics.accepted_tokens > 0


def test_a_draft_head_keeps_the_most_frequent_tokens_in_id_order():
    from llmc.passes.draft_vocab import most_frequent

    counts = np.array([5, 0, 9, 5, 1, 9])
    assert most_frequent(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    assert most_frequent(counts, 1).tolist() == [2]


def test_a_narrow_draft_cannot_serve_as_a_target(narrow_draft):
    with pytest.raises(LlmcError, match="is a speculative draft.*512 of the 8192 tokens") as info:
        LLM(narrow_draft)
    assert "\n" not in str(info.value)


def test_adaptive_speculation_matches_and_reports_metrics(code_engines):
    target, draft = code_engines
    llm = LLM(target, speculative="ngram", num_speculative_tokens=6)
    plain = LLM(target)
    prompt = llm.encode(REPETITIVE)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    a, b = plain.generate(prompt, params), llm.generate(prompt, params)
    assert b.token_ids == a.token_ids
    m = b.metrics
    assert m.accepted_tokens > 0 and m.tokens_per_step > 1
    assert m.acceptance_rate == m.accepted_tokens / m.proposed_tokens
    assert m.to_dict()["tokens_per_step"] == m.tokens_per_step
    assert len(m.token_times) == len(b.token_ids) and all(x <= y for x, y in zip(m.token_times, m.token_times[1:]))


def test_stream_emits_each_accepted_token_as_its_own_delta(code_engines):
    target, _ = code_engines
    llm = LLM(target, speculative="ngram", num_speculative_tokens=6, speculative_adaptive=False)
    stream = llm.stream(REPETITIVE, SamplingParams(max_tokens=60, ignore_eos=True))
    pieces = list(stream)
    out = stream.output
    assert "".join(pieces) == out.text
    assert out.metrics.tokens_per_step > 1.5
    assert len(pieces) > out.metrics.decode_steps + 1  # more deltas than steps: one per token


def test_seeded_sampling_is_plain_decodings_with_any_speculation(code_engines):
    """A seeded sampled request gives the same tokens run after run, and the same as without
    speculation, whichever proposer and however adaptive speculation cuts the steps."""
    target, draft = code_engines
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    plain = LLM(target).generate("def main():\n", params).token_ids
    assert len(plain) == 40
    for spec in ("ngram", str(draft)):
        for adaptive in (False, True):
            llm = LLM(target, speculative=spec, speculative_adaptive=adaptive)
            first = llm.generate("def main():\n", params)
            assert first.token_ids == plain, (spec, adaptive)
            assert llm.generate("def main():\n", params).token_ids == plain
            if not adaptive:
                assert first.metrics.proposed_tokens > 0 and first.metrics.accepted_tokens > 0


# -- the acceptance rule keeps the target's distribution -------------------------------------

VOCAB = 6
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}  # chi-square at p = 0.001, by degrees of freedom


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_token_counts(rule, proposal_probs: np.ndarray | None, trials: int = 12000,
                        params: SamplingParams = SamplingParams(temperature=1.0)) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the first kept token over many verifications of fresh proposals (each trial its
    own seed), and the target's distribution they must follow."""
    rng = np.random.default_rng(1)
    logits = np.log(np.array([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2],
                              [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]]))
    counts = np.zeros(VOCAB)
    for trial in range(trials):
        draws = Draws(trial)
        if proposal_probs is None:  # a certain proposal, as prompt lookup makes: always the same tokens
            proposed = [4, 1]
        else:  # a draft's, sampled with the numbers the target samples its positions with
            proposed = [sample_from(proposal_probs[j], draws.at(j)) for j in range(2)]
        counts[rule(logits, proposed, params, draws, 0, q=proposal_probs, rng=rng)[0]] += 1
    return counts, distribution(logits[0], params)


def _verify(logits, proposed, params, draws, position, q, rng):
    return verify(logits, proposed, params, draws, position)


def _wrong_rule(logits, proposed, params, draws, position, q, rng):
    """Accepts with min(1, p/q) but resamples a rejection from p itself instead of max(0, p - q)."""
    kept = []
    for j, x in enumerate(proposed):
        p = distribution(logits[j], params)
        qx = 1.0 if q is None else q[j][x]
        if rng.random() * qx < p[x]:
            kept.append(x)
            continue
        return kept + [sample_from(p, rng.random())]
    return kept + [sample_from(distribution(logits[len(kept)], params), rng.random())]


DRAFT_Q = np.array([[0.05, 0.05, 0.1, 0.1, 0.5, 0.2], [0.2, 0.5, 0.1, 0.1, 0.05, 0.05]])
# A --draft-vocab draft's q: zero on the tokens its head does not score (0 and 3 here).
NARROW_Q = np.array([[0.0, 0.1, 0.15, 0.0, 0.5, 0.25], [0.0, 0.6, 0.1, 0.0, 0.15, 0.15]])
QS = pytest.mark.parametrize("q", [None, DRAFT_Q, NARROW_Q],
                             ids=["certain-proposal", "draft-distribution", "narrow-draft-distribution"])


@QS
def test_verification_keeps_the_target_distribution(q):
    counts, p = _first_token_counts(_verify, q)
    assert _chi2(counts, p) < CHI2_999[VOCAB - 1]


def test_verification_gives_plain_samplings_tokens_and_keeps_a_coupled_drafts_often():
    """Each verified position gets the token plain sampling gives it with the same number, whatever
    was proposed; a draft that samples with those numbers from a distribution near the target's is
    kept at most positions."""
    rng = np.random.default_rng(2)
    params = SamplingParams(temperature=1.0)
    kept_draft = 0
    for trial in range(300):
        logits = rng.normal(0, 2, (4, 50))
        draws = Draws(trial)
        plain = [int(Sampler().sample(row[None], [params], [draws], [10 + j])[0]) for j, row in enumerate(logits)]
        for proposed in ([int(t) for t in rng.integers(0, 50, 3)], plain[:3]):
            out = verify(logits, proposed, params, draws, 10)
            assert out == plain[:len(out)]
            assert len(out) == next((j for j, x in enumerate(proposed) if x != plain[j]), 3) + 1
        near = logits + rng.normal(0, 0.1, logits.shape)  # a draft close to the target
        drafted = [sample_from(distribution(near[j], params), draws.at(10 + j)) for j in range(3)]
        kept_draft += len(verify(logits, drafted, params, draws, 10)) - 1
    assert kept_draft / (300 * 3) > 0.7


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.0, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=5, top_p=0.9)])
def test_certain_proposals_keep_the_filtered_distribution(params):
    """Prompt lookup's proposals against top-k and top-p rows (the sparse path of verify): the
    proposal 4 falls outside the kept tokens in some of these, where it must never be accepted."""
    counts, p = _first_token_counts(_verify, None, params=params)
    assert counts[p == 0].sum() == 0
    assert _chi2(counts[p > 0], p[p > 0]) < CHI2_999[int((p > 0).sum()) - 1]


@QS
def test_a_wrong_acceptance_rule_fails_the_same_test(q):
    counts, p = _first_token_counts(_wrong_rule, q)
    assert _chi2(counts, p) > CHI2_999[VOCAB - 1]


def test_bonus_token_follows_the_last_distribution_when_all_are_accepted():
    logits = np.log(np.array([[1e-9] * 5 + [1.0], [0.3, 0.2, 0.2, 0.1, 0.1, 0.1]]))
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(VOCAB)
    for trial in range(6000):
        kept = verify(logits, [5], params, Draws(trial), 0)
        assert kept[0] == 5 and len(kept) == 2
        counts[kept[1]] += 1
    assert _chi2(counts, distribution(logits[1], params)) < CHI2_999[VOCAB - 1]


def test_greedy_verification_keeps_the_argmax_prefix():
    logits = np.eye(VOCAB)[[2, 3, 1, 0]] * 5.0  # argmaxes 2, 3, 1, 0
    greedy, draws = SamplingParams(), Draws(0)
    assert verify(logits, [2, 3, 1], greedy, draws, 0) == [2, 3, 1, 0]  # all kept, then the bonus
    assert verify(logits, [2, 4, 1], greedy, draws, 0) == [2, 3]  # corrected at the first miss
    assert verify(logits[:1], [], greedy, draws, 0) == [2]
    # The graph's argmax (Engine.greedy_tokens), where given, is what the proposals are held to.
    assert verify(logits, [2, 3, 1], greedy, draws, 0, np.array([2, 3, 4, 0])) == [2, 3, 4]


# -- pieces ----------------------------------------------------------------------------------

class _Seq:
    def __init__(self, ids):
        self.request_id, self.token_ids = "r", list(ids)
        self.proposal = []


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(1, 3)
    seq = _Seq([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 9, 5, 6, 7])
    ngram.propose([seq], [3])
    assert seq.proposal == [2, 3, 9]  # (5, 6, 7) last seen before position 9
    seq.token_ids += [2, 3]
    ngram.propose([seq], [4])  # the index grows with the sequence: (7, 2, 3) -> 9, 5, 6, 7
    assert seq.proposal == [9, 5, 6, 7]
    miss = _Seq([1, 2, 3, 4])
    ngram.propose([miss], [4])
    assert miss.proposal == []
    ngram.propose([seq], [0])
    assert seq.proposal == []


def test_ngram_goes_around_a_loop_that_runs_into_the_sequences_end():
    ngram = NgramProposer(1, 3)
    loop = _Seq([9, 1, 2, 3, 1, 2, 3, 1, 2])  # (3, 1, 2) last ended 3 tokens back: a period of 3
    ngram.propose([loop], [7])
    assert loop.proposal == [3, 1, 2, 3, 1, 2, 3]
    ngram.release(loop)  # each _Seq is request "r"
    single = _Seq([4, 4])
    ngram.propose([single], [3])
    assert single.proposal == [4, 4]  # a match of one token is trusted for two


def test_ngram_trusts_a_match_for_twice_its_length():
    ngram = NgramProposer(1, 3)
    short = _Seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3])  # (3,) alone recurs
    ngram.propose([short], [8])
    assert short.proposal == [4, 5]
    ngram.release(short)
    long = _Seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3])  # (1, 2, 3) recurs
    ngram.propose([long], [8])
    assert long.proposal == [4, 5, 6, 7, 8, 9]
    ngram.release(long)
    longer = _Seq([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3])  # and (0, 1, 2, 3) with it
    ngram.propose([longer], [8])
    assert longer.proposal == [4, 5, 6, 7, 8, 9, 0, 1]


def test_a_draft_takes_prompt_lookups_proposal_where_there_is_one(code_engines):
    target, draft = code_engines
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    for lookup in (True, False):
        llm = LLM(target, speculative=str(draft), draft_prompt_lookup=lookup, speculative_adaptive=False)
        proposer = llm.speculator.proposer
        looped = Request("looped", 0, None, [5, 6, 7, 8, 5, 6, 7], greedy, llm.tokenizer, llm.eos_ids)
        fresh = Request("fresh", 1, None, list(range(100, 140)), greedy, llm.tokenizer, llm.eos_ids)
        proposer.propose([looped, fresh], [4, 4])
        assert len(fresh.proposal) == 4 and "fresh" in proposer._seqs  # no match: the draft's
        if lookup:
            assert looped.proposal == [8, 5, 6, 7] and "looped" not in proposer._seqs
        else:
            assert "looped" in proposer._seqs
        for r in (looped, fresh):
            proposer.release(r)
        assert proposer.blocks.num_free == proposer.blocks.capacity


def test_truncate_returns_the_blocks_a_rejected_proposal_used():
    blocks = BlockManager(num_blocks=10, block_size=4)
    seq = _Seq(range(6))
    seq.block_table, seq.num_computed_tokens, seq.num_hashed_blocks, seq.cache_salt = [], 0, 0, None
    blocks.append(seq, 14)  # 6 tokens + a proposal reaching position 13: 4 blocks
    assert len(seq.block_table) == 4 and blocks.num_free == 5
    blocks.truncate(seq, 7)
    assert len(seq.block_table) == 2 and blocks.num_free == 7
    blocks.check([seq.block_table])


def test_request_deltas_come_one_per_token():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    r = Request("r", 0, None, [0], SamplingParams(max_tokens=10), Tok(), frozenset())
    for t in (1, 2, 3):
        r.append(t, 0.0, 100)
    assert r.deltas() == ["b", "c", "d"]
    assert r.deltas() == []


@pytest.mark.parametrize("options,match", [
    (dict(speculative="nonsense"), "ngram' or a draft engine directory"),
    (dict(speculative=""), "speculative must be"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(speculative="ngram", num_speculative_tokens=99), "<= 16"),
    (dict(speculative="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
])
def test_bad_speculative_options_are_one_line(code_engines, options, match):
    target, _ = code_engines
    with pytest.raises(LlmcError, match=match) as info:
        LLM(target, **options)
    assert "\n" not in str(info.value)


def test_a_draft_with_another_tokenizer_is_refused(code_engines, engines, tmp_path):
    target, draft = code_engines
    other = tmp_path / "other-draft"
    shutil.copytree(engines("tiny-llama"), other)
    with pytest.raises(LlmcError, match="another tokenizer") as info:
        LLM(target, speculative=str(other))
    assert "\n" not in str(info.value)


def test_speculation_never_makes_a_stream_of_misses_slower_in_steps(code_engines):
    """Random prompts: proposals rarely land, and the adaptive rule must stop proposing (the
    speed side of this is measured in benchmarks/speculative.py)."""
    target, _ = code_engines
    llm = LLM(target, speculative="ngram", num_speculative_tokens=4)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, llm.engine.spec.vocab_size, 100).tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    m = out.metrics
    assert not math.isnan(m.tokens_per_step) and m.tokens_per_step >= 1.0
    assert m.proposed_tokens < 3 * len(out.token_ids)


@pytest.mark.parametrize("gain", [2.0, 0.5, 1.02])
def test_the_cap_choice_settles_on_the_fastest_and_measuring_loses_little(gain):
    """Steps of one second whose tokens depend on the cap: the choice must settle on the cap with
    the most tokens per second (plain decoding unless speculating beats it by 5%), and what
    measuring the others loses must stay near the 1% budget."""
    tokens = {0: 1.0, 1: 1.0 + (gain - 1.0) / 2, 4: gain}
    bucket = _Bucket([0, 1, 4])
    steps, got = 5000, 0.0
    for _ in range(steps):
        got += tokens[bucket.cap]
        bucket.record({c: tokens[c] for c in bucket.caps if c <= bucket.cap}, 1.0)
    best = 4 if gain > 1.05 else 0
    assert bucket.best() == best
    assert got >= 0.98 * tokens[best] * steps


def test_smaller_caps_are_counted_on_the_running_caps_steps():
    """A step at cap 8 that kept a row's 8 proposals would have kept 1 at cap 1 and none at cap 0:
    those counts go into the smaller caps' tokens a step, so every cap is judged on the text the
    best one runs on, not only on the few steps of its own measurements."""
    seconds = {0: 1.0, 1: 1.1, 8: 1.8}
    bucket = _Bucket([0, 1, 8])
    for _ in range(3 * PROBE_STEPS):  # the first measurement of each cap, on text it copies
        bucket.record({c: min(8, c) + 1 for c in bucket.caps if c <= bucket.cap}, seconds[bucket.cap])
    assert bucket.cap == 8 and bucket.tokens[1].value == 2.0
    for _ in range(EPOCH):  # cap 8 on text where every proposal misses
        bucket.record({0: 1, 1: 1, 8: 1}, seconds[8])
    # Cap 1 missed there too, though it did not run: judged on its own measurement alone it would
    # still show 2 tokens a step, and with them the best rate.
    assert bucket.tokens[0].value == 1.0 and bucket.tokens[1].value < 1.5


def test_a_held_up_step_does_not_keep_the_best_cap_from_running():
    """One step held up 200 times over (a page fault, another process) inside the first
    measurement of k must not make k, the fastest cap, wait out most of the run."""
    seconds, tokens = {0: 1.0, 1: 1.4, 4: 2.0}, {0: 1.0, 1: 1.9, 4: 3.8}
    bucket = _Bucket([0, 1, 4])
    steps, at_k, held = 3000, 0, False
    for _ in range(steps):
        at_k += bucket.cap == 4
        took = seconds[bucket.cap]
        if bucket.cap == 4 and not held:
            took, held = 200 * took, True
        bucket.record({c: tokens[c] for c in bucket.caps if c <= bucket.cap}, took)
    assert at_k >= 0.95 * steps


def test_a_cap_whose_steps_only_sometimes_propose_pays_for_those_steps():
    """Where rows mostly pause, a cap's steps are plain ones with a dearer one now and then; the
    dearer ones are its cost and must count (a median step counted none of them)."""
    bucket = _Bucket([0, 1, 4])
    for _ in range(60 * PROBE_STEPS):
        if bucket.cap == 0:
            bucket.record({0: 1.0}, 1.0)
        else:  # one step in four proposes, at 3x a plain step, and gains a token
            for i in range(PROBE_STEPS if bucket.probing else EPOCH):
                dear = i % 4 == 0
                bucket.record({c: 1.0 + dear for c in bucket.caps if c <= bucket.cap}, 3.0 if dear else 1.0)
    assert bucket.best() == 0 and bucket.rates[1] < bucket.rates[0]


@pytest.mark.parametrize("probe_without_matches", [False, True])
def test_a_new_best_cap_is_measured_against_soon(probe_without_matches):
    """While k is far ahead, measuring plain decoding buys a long wait. When a stretch without
    matches makes plain decoding the best, that wait must not carry over: once matches return, k
    runs again within a few measurement lengths, not after the wait k's lead had bought. Nor after
    the wait that one measurement of k inside the stretch buys: its loss is k's pooled rate's."""
    bucket = _Bucket([0, 1, 4])
    seconds = {0: 1.0, 1: 1.1, 4: 1.3}
    matches, none = {0: 1.0, 1: 1.8, 4: 3.5}, {0: 1.0, 1: 1.0, 4: 1.0}

    def step(tokens):
        bucket.record({c: tokens[c] for c in bucket.caps if c <= bucket.cap}, seconds[bucket.cap])

    while not (bucket.running == 4 and bucket.waits.get(0, 0.0) > 300):  # k far ahead, just after a look at plain decoding
        step(matches)
    while bucket.running != 0:  # no matches: plain decoding becomes the best
        step(none)
    if probe_without_matches:  # and k is measured once more before matches come back
        while not (bucket.cap == 4 and bucket.probing):
            step(none)
        while bucket.cap == 4:
            step(none)
    steps = 0
    while not (bucket.cap == 4 and not bucket.probing):  # matches again
        step(matches)
        steps += 1
    assert steps <= 10 * EPOCH  # (it was 500-650 steps with the wait carried over)


def test_a_drafts_catch_up_is_left_out_of_its_own_step_only():
    """The seconds a draft spends catching up on a new prompt are taken out of that step's time,
    and out of no other: a plain step after it (cap 0, nothing proposed) keeps its whole time."""
    import time
    from types import SimpleNamespace

    class CatchingUp:  # every proposal starts with 20 ms of catch-up
        def propose(self, rows, ks):
            time.sleep(0.02)
            for r in rows:
                r.proposal = []
            return 0.02

    spec = Speculator(CatchingUp(), 4)
    row = SimpleNamespace(request_id="a", proposal=[], params=SamplingParams())
    steps = []  # (the step's cap, its recorded seconds)
    for _ in range(40):
        spec.propose([row], lambda r: 100)
        bucket = spec._buckets[False, 1]
        cap = bucket.cap
        time.sleep(0.001)  # the step's own work
        spec.step_done(1)
        if bucket.steps:  # an epoch's last step goes into its rates, not bucket.steps
            steps.append((cap, bucket.steps[-1]))
    assert {cap for cap, _ in steps} >= {0, 4}
    assert all(0.0009 < seconds < 0.015 for _, seconds in steps)  # whole, and without the 20 ms


def test_sampled_rows_choose_their_cap_on_their_own_measurements():
    """Greedy steps that found k the best say nothing about sampled ones, where proposals are
    accepted by p/q and cost more to check: a sampled step starts its own measurements."""
    from types import SimpleNamespace

    class Proposing:
        def propose(self, rows, ks):
            for r, k in zip(rows, ks):
                r.proposal = [0] * k
            return 0.0

    spec = Speculator(Proposing(), 4)
    greedy = SimpleNamespace(request_id="g", proposal=[], params=SamplingParams())
    for _ in range(3 * PROBE_STEPS + EPOCH):  # every proposal kept: k is by far the best
        spec.propose([greedy], lambda r: 100)
        spec.verified(greedy, len(greedy.proposal), len(greedy.proposal))
        spec.step_done(1 + len(greedy.proposal))
    assert spec._buckets[False, 1].best() == 4
    sampled = SimpleNamespace(request_id="s", proposal=[],
                              params=SamplingParams(temperature=1.0))
    spec.propose([sampled], lambda r: 100)  # measured from the start: one token, not the greedy steps' 4
    assert len(sampled.proposal) == 1 and not spec._buckets[True, 1].seconds
    spec.propose([greedy, sampled], lambda r: 100)  # a batch with a sampled row is a sampled step
    assert (True, 2) in spec._buckets and (False, 2) not in spec._buckets


def test_sliding_window_model_speculates_losslessly(engines):
    """tiny-mistral attends within a 16-token window: verified rows longer than one token must
    see the same window per position as single-token steps do."""
    engine = engines("tiny-mistral")
    plain = LLM(engine)
    rng = np.random.default_rng(2)
    motif = rng.integers(3, plain.engine.spec.vocab_size, 6).tolist()
    prompts = [motif * 5 + rng.integers(3, 200, 3).tolist(), rng.integers(3, 500, 30).tolist()]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(engine, speculative="ngram", speculative_adaptive=False, **SMALL)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.proposed_tokens for o in outs) > 0


def test_longrope_models_refuse_speculation_in_one_line(engines):
    with pytest.raises(LlmcError, match="longrope") as info:
        LLM(engines("tiny-phi3-longrope"), speculative="ngram")
    assert "\n" not in str(info.value)


def test_async_stream_yields_a_snapshot_per_accepted_token(code_engines):
    import asyncio

    from llmc.runtime.async_llm import AsyncLLM

    target, _ = code_engines

    async def main():
        engine = AsyncLLM(target, speculative="ngram", num_speculative_tokens=6, speculative_adaptive=False)
        stream = await engine.add_request(REPETITIVE, SamplingParams(max_tokens=60, ignore_eos=True))
        return [out async for out in stream]

    snapshots = asyncio.run(main())
    last = snapshots[-1]
    assert last.finished and all(not s.finished for s in snapshots[:-1])
    assert "".join(s.delta for s in snapshots) == last.text
    assert last.metrics.tokens_per_step > 1.5
    assert len(snapshots) > last.metrics.decode_steps + 1


def test_logprobs_are_the_same_with_and_without_speculation(code_engines):
    target, _ = code_engines
    params = SamplingParams(max_tokens=30, logprobs=2, ignore_eos=True)
    plain = LLM(target).generate(REPETITIVE, params)
    spec = LLM(target, speculative="ngram", speculative_adaptive=False).generate(REPETITIVE, params)
    assert spec.metrics.accepted_tokens > 0 and spec.token_ids == plain.token_ids
    assert [e.token for e in spec.logprobs] == spec.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_token_logprob_is_the_raw_log_softmax():
    from llmc.runtime.sampling import token_logprob

    logits = np.array([2.0, 0.5, -1.0, 3.0, 0.0], np.float32)
    expected = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    entry = token_logprob(logits, 1, 2)
    assert entry.logprob == pytest.approx(expected[1])
    assert entry.top == ((3, pytest.approx(expected[3])), (0, pytest.approx(expected[0])))
    with pytest.raises(RequestError, match="logprobs must be an int from 0 to 20"):
        SamplingParams(logprobs=21)


def test_where_plain_decoding_is_best_the_speculator_only_times_the_steps(monkeypatch):
    """Proposals that always miss, at 1.5x a plain step: plain decoding wins, and between the
    measurements of the other caps a step costs the speculator its timing alone. Plain decoding's
    own rate is measured on those steps, not in an epoch of the speculator's bookkeeping after each
    wait."""
    from types import SimpleNamespace

    import llmc.runtime.speculative as speculative

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock.now)

    class Missing:
        def propose(self, rows, ks):
            for r, k in zip(rows, ks):
                r.proposal = [0] * k
            return 0.0

        def release(self, r):
            pass

    spec = Speculator(Missing(), 4)
    row = SimpleNamespace(request_id="a", proposal=[], params=SamplingParams())
    steps, bookkept = 3000, 0
    for i in range(steps):
        if i % 100 == 0:  # a new request every 100 steps: its estimate starts hopeful
            spec.release(row)
        if not spec.plain([row]):
            bookkept += 1
            spec.propose([row], lambda r: 100)
        proposed = len(row.proposal)
        clock.now += 1.5 if proposed else 1.0
        if proposed:
            spec.verified(row, proposed, 0)
        row.proposal = []
        spec.step_done(1)
    assert spec._buckets[False, 1].best() == 0
    assert bookkept < 0.05 * steps  # 10% when plain decoding was measured in epochs of its own
