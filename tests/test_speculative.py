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
from llmc.runtime.proposers import NgramProposer
from llmc.runtime.speculation import PLAIN_EVERY, SpeculationPolicy, StepCosts, best_k
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
    assert llm.core.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert llm.core.generated_tokens == sum(len(o.token_ids) for o in outs)
    assert any(o.prefix_hit_tokens > 0 for o in outs)
    assert llm.blocks.num_free == llm.blocks.capacity  # rolled-back and finished blocks all returned
    llm.blocks.check([])
    if proposer != "ngram":
        blocks = llm.core.speculation.proposers[-1].blocks
        assert blocks.num_free == blocks.capacity


def test_a_narrow_draft_proposes_only_its_tokens_and_sampling_stays_plain_decodings(code_engines, narrow_draft):
    from llmc.contract.engine_dir import open_engine

    target, _ = code_engines
    kept = open_engine(narrow_draft).manifest.lm_head_tokens
    assert len(kept) == 512 and list(kept) == sorted(set(kept))
    llm = LLM(target, speculative=str(narrow_draft), speculative_adaptive=False, draft_prompt_lookup=False)
    proposer = llm.core.speculation.proposers[-1]
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
        llm = LLM(target, speculative=str(draft), draft_prompt_lookup=lookup, speculative_adaptive=False,
                  num_speculative_tokens=4)
        policy = llm.core.speculation
        proposer = policy.proposers[-1]
        looped = Request("looped", 0, None, [5, 6, 7, 8, 5, 6, 7], greedy, llm.tokenizer, llm.eos_ids)
        fresh = Request("fresh", 1, None, list(range(100, 140)), greedy, llm.tokenizer, llm.eos_ids)
        policy.propose([looped, fresh], lambda r: 100)
        assert len(fresh.proposal) == 4 and "fresh" in proposer._seqs  # no match: the draft's
        if lookup:
            assert looped.proposal == [8, 5, 6, 7] and "looped" not in proposer._seqs
        else:
            assert "looped" in proposer._seqs
        for r in (looped, fresh):
            policy.release(r)
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


class _Row:
    def __init__(self, name: str, temperature: float = 0.0):
        self.request_id, self.proposal, self.params = name, [], SamplingParams(temperature=temperature)
        self.token_ids = [7]


class _Proposing:
    """Proposes exactly the k asked for."""
    asked = 0

    def propose(self, rows, ks):
        self.asked += 1
        for r, k in zip(rows, ks):
            r.proposal = [0] * k

    def release(self, r):
        pass


def _costs(slope: float) -> StepCosts:
    """Costs calibrated at `slope`, a plain step measured at 1 second."""
    costs = StepCosts(slope)
    costs.observe((False, 1), 1, 1.0)
    costs.observe((True, 1), 1, 1.0)
    return costs


def _simulate(policy, steps, cost, kept, rows=None):
    """Decode `steps` steps; cost(s) is a step's seconds with rows s tokens long, kept(k) how many of k
    proposals a row keeps. Returns (output tokens, seconds, steps that proposed)."""
    rows = rows or [_Row("a")]
    tokens = seconds = proposing = 0
    for _ in range(steps):
        policy.propose(rows, lambda r: 10_000)
        s = 1 + max(len(r.proposal) for r in rows)
        proposing += s > 1
        for r in rows:
            if r.proposal:
                got = kept(len(r.proposal))
                policy.verified(r, len(r.proposal), got)
                tokens += got
            tokens += 1
            r.proposal = []
        took = cost(s)
        seconds += took
        policy.step_done(s, took)
    return tokens, seconds, proposing


def test_a_one_shot_request_speculates_its_whole_k_from_the_first_step():
    """Verifying 9 tokens measured at 1.2x a plain step: a new request, hopeful, proposes all 8
    at once, with no steps spent measuring first (but the first step of all, which measures a
    plain step)."""
    policy = SpeculationPolicy([_Proposing()], 8, StepCosts(0.2 / 8))
    row = _Row("a")
    policy.propose([row], lambda r: 100)
    assert not row.proposal
    policy.step_done(1, 1.0)
    policy.propose([row], lambda r: 100)
    assert len(row.proposal) == 8
    row.proposal = []
    policy.propose([row], lambda r: 3)  # but never more than can still be kept
    assert len(row.proposal) == 2


def test_rows_whose_proposals_miss_pause_and_probe_rarely():
    policy = SpeculationPolicy([_Proposing()], 8, _costs(0.02))
    tokens, seconds, proposing = _simulate(policy, 2000, lambda s: 1.0 + 0.02 * (s - 1), lambda k: 0)
    assert proposing < 0.03 * 2000
    assert tokens / seconds > 0.98  # plain decoding's rate is 1 token a second


