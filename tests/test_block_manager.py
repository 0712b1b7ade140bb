"""Property test of the KV block manager over random allocate / append / fork-by-prefix / free."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmc.runtime.kv_cache import BlockManager

BLOCK = 4


class Seq:
    def __init__(self, tokens):
        self.token_ids = list(tokens)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.cache_salt = None
        self.state_slot = 0


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mgr = BlockManager(num_blocks=24, block_size=BLOCK)
        self.live: list[Seq] = []

    def _admit(self, seq: Seq) -> None:
        cached = self.mgr.allocate_prefix(seq)
        assert cached % BLOCK == 0 and cached < len(seq.token_ids)
        assert seq.token_ids[:cached] == seq.token_ids[:cached]
        self.live.append(seq)

    # Tokens from a 2-letter alphabet make shared prefixes (and so cache hits) common.
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=30))
    def allocate(self, tokens):
        self._admit(Seq(tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), max_size=12))
    def fork_by_prefix(self, data, extra):
        parent = data.draw(st.sampled_from(self.live))
        cut = data.draw(st.integers(1, len(parent.token_ids)))
        self._admit(Seq(parent.token_ids[:cut] + extra))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute_and_decode(self, data):
        seq = data.draw(st.sampled_from(self.live))
        pending = len(seq.token_ids) - seq.num_computed_tokens
        n = data.draw(st.integers(0, pending)) if pending else 0
        if not self.mgr.can_append(seq, seq.num_computed_tokens + n):
            return
        self.mgr.append(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.mgr.commit(seq)
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(data.draw(st.integers(0, 1)))  # a sampled token

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.mgr.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    @invariant()
    def consistent(self):
        self.mgr.check([s.block_table for s in self.live])
        used = {b for s in self.live for b in s.block_table}
        assert self.mgr.num_free == self.mgr.capacity - len(used)

    @invariant()
    def shared_blocks_hold_the_same_tokens(self):
        """Every computed full block a sequence points at holds that sequence's tokens."""
        for s in self.live:
            for i in range(s.num_computed_tokens // BLOCK):
                tokens = self.mgr._blocks[s.block_table[i]].tokens
                assert tokens == tuple(s.token_ids[i * BLOCK:(i + 1) * BLOCK]), (i, tokens)

    def teardown(self):
        for seq in self.live:
            self.mgr.free(seq)
        self.mgr.check([])
        assert self.mgr.num_free == self.mgr.capacity  # nothing leaked


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_lru_reuse_and_eviction_counters():
    mgr = BlockManager(num_blocks=4, block_size=BLOCK)  # 3 usable blocks
    a = Seq(range(9))
    mgr.allocate_prefix(a)
    mgr.append(a, 9)
    a.num_computed_tokens = 9
    mgr.commit(a)
    mgr.free(a)
    b = Seq(range(9))  # same prompt: its two full blocks come back from the free list
    assert mgr.allocate_prefix(b) == 8
    mgr.free(b)
    c = Seq([7] * 12)
    mgr.allocate_prefix(c)
    mgr.append(c, 12)  # needs all 3 blocks: the cached ones are evicted
    assert mgr.stats.evictions == 2
    mgr.free(c)
    assert mgr.allocate_prefix(Seq(range(9))) == 0


def test_a_hybrids_sequences_hold_one_state_slot_each_while_they_have_blocks():
    import pytest

    mgr = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True, state_slots=3)
    assert not mgr.enable_prefix_caching  # a block's KV is not the state at its end
    a, b, c = Seq([0] * 9), Seq([0] * 9), Seq([1] * 5)
    for seq in (a, b):
        assert mgr.allocate_prefix(seq) == 0
        mgr.append(seq, len(seq.token_ids))
    assert {a.state_slot, b.state_slot} == {1, 2}  # slot 0 is scratch, never handed out
    slot = a.state_slot
    mgr.append(a, 12)  # growing keeps the slot
    assert a.state_slot == slot
    with pytest.raises(MemoryError, match="state slot"):
        mgr.append(c, 5)
    mgr.free(a)
    assert a.state_slot == 0
    mgr.append(c, 5)
    assert c.state_slot == slot
