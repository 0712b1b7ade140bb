import math
import subprocess
import sys

import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.runtime.sampling import _DRAW_BLOCK, Draws, Sampler, SamplingParams, _draw, _nucleus


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_params_raise_one_line_request_error(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_temperature_message_suggests_greedy():
    with pytest.raises(RequestError, match=r"temperature must be >= 0 \(got -0.5\); use 0 for greedy"):
        SamplingParams(temperature=-0.5)


def test_params_are_normalized():
    p = SamplingParams(stop="###", stop_token_ids=[np.int64(2), 7], temperature=1, top_k=np.int32(5), seed=np.int64(3))
    assert p.stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert p.stop_token_ids == (2, 7)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int
    assert SamplingParams(stop_token_ids=4).stop_token_ids == (4,)
    hash(p)  # frozen and made of tuples: usable as a dict key


def test_greedy_property():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -3.0, -0.5]], dtype=np.float32)
    out = Sampler().sample(logits, [SamplingParams()] * 3, [None] * 3, [0] * 3)
    assert out.dtype == np.int64 and out.shape == (3,)
    assert out.tolist() == [1, 0, 3]


def _random_logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, size=(rows, vocab)).astype(np.float32)


@pytest.mark.parametrize("temperature", [0.01, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = _random_logits(16, 1000)
    logits[0, [10, 20]] = logits[0].max() + 1  # a tie: must resolve like argmax
    params = [SamplingParams(temperature=temperature, top_k=1)] * 16
    out = Sampler().sample(logits, params, [Draws(i) for i in range(16)], [0] * 16)
    assert out.tolist() == np.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 10.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = _random_logits(16, 1000, seed=1)
    params = [SamplingParams(temperature=temperature, top_p=1e-9)] * 16
    out = Sampler().sample(logits, params, [Draws(i) for i in range(16)], [0] * 16)
    assert out.tolist() == np.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-45, 1e-20, 1e-3])
def test_a_tiny_temperature_samples_the_peak_without_overflow(temperature):
    # The row is shifted by its peak before it is scaled: no temperature overflows float32 logits.
    logits = _random_logits(8, 1000, seed=4)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = Sampler().sample(logits, [SamplingParams(temperature=temperature)] * 8,
                               [Draws(i) for i in range(8)], [0] * 8)
    assert out.tolist() == np.argmax(logits, axis=-1).tolist()


def test_top_k_only_samples_from_the_k_best():
    logits = _random_logits(1, 200, seed=2)
    best = set(np.argsort(-logits[0])[:5].tolist())
    sampler, draws = Sampler(), Draws(0)
    params = [SamplingParams(temperature=5.0, top_k=5)]
    seen = {int(sampler.sample(logits, params, [draws], [p])[0]) for p in range(500)}
    assert seen == best


def test_top_p_keeps_smallest_set_reaching_p():
    logits = np.log(np.array([[0.05, 0.5, 0.15, 0.3]], dtype=np.float32))
    sampler, draws = Sampler(), Draws(0)

    def support(top_p: float) -> set[int]:
        params = [SamplingParams(temperature=1.0, top_p=top_p)]
        return {int(sampler.sample(logits, params, [draws], [p])[0]) for p in range(400)}

    assert support(0.45) == {1}
    assert support(0.79) == {1, 3}
    assert support(0.81) == {1, 3, 2}
    assert support(1.0) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_matches_full_sort(top_p):
    # A flat distribution forces the widening search past its first 64 candidates.
    probs = np.random.default_rng(3).dirichlet(np.full(5000, 0.5))
    order = np.argsort(-probs, kind="stable")
    want = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
    got = _nucleus(probs, top_p)
    assert sorted(got.tolist()) == sorted(order[:want].tolist())


