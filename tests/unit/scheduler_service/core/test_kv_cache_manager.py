"""KVCacheManager: block tables, chained prefix hashes, hits, eviction order, no leaks."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.block_hashes import hash_block, salt_root
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request
from scheduler_service.core.sliding_window import num_skipped_blocks

BS = 4


def req(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(), StoppingParams(max_tokens=None))


def prefill(kv, request, chunk=None):
    """Admit like the scheduler: prefix lookup, then allocate the (first) chunk."""
    hits, num_hit = kv.get_computed_blocks(request)
    n = request.num_tokens - num_hit if chunk is None else chunk
    new = kv.allocate_slots(request, n, hits)
    if new is not None:
        request.num_computed_tokens = num_hit + n
    return new, num_hit


def chain_hashes(tokens):
    out, parent = [], None
    for j in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[j * BS:(j + 1) * BS])
        out.append(parent)
    return out


def test_hash_is_process_independent():
    code = ("from scheduler_service.core.block_hashes import hash_block;"
            "print(hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True,
                           cwd=".").stdout.strip() for seed in ("1", "2")}
    assert outs == {hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()}
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(b"x", [1, 2, 3, 4])


def test_hash_values_are_pinned():
    """The digests the prefix cache and its KV events (vLLM's block hashes) name blocks by:
    blake2b-128 of the parent digest then the ids as uint32, unchanged across versions."""
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0.hex() == "5c3887ef44b86da26265cb5c108a056b"
    assert hash_block(h0, [5, 6, 7, 8]).hex() == "1664ccca28a32287142c2088ea54ac27"
    assert hash_block(salt_root("k"), [9]).hex() == "d45fae15537197436dc78b0ea1dfbff3"


def test_block_hashes_in_pieces_are_hash_block_chained_from_the_salt():
    """The manager hashes many blocks from one buffer: the same digests as hash_block one
    block at a time, from the salt's root, when extended piecewise across prompt and output."""
    kv = KVCacheManager(16, BS, enable_caching=True)
    r = Request("s", list(range(10)), SamplingParams(), StoppingParams(max_tokens=None),
                cache_salt="key:s")
    r.output_token_ids.extend([70000, 11, 12, 13, 14, 15])
    parent, expected = salt_root("key:s"), []
    for j in range(4):
        parent = hash_block(parent, r.all_token_ids[j * BS:(j + 1) * BS])
        expected.append(parent)
    assert kv._block_hashes(r, 1) == expected[:1]
    assert kv._block_hashes(r, 4) == expected       # blocks 1-3 cross into the output
    # The same from the prompt's bytes made at admission (blocks within the prompt).
    from array import array
    kv2 = KVCacheManager(16, BS, enable_caching=True)
    r2 = Request("t", list(range(10)), SamplingParams(), StoppingParams(max_tokens=None),
                 cache_salt="key:s")
    r2.prompt_u32 = array("I", r2.prompt_token_ids).tobytes()
    assert kv2._block_hashes(r2, 1) == expected[:1]
    assert kv2._block_hashes(r2, 2) == expected[:2]
    r2.output_token_ids.extend([70000, 11, 12, 13, 14, 15])
    assert kv2._block_hashes(r2, 4) == expected


def test_a_hit_needs_the_same_salt():
    kv = KVCacheManager(16, BS, enable_caching=True)
    prefill(kv, req("a", range(9)))
    salted = Request("b", list(range(9)), SamplingParams(), StoppingParams(max_tokens=None),
                     cache_salt="key:b")
    assert prefill(kv, salted)[1] == 0           # the unsalted blocks are not B's
    again = Request("b2", list(range(9)), SamplingParams(), StoppingParams(max_tokens=None),
                    cache_salt="key:b")
    assert prefill(kv, again)[1] == 8            # its own are
    other = Request("c", list(range(9)), SamplingParams(), StoppingParams(max_tokens=None),
                    cache_salt="key:c")
    assert prefill(kv, other)[1] == 0


def test_hits_never_cover_the_last_token():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = req("a", range(8))
    prefill(kv, a)
    assert kv.get_block_ids(a) == [0, 1]
    b = req("b", range(8))                   # same 8 tokens: only the first block may hit
    _, num_hit = prefill(kv, b)
    assert num_hit == 4 and kv.get_block_ids(b)[0] == 0 and kv.get_block_ids(b)[1] != 1
    c = req("c", range(9))
    _, num_hit = prefill(kv, c)
    assert num_hit == 8 and kv.get_block_ids(c)[:2] == [0, 1]
    assert kv.pool.blocks[0].ref_cnt == 3 and kv.pool.blocks[1].ref_cnt == 2
    assert kv.stats.queries == 25 and kv.stats.hits == 12
    for r in (a, b, c):
        kv.free(r)
    assert kv.num_free_blocks == 16 and kv.usage == 0.0


def test_allocate_fails_without_changes_and_counts_evictable_hits():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = req("a", range(12))
    prefill(kv, a)                            # 3 full blocks, all cached
    kv.free(a)
    assert kv.num_free_blocks == 4
    # b hits 2 cached-but-free blocks and needs 3 new: 5 > 4 free, so nothing may change.
    b = req("b", list(range(8)) + [50] * 9)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 9, hits) is None
    assert kv.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.get_block_ids(b) == []
    new = kv.allocate_slots(b, 8, hits)       # 2 hits + 2 new fit exactly
    assert len(new) == 2 and kv.num_free_blocks == 0 and kv.usage == 1.0
    kv.free(b)
    assert kv.num_free_blocks == 4


