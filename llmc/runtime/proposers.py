"""Proposers for speculative decoding: each sets a decoding request's `proposal`, up to the k
tokens the policy (runtime/speculation.py) asked for, and does nothing else.

Prompt lookup proposes the continuation of the latest earlier occurrence of the sequence's last n
tokens. A draft engine (a smaller llmc engine with the same tokenizer and its own paged cache)
decodes k tokens for every speculating row as one batch. With both (a draft and
`draft_prompt_lookup`), the policy asks prompt lookup first and the draft for the rows it left.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.kv_cache import BlockManager
from llmc.runtime.request import Request
from llmc.runtime.sampling import distribution, sample_from
from llmc.runtime.step import Row

# New tokens a draft row's first proposal call feeds itself: after a step that kept every proposal
# there are two (the last proposal, never fed, and the target's token), and one call is cheaper
# than a catch-up call and a proposal call.
CATCH_UP = 2


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from `max_n` down to `min_n`), from a per-request index of n-grams."""

    sets_its_length = True  # a continuation is trusted for twice the length its match agrees

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(max_n, min_n - 1, -1)
        self._index: dict[str, tuple[list[dict], list[int]]] = {}

    def propose(self, rows: list[Request], ks: list[int]) -> None:
        """Set each row's proposal of up to k tokens."""
        for r, k in zip(rows, ks):
            r.proposal = self.lookup(r, k) if k else []

    def lookup(self, r: Request, k: int) -> list[int]:
        tokens = r.token_ids
        tables, done = self._index.setdefault(r.request_id, ([{} for _ in self.sizes], [0]))
        for end in range(done[0], len(tokens)):  # n-grams ending before `end`, followed by tokens[end]
            for n, table in zip(self.sizes, tables):
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        done[0] = len(tokens)
        for n, table in zip(self.sizes, tables):
            end = table.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if end is not None:
                # How far the two occurrences agree, back from the match (up to half of k): a
                # continuation is trusted for twice that, since a lone token or pair that recurs
                # says little about what follows it (simulated: docs/speculative.md).
                same = n
                while 2 * same < k and same < end and tokens[end - same - 1] == tokens[-same - 1]:
                    same += 1
                # A match that ends `period` tokens back says the text repeats with that period
                # (a loop); its continuation runs into the sequence's end, so it goes on around.
                period = len(tokens) - end
                return [tokens[end + j % period] for j in range(min(k, 2 * same))]
        return []

    def release(self, r: Request) -> None:
        self._index.pop(r.request_id, None)


@dataclass
class _DraftSeq:
    """A request's sequence in the draft engine's cache (the BlockManager's sequence protocol)."""
    token_ids: list[int] = field(default_factory=list)  # what the draft has been fed, in order
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: int | None = None
    agreed: int = 0  # the target's length when last caught up: token_ids match it that far


