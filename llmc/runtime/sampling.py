"""Sampling parameters and a batched numpy sampler.

A request's random numbers are keyed, not streamed: the token at sequence position p is decided by
`Draws.at(p)`, a function of the request's seed and p alone. So a seeded request produces the same
tokens whatever else shares its batch, however its steps were cut (chunks, preemption), and with or
without speculation: `verify` samples each verified position with the number plain decoding would
use there and keeps a proposal only where it is that token, and a draft samples its proposals with
the same numbers, so it proposes what the target will keep as often as their distributions allow.
"""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmc.errors import RequestError

__all__ = ["Draws", "SamplingParams", "Sampler", "TokenLogprob", "distribution", "sample_from", "token_logprob",
           "verify"]


def _is_int(value: object) -> bool:
    # bool is an int subclass, but max_tokens=True is a bug, not a request for one token.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature=0 means greedy (argmax) decoding."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # also return each output token's log-probability and this many top ones

    def __post_init__(self) -> None:
        # The dataclass is frozen, so normalized values go in through object.__setattr__.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if not _is_int(self.max_tokens):
            raise RequestError(f"max_tokens must be an int (got {self.max_tokens!r}); pass a whole number like 64", field="max_tokens")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1 (got {self.max_tokens}); ask for at least one token", field="max_tokens")
        put("max_tokens", int(self.max_tokens))

        if not _is_real(self.temperature):
            raise RequestError(
                f"temperature must be a number (got {self.temperature!r}); use 0 for greedy decoding or e.g. 0.7"
            , field="temperature")
        if not math.isfinite(self.temperature):
            raise RequestError(
                f"temperature must be finite (got {self.temperature}); use 0 for greedy decoding or e.g. 0.7"
            , field="temperature")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding", field="temperature")
        put("temperature", float(self.temperature))

        if not _is_int(self.top_k):
            raise RequestError(f"top_k must be an int (got {self.top_k!r}); use 0 to disable top-k filtering", field="top_k")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (got {self.top_k}); use 0 to disable top-k filtering", field="top_k")
        put("top_k", int(self.top_k))

        if not _is_real(self.top_p):
            raise RequestError(f"top_p must be a number in (0, 1] (got {self.top_p!r}); use 1.0 to disable top-p", field="top_p")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p}); use 1.0 to disable top-p", field="top_p")
        put("top_p", float(self.top_p))

        if self.seed is not None:
            if not _is_int(self.seed):
                raise RequestError(f"seed must be an int or None (got {self.seed!r}); pass a whole number like 1234", field="seed")
            if self.seed < 0:
                raise RequestError(f"seed must be >= 0 (got {self.seed}); pass a non-negative whole number", field="seed")
            put("seed", int(self.seed))

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"stop must be a string or a list of strings (got {self.stop!r}); e.g. stop=['\\n\\n']", field="stop")
        if any(s == "" for s in stop):
            raise RequestError(f"stop strings must be non-empty (got {self.stop!r}); remove the empty string", field="stop")
        put("stop", tuple(stop))

        ids = (self.stop_token_ids,) if _is_int(self.stop_token_ids) else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise RequestError(
                f"stop_token_ids must be a list of token ids >= 0 (got {self.stop_token_ids!r}); e.g. [2]"
            , field="stop_token_ids")
        put("stop_token_ids", tuple(int(i) for i in ids))

        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be True or False (got {self.ignore_eos!r})", field="ignore_eos")

        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an int from 0 to {MAX_LOGPROBS} (got {self.logprobs!r}); 0 gives "
                               "each token's own log-probability only", field="logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGPROBS = 20  # OpenAI's own limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the model (its raw logits, before temperature or
    filtering, as OpenAI's API reports them) and the `top` most likely tokens' (id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    shifted = logits.astype(np.float64) - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    best = np.argpartition(logp, -top)[-top:] if top else np.array([], dtype=np.int64)
    best = best[np.argsort(-logp[best], kind="stable")]
    return TokenLogprob(int(token), float(logp[token]), tuple((int(i), float(logp[i])) for i in best))


_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers whose every output bit depends on
    every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Draws:
    """A request's uniform numbers in [0, 1), one per sequence position, each a function of the
    seed and the position only (SplitMix64 over seed and position): nothing a step does, or what
    it drew before, changes the number at a position. An unseeded request gets a random seed."""

    __slots__ = ("key",)

    def __init__(self, seed: int | None = None):
        self.key = _mix(secrets.randbits(64) if seed is None else int(seed) & _MASK)

    @classmethod
    def of(cls, params: SamplingParams) -> "Draws":
        return cls(params.seed)

    def at(self, position: int) -> float:
        z = _mix((self.key + (position + 1) * 0x9E3779B97F4A7C15) & _MASK)
        return (z >> 11) * 2.0 ** -53


# Nucleus search starts from this many top tokens and doubles; a full vocabulary sort per row is
# O(V log V) and almost never needed because the nucleus is usually a handful of tokens.
_NUCLEUS_START = 64


def _top_k(scaled: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries, in ascending id order (so later tie-breaks are deterministic)."""
    vocab = scaled.shape[0]
    if k == 1:
        # argmax breaks ties toward the lowest id, keeping top_k=1 identical to greedy decoding.
        return np.array([int(np.argmax(scaled))])
    return np.sort(np.argpartition(scaled, vocab - k)[vocab - k :])


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the smallest highest-probability set with cumulative probability >= top_p."""
    n = probs.shape[0]
    k = min(_NUCLEUS_START, n)
    while True:
        cand = np.arange(n) if k >= n else _top_k(probs, k)
        # Stable sort on -p: ties go to the lowest position, like a full stable sort would.
        order = cand[np.argsort(-probs[cand], kind="stable")]
        cum = np.cumsum(probs[order])
        if k >= n or cum[-1] >= top_p:
            keep = int(np.searchsorted(cum, top_p, side="left")) + 1
            return order[: min(keep, len(order))]  # rounding can leave cum[-1] < top_p: keep all
        k *= 2


# Below this a temperature acts as this one: every token but the peak's (and its ties) is at 0.
_MIN_TEMPERATURE = 1e-30


def _support(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray | None, np.ndarray]:
    """(token ids, or None for the whole vocabulary; their unnormalized probabilities) of one row's
    logits at `temperature` after top-k then top-p filtering: the one definition of the
    distribution a row samples from. The logits are shifted by their peak before they are scaled,
    so every exponent is <= 0 and no temperature overflows them; so the row stays in its own
    float32, where a float64 copy of a batch's logits had cost more than the sampling itself."""
    vocab = logits.shape[0]
    ids = _top_k(logits, top_k) if 0 < top_k < vocab else None
    vals = logits if ids is None else logits[ids]
    peak = vals.max()
    if not np.isfinite(peak):  # every token masked to -inf (or NaN logits): nothing to sample from
        return np.array([int(np.argmax(logits))]), np.ones(1)
    probs = np.subtract(vals, peak, dtype=np.result_type(vals.dtype, np.float32))  # 16-bit logits widen
    with np.errstate(over="ignore"):  # a tiny temperature sends the others to -inf: probability 0
        np.divide(probs, max(temperature, _MIN_TEMPERATURE), out=probs)
    np.exp(probs, out=probs)
    if top_p < 1.0:
        probs /= probs.sum(dtype=np.float64)
        keep = np.sort(_nucleus(probs, top_p))  # ids ascending, as every support is: a draw's order
        ids = keep if ids is None else ids[keep]
        probs = probs[keep]
    return ids, probs


# The cumulative sum is taken in two levels, block sums and then one block's entries: numpy's
# cumsum is a serial loop over the whole vocabulary, its sums are not (docs/serve_overhead.md).
_DRAW_BLOCK = 512


def _draw(ids: np.ndarray | None, probs: np.ndarray, u: float) -> int:
    """The token at u in [0, 1) of the distribution's cumulative sum."""
    starts = np.arange(0, len(probs), _DRAW_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(probs, starts, dtype=np.float64))
    target = u * block_cdf[-1]
    # side="right" never lands on a zero-probability block or token; min() guards round-off at the top.
    b = min(int(np.searchsorted(block_cdf, target, side="right")), len(starts) - 1)
    block = probs[starts[b]:starts[b] + _DRAW_BLOCK]
    cdf = np.cumsum(block, dtype=np.float64) + (block_cdf[b - 1] if b else 0.0)
    pos = int(np.searchsorted(cdf, target, side="right"))
    if pos == len(block):  # the two levels' round-off put the target past this block's sum
        pos = int(np.flatnonzero(block)[-1])
    pos += int(starts[b])
    return int(pos if ids is None else ids[pos])


def _sample_row(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token at u of a row's logits at its temperature, after top-k then top-p filtering (the
    tokens in ascending id order, so a draft's distribution over the same ids draws alike)."""
    return _draw(*_support(logits, params.temperature, params.top_k, params.top_p), u)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The dense float64 distribution [V] a sampled row draws its token from (params not greedy)."""
    ids, probs = _support(logits, params.temperature, params.top_k, params.top_p)
    dense = np.zeros(logits.shape[0])
    dense[slice(None) if ids is None else ids] = probs
    return dense / dense.sum()


def sample_from(probs: np.ndarray, u: float) -> int:
    """The token at u of a dense distribution [V] (ids ascending)."""
    return _draw(None, probs, u)


def verify(logits: np.ndarray, proposed: Sequence[int], params: SamplingParams, draws: Draws, position: int,
           greedy: np.ndarray | None = None) -> list[int]:
    """The tokens a row keeps from a verification step: the accepted prefix of `proposed`, then one
    token of the target's own (the correction at the first rejection, or a bonus when all pass).

    logits [k+1, V]: the target's logits after the row's last token and after each proposal, whose
    tokens go at sequence positions `position`, `position` + 1, ... Greedy rows accept while a
    proposal is the target's argmax; sampled rows sample each position with the number plain
    decoding would use there (`draws.at`) and accept while a proposal is that token. Either way the
    output is plain decoding's, token for token, whatever was proposed: proposals only decide how
    many positions one step settles. (For a sampled row this couples the draft's draws to the
    target's instead of Leviathan et al.'s rejection rule: the same distribution, no dependence on
    how steps were cut, and acceptance where the two distributions' cumulative sums agree.)
    `greedy` [k+1]: each logits row's argmax where the graph took it (Engine.greedy_tokens)."""
    if params.greedy:
        target = np.argmax(logits, axis=-1) if greedy is None else greedy
        kept = []
        for x, t in zip(proposed, target):
            if x != t:
                break
            kept.append(int(x))
        return kept + [int(target[len(kept)])]
    kept = []
    for j in range(len(proposed) + 1):
        token = _sample_row(logits[j], params, draws.at(position + j))
        if j == len(proposed) or token != proposed[j]:
            return kept + [token]
        kept.append(token)
    return kept


class Sampler:
    """Picks the next token for each row of a batch of logits."""

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        draws: Sequence[Draws | None],
        positions: Sequence[int],
        argmax: np.ndarray | None = None,
    ) -> np.ndarray:
        """logits [B, V] -> token ids [B] int64. Row i uses params[i] and draws[i]'s number at
        positions[i], the sequence position its token goes to (None: an unseeded row's own).
        `argmax`, each row's argmax when the engine computed it already, serves the greedy rows."""
        if logits.ndim != 2:
            raise ValueError(f"logits must be 2-D [batch, vocab], got shape {logits.shape}")
        batch = logits.shape[0]
        if len(params) != batch or len(draws) != batch or len(positions) != batch:
            raise ValueError(f"got {batch} logit rows, {len(params)} params, {len(draws)} draws and "
                             f"{len(positions)} positions; they must match")

        # All greedy, the common serving case: one argmax, no [B, V] copy. Checked in plain Python:
        # right after a step's graph run the caches hold none of numpy's code, and fromiter + all
        # were measurably slower there (docs/attention_cpu.md).
        if all(p.greedy for p in params):
            return np.argmax(logits, axis=-1).astype(np.int64, copy=False) if argmax is None else argmax
        out = np.empty(batch, dtype=np.int64)
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=batch)
        if greedy.any():
            out[greedy] = np.argmax(logits[greedy], axis=-1) if argmax is None else argmax[greedy]

        sampled = np.flatnonzero(~greedy)
        for i in sampled:
            out[i] = _sample_row(logits[i], params[i], (draws[i] or Draws()).at(positions[i]))
        return out