def test_tail_blocks_evicted_first():
    kv = KVCacheManager(5, BS, enable_caching=True)
    a = req("a", range(13))
    prefill(kv, a)                            # blocks 0..3, 0..2 cached
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 3, 2, 1, 0]
    other = req("o", range(100, 109))        # 3 blocks: 4, then a's tail 3 and 2
    prefill(kv, other)
    assert kv.get_block_ids(other) == [4, 3, 2]
    kv.free(other)
    again = req("again", range(13))
    _, num_hit = prefill(kv, again)
    assert num_hit == 8 and kv.get_block_ids(again)[:2] == [0, 1]
    kv.free(again)


def test_blocks_cached_as_decode_fills_them():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = req("a", range(3))
    prefill(kv, a)
    for t in range(5):                        # decode: positions 3..7 fill blocks 0 and 1
        a.output_token_ids.append(200 + t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    ids = kv.get_block_ids(a)
    assert [kv.pool.blocks[i].block_hash for i in ids] == chain_hashes(a.all_token_ids)
    b = req("b", a.all_token_ids + [1])
    _, num_hit = prefill(kv, b)
    assert num_hit == 8 and kv.get_block_ids(b)[:2] == ids
    # Tokens known but not scheduled for compute are never cached.
    c = req("c", range(50, 53))
    c.output_token_ids += [1, 2, 3, 4, 5]
    assert len(kv.allocate_slots(c, 5)) == 2
    assert [kv.pool.blocks[i].block_hash is None for i in kv.get_block_ids(c)] == [False, True]
    for r in (a, b, c):
        kv.free(r)
    assert kv.num_free_blocks == 8


class ManagerMachine(RuleBasedStateMachine):
    """Random admit / chunk / decode / free with heavily shared prefixes."""

    WINDOW = 0       # a sliding window on every layer (WindowedManagerMachine)

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(12, BS, enable_caching=True, sliding_window=self.WINDOW)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)]),
          tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
          chunk=st.integers(1, 8))
    def admit(self, prefix, tail, chunk):
        r = req(f"r{self.n}", list(prefix) + tail)
        self.n += 1
        hits, num_hit = self.kv.get_computed_blocks(r)
        assert num_hit % BS == 0 and num_hit < r.num_tokens
        n = min(chunk, r.num_tokens - num_hit)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(r, n, hits) is None:
            assert self.kv.num_free_blocks == free_before and self.kv.get_block_ids(r) == []
            self.kv.free(r)
            return
        r.num_computed_tokens = num_hit + n
        self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3))
    def advance(self, data, token):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(token)  # decode: feed the sampled token
        n = min(data.draw(st.integers(1, 8)), r.num_tokens - r.num_computed_tokens)
        if self.kv.allocate_slots(r, n) is not None:
            r.num_computed_tokens += n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow_below_quiet_until(self, data):
        """Up to quiet_until, allocate_slots changes nothing: the scheduler skips the call."""
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        room = self.kv.quiet_until[r.request_id] - r.num_computed_tokens
        if room < 1:
            return
        n = data.draw(st.integers(1, room))

        def state():
            return (self.kv.get_block_ids(r), self.kv.pool.free_block_ids(),
                    [b.block_hash for b in self.kv.pool.blocks], dict(self.kv.quiet_until))
        before = state()
        assert self.kv.allocate_slots(r, n) == []
        assert state() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @invariant()
    def consistent(self):
        holders: dict[int, int] = {}
        for r in self.live.values():
            table = self.kv._blocks[r.request_id]
            assert len(table) == -(-r.num_computed_tokens // BS)
            skipped = num_skipped_blocks(r.num_computed_tokens, self.WINDOW, BS)
            hashes = chain_hashes(r.all_token_ids[:r.num_computed_tokens])
            for j, block in enumerate(table):
                if block is self.kv.null_block:     # only below what the window sees
                    assert j < skipped
                    continue
                bid = block.block_id
                holders[bid] = holders.get(bid, 0) + 1
                assert block is self.kv.pool.blocks[bid]
                # A cached block in a table holds exactly the tokens of that table position.
                if block.block_hash is not None:
                    assert j < len(hashes) and block.block_hash == hashes[j]
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0) >= 0
            assert block.ref_cnt <= 1 or block.block_hash is not None
        assert self.kv.num_free_blocks == 12 - len(holders)

    def teardown(self):
        for r in self.live.values():
            self.kv.free(r)
        assert self.kv.num_free_blocks == 12 and self.kv.usage == 0.0


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class WindowedManagerMachine(ManagerMachine):
    """The same with a window of 6 tokens on every layer: blocks that left it are freed."""

    WINDOW = 6