class DraftProposer:
    """A smaller engine proposes by decoding k tokens for every speculating row at once."""

    def __init__(self, path: str | Path, target: Engine, tokenizer_file: Path, options):
        from llmc.contract.engine_dir import open_engine

        files = open_engine(path, verify_checksums=options.verify_checksums)
        if files.tokenizer.read_bytes() != tokenizer_file.read_bytes():
            raise LlmcError(f"draft engine {path} has another tokenizer than the target's; a draft must share "
                            "the target's tokenizer (build both from models trained with one)")
        if files.manifest.states:
            raise LlmcError(f"draft engine {path} is a hybrid ({files.manifest.model_spec.architecture}), whose "
                            "recurrent state cannot be rolled back past rejected tokens; use a transformer as the draft")
        if files.manifest.model_spec.vocab_size != target.spec.vocab_size:
            raise LlmcError(f"draft engine {path} has a vocabulary of {files.manifest.model_spec.vocab_size} "
                            f"tokens, the target {target.spec.vocab_size}; they must match")
        # One thread that never spins: the draft's and the target's sessions alternate every few
        # hundred microseconds, and two spinning pools on the same cores slow both (docs/speculative.md).
        self.engine = Engine(files, dataclasses.replace(options, num_threads=1, allow_spinning=False))
        # A --draft-vocab head's logits column j is token head[j]; None: column j is token j.
        kept = files.manifest.lm_head_tokens
        self.head = None if kept is None else np.asarray(kept, np.int64)
        self.blocks = BlockManager(self.engine.num_blocks, self.engine.block_size, enable_prefix_caching=False)
        self.chunk = options.chunk_size
        self._seqs: dict[str, _DraftSeq] = {}

    def propose(self, rows: list[Request], ks: list[int]) -> None:
        """Set each row's proposal of up to k tokens."""
        live = []
        for r, k in zip(rows, ks):
            r.proposal = []
            k = min(k, self.engine.max_context - len(r.token_ids))
            if k > 0 and self._catch_up(r, k):
                live.append((r, k))
        if not live:
            return
        self._prefill([self._seqs[r.request_id] for r, _ in live])
        # Each draft call feeds every row's newest token and reads its next one.
        for j in range(max(k for _, k in live)):
            step = [(r, k) for r, k in live if k > j]
            seqs = [self._seqs[r.request_id] for r, _ in step]
            logits = self.engine.forward_rows([Row(s.token_ids[s.num_computed_tokens:], s.num_computed_tokens,
                                                   s.block_table) for s in seqs])
            greedy = self.engine.greedy_tokens(logits)  # the graph's argmax, where it has one
            for i, ((r, k), s, row) in enumerate(zip(step, seqs, logits)):
                s.num_computed_tokens = len(s.token_ids)
                if r.params.greedy:
                    token = int(np.argmax(row) if greedy is None else greedy[i])
                else:  # the number the target samples this position with: the two draw alike
                    token = sample_from(distribution(row, r.params), r.draws.at(len(r.token_ids) + j))
                if self.head is not None:  # its columns are ids ascending: the target's order
                    token = int(self.head[token])
                r.proposal.append(token)
                if j + 1 < k:
                    s.token_ids.append(token)

    def _catch_up(self, r: Request, k: int) -> bool:
        """Point the request's draft sequence at the target's tokens: keep the cached prefix the
        two agree on (proposals the target rejected diverge) and make room for k more tokens."""
        s = self._seqs.setdefault(r.request_id, _DraftSeq())
        limit = min(s.num_computed_tokens, len(r.token_ids))
        same = min(s.agreed, limit)  # the target's tokens only grow: up to `agreed` they still match
        while same < limit and s.token_ids[same] == r.token_ids[same]:
            same += 1
        s.num_computed_tokens = same
        s.token_ids = list(r.token_ids)
        s.agreed = len(r.token_ids)
        self.blocks.truncate(s, same)
        need = len(s.token_ids) + k - 1
        if not self.blocks.can_append(s, need):
            self.release(r)  # no room in the draft's pool: no proposal this step
            return False
        self.blocks.append(s, need)
        return True

    def _prefill(self, seqs: list[_DraftSeq]) -> None:
        """Compute all but the last CATCH_UP of each row's new tokens in chunks (the first proposal
        call feeds those and reads the last one's logits)."""
        while True:
            rows = [s for s in seqs if _behind(s) > 0]
            if not rows:
                return
            chunks = [s.token_ids[s.num_computed_tokens:len(s.token_ids) - CATCH_UP][:self.chunk] for s in rows]
            self.engine.forward_rows([Row(c, s.num_computed_tokens, s.block_table) for c, s in zip(chunks, rows)],
                                     logits_indices=[])
            for c, s in zip(chunks, rows):
                s.num_computed_tokens += len(c)

    def release(self, r: Request) -> None:
        s = self._seqs.pop(r.request_id, None)
        if s is not None:
            self.blocks.free(s)


def _behind(s: _DraftSeq) -> int:
    """The tokens a draft sequence's catch-up prefills: all it has not computed but the last CATCH_UP."""
    return max(len(s.token_ids) - CATCH_UP - s.num_computed_tokens, 0)