@pytest.mark.parametrize("slope", [0.05, 0.3, 1.0])
def test_live_step_costs_decide_where_the_calibration_was_wrong(slope):
    """Calibrated at a slope of 0.02, the live steps cost 1 + slope * (s - 1) (another process on
    the cores, say); rows keep each proposal with chance 0.6. The policy must follow the live costs:
    come within 10% of the best fixed k where verifying is cheap (its hopeful prior for the later
    positions, 0.9, is wrong for these rows), and lose at most 3% to plain decoding
    where it is dear (at a slope of 1, verifying 9 tokens costs 9 plain steps)."""
    rng = np.random.default_rng(0)

    def kept(k):
        n = 0
        while n < k and rng.random() < 0.6:
            n += 1
        return n

    policy = SpeculationPolicy([_Proposing()], 8, _costs(0.02))
    tokens, seconds, _ = _simulate(policy, 3000, lambda s: 1.0 + slope * (s - 1), kept)
    rate = tokens / seconds  # plain decoding: 1 token a second
    best = max((1 - 0.6 ** (k + 1)) / 0.4 / (1 + slope * k) for k in range(9))
    assert rate >= max(0.97, 0.9 * best)
    if best > 1.1:  # it kept verifying, and so measuring the slope
        assert policy.costs.slope((False, 1)) == pytest.approx(slope, rel=0.25)
    else:  # it stopped once the slope it measured said no k pays at this acceptance
        assert best_k([0.6] * 8, policy.costs.slope((False, 1)), 8) == 0


def test_a_held_up_step_moves_the_costs_little():
    """One step held up 200x over (a page fault, another process) must not stop a request that
    keeps everything from proposing its whole k."""
    costs = _costs(0.02)
    policy = SpeculationPolicy([_Proposing()], 8, costs)
    row = _Row("a")
    for i in range(40):
        policy.propose([row], lambda r: 100)
        assert len(row.proposal) == 8 or costs.plain_due((False, 1)) or i == 21
        s = 1 + len(row.proposal)
        policy.verified(row, len(row.proposal), len(row.proposal))
        row.proposal = []
        policy.step_done(s, (1.0 + 0.02 * (s - 1)) * (200 if i == 20 else 1))
    assert costs.slope((False, 1)) < 0.3


def test_plain_steps_keep_each_kinds_plain_cost_current():
    """Where every step speculates, one in PLAIN_EVERY decodes plainly so the plain cost every
    decision divides by is this minute's; a new kind of step (a batch size, sampling) measures it
    first."""
    policy = SpeculationPolicy([_Proposing()], 4, _costs(0.02))
    _, _, proposing = _simulate(policy, 10 * PLAIN_EVERY, lambda s: 1.0 + 0.02 * (s - 1), lambda k: k)
    assert 10 * PLAIN_EVERY - 11 <= proposing < 10 * PLAIN_EVERY
    rows = [_Row("b", temperature=1.0)]
    policy.propose(rows, lambda r: 100)
    assert rows[0].proposal  # sampled, batch 1: measured already; batch 2 was not
    pair = [_Row("c"), _Row("d")]
    policy.propose(pair, lambda r: 100)
    assert not any(r.proposal for r in pair) and (False, 2) not in policy.costs.plain
    policy.step_done(1, 1.5)
    policy.propose(pair, lambda r: 100)
    assert all(r.proposal for r in pair)


def test_where_no_proposal_pays_a_verify_step_is_measured_now_and_then():
    """At batch 4 with a slope of 1 (a row one token longer costs a whole plain step more), not
    even rows that keep everything pay: the steps decode plainly, and after 64, then 128 steps
    one verifies one token a row (its last, so no proposer is asked: a draft would catch up on
    every row), so that costs that moved are seen."""
    costs = _costs(0.25)  # 1.0 at batch 4
    costs.observe((False, 4), 1, 1.0)
    policy = SpeculationPolicy([_Proposing()], 8, costs)
    rows = [_Row(name) for name in "abcd"]
    proposing = []
    for _ in range(64 + 128 + 100):
        policy.propose(rows, lambda r: 100)
        proposing.append(max(len(r.proposal) for r in rows))
        for r in rows:
            r.proposal = []
        policy.step_done(1 + proposing[-1], 1.0 + proposing[-1])
    assert [i for i, k in enumerate(proposing) if k] == [63, 63 + 128]
    assert policy.proposers[0].asked == 0


def test_a_batch_speculates_only_where_its_longest_row_pays():
    """At batch 2 the longest row sets the step's cost: one row that keeps everything and one
    that keeps nothing, on steps that grow fast with length, may not make both pay for k."""
    costs = _costs(0.02)
    costs.observe((False, 2), 1, 1.0)
    costs.prior = 0.2  # 0.4 at batch 2
    policy = SpeculationPolicy([_Proposing()], 8, costs)
    good, bad = _Row("good"), _Row("bad")
    for r, acceptance in ((good, 0.95), (bad, 0.05)):
        policy.propose([r], lambda r: 100)  # registers the row
        state = policy._rows[r.request_id, 0]
        state.hits, state.trials, state.chosen = [acceptance] * 8, [1.0] * 8, None
        r.proposal = []
    policy.propose([good, bad], lambda r: 100)
    k = len(good.proposal)
    rates = [(1 + (1 - 0.95 ** (j + 1)) / 0.05) / (1 + 0.4 * j) for j in range(9)]
    assert rates[k] >= 0.97 * max(rates)


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