@pytest.mark.parametrize("vocab", [1, 7, _DRAW_BLOCK - 1, _DRAW_BLOCK, _DRAW_BLOCK + 1, 3 * _DRAW_BLOCK + 5])
def test_the_two_level_draw_is_the_inverse_cdf(vocab):
    # The draw searches block sums, then one block: it must pick the token a single cumulative sum
    # picks (up to round-off at a boundary), and never a zero-probability token.
    rng = np.random.default_rng(vocab)
    probs = rng.random(vocab)
    probs[::3] = 0.0  # zeros at block edges too
    probs[-1] = probs[-1] or 0.5
    cdf = np.cumsum(probs)
    for u in np.concatenate([rng.random(400), np.linspace(0.0, 1.0 - 1e-12, 101)]):
        got = _draw(None, probs, u)
        want = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), vocab - 1)
        assert probs[got] > 0
        assert got == want or abs(cdf[min(got, want)] - u * cdf[-1]) <= 1e-9 * cdf[-1], (u, got, want)
    ids = np.arange(100, 100 + vocab)
    assert _draw(ids, probs, 0.5) == 100 + _draw(None, probs, 0.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_temperature_sampling_frequencies_match_softmax(dtype):
    base = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    temperature = 2.0
    expected = np.exp(base / temperature)
    expected /= expected.sum()

    rows, steps = 2000, 10
    logits = np.tile(base.astype(dtype), (rows, 1))
    params = [SamplingParams(temperature=temperature)] * rows
    keyed = [Draws(1000 + i) for i in range(rows)]
    sampler = Sampler()
    draws = np.concatenate([sampler.sample(logits, params, keyed, [s] * rows) for s in range(steps)])

    counts = np.bincount(draws, minlength=4)
    n = rows * steps
    chi2 = float((((counts - n * expected) ** 2) / (n * expected)).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001


def test_same_seed_same_tokens_whatever_the_batch():
    steps, vocab = 30, 500
    logits = [_random_logits(1, vocab, seed=100 + s) for s in range(steps)]
    mine = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    sampler = Sampler()

    alone = [int(sampler.sample(step, [mine], [Draws.of(mine)], [40 + s])[0]) for s, step in enumerate(logits)]

    others = [SamplingParams(), SamplingParams(temperature=1.3, seed=7), SamplingParams(temperature=0.5, top_p=0.5)]
    batch_draws = [Draws.of(p) for p in others] + [Draws.of(mine)]
    batched = []
    for s, step in enumerate(logits):
        noise = _random_logits(3, vocab, seed=s)
        batch = np.concatenate([noise, step])
        # Shuffle the row order each step too: position in the batch must not matter.
        perm = np.random.default_rng(s).permutation(4)
        out = sampler.sample(batch[perm], [(others + [mine])[i] for i in perm], [batch_draws[i] for i in perm],
                             [[3, 9, 27, 40 + s][i] for i in perm])
        batched.append(int(out[list(perm).index(3)]))

    assert batched == alone
    assert len(set(alone)) > 1  # the test would be vacuous if sampling were effectively greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.7, top_k=1),
    ],
)
def test_a_rows_token_depends_on_its_seed_and_position_only(params):
    """The same seed at the same position gives the same token whatever was drawn before (the
    numbers are keyed, not a stream); another position or seed draws anew."""
    logits, sampler = _random_logits(1, 100), Sampler()
    params = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=5)
    draws = Draws.of(params)
    first = [int(sampler.sample(logits, [params], [draws], [p])[0]) for p in range(200)]
    again = [int(sampler.sample(logits, [params], [draws], [p])[0]) for p in reversed(range(200))][::-1]
    assert first == again
    other = Draws(6)
    assert [int(sampler.sample(logits, [params], [other], [p])[0]) for p in range(200)] != first or params.top_k == 1


def test_draws_are_keyed_by_seed_and_position():
    assert [Draws(42).at(p) for p in range(5)] == [Draws(42).at(p) for p in range(5)]
    values = [Draws(42).at(p) for p in range(2000)] + [Draws(43).at(p) for p in range(2000)]
    assert len(set(values)) == len(values) and all(0.0 <= v < 1.0 for v in values)
    assert abs(np.mean(values) - 0.5) < 0.02 and abs(np.var(values) - 1 / 12) < 0.005  # uniform
    assert Draws().at(0) != Draws().at(0)  # unseeded: a random key each


def test_masked_logits_are_never_sampled():
    logits = np.full((1, 10), -np.inf, dtype=np.float32)
    logits[0, [2, 7]] = [0.0, 0.5]
    sampler, draws = Sampler(), Draws(0)
    seen = {int(sampler.sample(logits, [SamplingParams(temperature=1.0)], [draws], [p])[0]) for p in range(200)}
    assert seen == {2, 7}


def test_unseeded_sampled_row_without_draws_still_samples():
    out = Sampler().sample(_random_logits(2, 50), [SamplingParams(temperature=1.0)] * 2, [None, None], [0, 0])
    assert all(0 <= t < 50 for t in out.tolist())
    assert not math.isnan(float(out.sum()))


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError):
        Sampler().sample(_random_logits(2, 10), [SamplingParams()], [None], [0])


def test_runtime_modules_stay_lean():
    code = (
        "import sys, llmc.runtime.sampling, llmc.runtime.metrics, llmc.runtime.detokenize; "
        "bad = [m for m in ('torch', 'transformers', 'llmc.compiler', 'llmc.passes') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