TestWindowedManagerMachine = WindowedManagerMachine.TestCase
TestWindowedManagerMachine.settings = settings(max_examples=60, stateful_step_count=30,
                                               deadline=None)


@pytest.mark.parametrize("window, caching", [(0, True), (0, False), (6, True)])
def test_grow_fitting_takes_num_fitting_tokens_and_refuses_past_it(window, caching):
    """The long-prefill path asks grow_fitting for at most num_fitting_tokens: exactly that
    many always fit (with a window, counting the blocks it frees first); one more is the
    caller's bug, refused loudly with nothing changed (grow_slots' None, read as "no new
    blocks", scheduled tokens with no KV block to write to)."""
    kv = KVCacheManager(8, BS, enable_caching=caching, sliding_window=window)
    other = req("other", range(100, 109))
    prefill(kv, other)                        # 3 blocks
    long = req("long", range(40))
    prefill(kv, long, chunk=10)               # 3 blocks, 2 left free
    freed = kv.num_freed_by_window(long)
    assert freed == (1 if window else 0)      # a window of 6 no longer sees block 0
    fitting = kv.num_fitting_tokens(long)
    assert fitting == (3 + 2 + freed) * BS - 10
    ids = kv.get_block_ids(long)
    with pytest.raises(RuntimeError, match=rf"{fitting + 1} new tokens of long do not fit "
                                           rf"\(at most num_fitting_tokens={fitting}\)"):
        kv.grow_fitting(long, fitting + 1)
    assert kv.get_block_ids(long)[1:] == ids[1:]      # but the block behind the window
    assert kv.pool.num_free_blocks == 2 + freed
    new_ids = kv.grow_fitting(long, fitting)
    assert len(new_ids) == 2 + freed and kv.pool.num_free_blocks == 0
    kv.free(long)
    kv.free(other)
    assert kv.pool.num_free_blocks == 8
