"""BlockManager: allocation, reference counts, the prefix cache's hash chain and its LRU eviction."""

from __future__ import annotations

import pytest

from engine.memory import kv_cache
from engine.memory.kv_cache import BlockManager
from engine.request import Request, SamplingParams

BS = 4  # tokens per block in these tests


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_new_tokens=8))


def compute(bm: BlockManager, r: Request, num_tokens: int | None = None) -> None:
    """Admit `r` and pretend the model computed its first `num_tokens` tokens (default: all)."""
    n = r.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate(r, n)
    r.num_computed_tokens = n
    bm.cache_full_blocks(r)


def test_blocks_needed() -> None:
    bm = BlockManager(8, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_and_free_returns_everything() -> None:
    bm = BlockManager(8, BS)
    r = req("a", list(range(6)))
    assert bm.allocate(r, 6) and len(r.block_table) == 2
    assert bm.allocate(r, 8) and len(r.block_table) == 2  # still covered
    assert bm.allocate(r, 9) and len(r.block_table) == 3
    assert len(set(r.block_table)) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_count(b) == 1 for b in r.block_table)
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(4, BS)
    a = req("a", list(range(10)))
    assert bm.allocate(a, 10)  # 3 blocks
    b = req("b", list(range(100, 110)))
    assert not bm.allocate(b, 10)  # needs 3, 1 left
    assert b.block_table == [] and bm.num_free_blocks == 1
    table = list(a.block_table)
    assert not bm.allocate(a, 20)  # needs 2 more, 1 left
    assert a.block_table == table and bm.num_free_blocks == 1


def test_allocate_is_all_or_nothing_with_a_prefix_hit() -> None:
    """Evictable blocks revived by a hit are not free for the rest of the same allocation."""
    bm = BlockManager(4, BS)
    a = req("a", list(range(9)))
    compute(bm, a)  # blocks 0, 1 cached, 2 private
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = req("b", list(range(8)) + list(range(50, 62)))  # hits 2 blocks, needs 5 in all
    assert bm.match_prefix(b) == 8
    assert not bm.allocate(b, b.num_tokens)
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.match_prefix(b) == 8  # nothing was evicted by the failed attempt


def test_shared_prefix_hits_and_reference_counts() -> None:
    bm = BlockManager(16, BS)
    system = list(range(1, 9))  # two full blocks
    a = req("a", system + [20, 21, 22])
    assert bm.match_prefix(a) == 0
    compute(bm, a)
    assert bm.num_cached_blocks == 2  # the partial third block is not cached

    b = req("b", system + [30, 31, 32, 33, 34])
    c = req("c", system[:4] + [40, 41, 42, 43, 44])
    assert (bm.match_prefix(b), bm.match_prefix(c)) == (8, 4)
    assert all(bm.ref_count(x) == 1 for x in a.block_table)  # lookups take no references
    assert bm.allocate(b, b.num_tokens) and bm.allocate(c, c.num_tokens)
    assert b.block_table[:2] == a.block_table[:2] and c.block_table[:1] == a.block_table[:1]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert (c.num_computed_tokens, c.num_cached_tokens) == (4, 4)
    assert bm.ref_count(a.block_table[0]) == 3 and bm.ref_count(a.block_table[1]) == 2
    assert bm.ref_count(a.block_table[2]) == 1  # a's partial tail is private
    assert len(set(a.block_table[2:] + b.block_table[2:] + c.block_table[1:])) == 5

    for r in (a, b, c):
        bm.free(r)
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0


def test_match_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(8, BS)
    a = req("a", list(range(12)))
    compute(bm, a)
    assert bm.num_cached_blocks == 3
    assert bm.match_prefix(req("same", list(range(12)))) == 8  # 11 tokens rounded down to blocks
    assert bm.match_prefix(req("longer", list(range(13)))) == 12
    assert bm.match_prefix(req("short", list(range(5)))) == 4
    assert bm.match_prefix(req("one", [0])) == 0


def test_hit_requires_the_same_parent() -> None:
    """Equal blocks after different prefixes are different KV: the chain must tell them apart."""
    bm = BlockManager(8, BS)
    compute(bm, req("a", [1, 1, 1, 1, 7, 7, 7, 7, 0]))
    assert bm.match_prefix(req("b", [2, 2, 2, 2, 7, 7, 7, 7, 0])) == 0
    assert bm.match_prefix(req("c", [7, 7, 7, 7, 0])) == 0
    assert bm.match_prefix(req("d", [1, 1, 1, 1, 7, 7, 7, 7, 9])) == 8


def test_hash_collisions_never_share_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, tokens: b"same")
    bm = BlockManager(16, BS)
    a = req("a", [1, 2, 3, 4, 5])
    compute(bm, a)
    assert bm.num_cached_blocks == 1
    b = req("b", [9, 9, 9, 9, 5])  # same hash, other tokens
    assert bm.match_prefix(b) == 0
    assert bm.allocate(b, b.num_tokens) and not set(b.block_table) & set(a.block_table)
    assert b.num_computed_tokens == 0

    # Same tokens under the same hash but after another parent: still a miss.
    c = req("c", [1, 2, 3, 4, 8, 8, 8, 8, 0])
    compute(bm, c)  # its 2nd block replaces the 1st under the one hash
    d = req("d", [8, 8, 8, 8, 0])
    assert bm.match_prefix(d) == 0
    assert bm.allocate(d, d.num_tokens) and d.num_computed_tokens == 0
    assert not set(d.block_table) & set(c.block_table)
    for r in (a, b, c, d):
        bm.free(r)
    assert bm.num_free_blocks == 16


def test_lru_eviction_order() -> None:
    bm = BlockManager(6, BS)
    a = req("a", [1, 1, 1, 1, 2, 2, 2, 2])
    b = req("b", [3, 3, 3, 3, 4, 4, 4, 4])
    compute(bm, a)
    compute(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)  # tail first: 1, 0
    bm.free(b)  # then 3, 2
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4

    x = req("x", list(range(100, 112)))
    assert bm.allocate(x, 12)
    assert x.block_table == [4, 5, 1]  # truly free blocks first, then the least recently freed
    assert not bm.is_cached(1) and bm.is_cached(0)

    # A hit makes a block recently used: a's head (0) is revived, which evicts b's tail (3).
    c = req("c", [1, 1, 1, 1, 0])
    assert bm.allocate(c, c.num_tokens)
    assert c.block_table == [0, 3] and c.num_computed_tokens == 4
    bm.free(c)  # 3 (now private) is free, 0 is the most recently used evictable block
    y = req("y", list(range(200, 208)))
    assert bm.allocate(y, 8)
    assert y.block_table == [3, 2]  # b's head goes before a's head
    assert bm.is_cached(0) and not bm.is_cached(2)
    assert bm.match_prefix(req("a2", a.prompt_token_ids)) == 4


def test_cache_full_blocks_is_incremental_and_idempotent() -> None:
    bm = BlockManager(8, BS)
    a = req("a", list(range(10)))
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 0  # block 0 not full of computed tokens yet
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 2 and not bm.is_cached(a.block_table[2])
    # Decoding fills the private tail; once full it is cached too.
    a.token_ids += [10, 11]
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 3
    assert bm.match_prefix(req("b", list(range(13)))) == 12


def test_same_content_computed_twice_is_cached_once_and_chains_on() -> None:
    bm = BlockManager(16, BS)
    a = req("a", [1, 2, 3, 4, 0])
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.allocate(a, a.num_tokens) and bm.allocate(b, b.num_tokens)  # both miss
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    assert bm.is_cached(a.block_table[0]) and not bm.is_cached(b.block_table[0])
    assert bm.is_cached(b.block_table[1])  # chained on a's equal block 0
    c = req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(c, c.num_tokens)
    assert c.block_table[:2] == [a.block_table[0], b.block_table[1]]


def test_preempted_request_rematches_its_own_blocks() -> None:
    bm = BlockManager(8, BS)
    a = req("a", list(range(6)))
    compute(bm, a)
    a.token_ids += [6, 7, 8]  # three decoded tokens, two of them computed
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    table = list(a.block_table)
    bm.free(a)
    a.num_computed_tokens, a.num_preemptions = 0, 1
    assert bm.allocate(a, a.num_tokens)
    assert a.block_table[:2] == table and a.num_computed_tokens == 8
    assert a.num_cached_tokens == 0  # recorded at first admission only, which missed


def test_reset_prefix_cache() -> None:
    bm = BlockManager(8, BS)
    a, b = req("a", list(range(9))), req("b", list(range(50, 59)))
    compute(bm, a)
    compute(bm, b)
    bm.free(a)
    assert not bm.reset_prefix_cache()  # b still holds blocks
    assert bm.num_cached_blocks == 2  # b's cached blocks stay
    assert bm.match_prefix(req("a2", list(range(9)))) == 0
    assert bm.match_prefix(req("b2", list(range(50, 59)))) == 8
    bm.free(b)
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.match_prefix(req("b3", list(range(50, 59)))) == 0


def test_prefix_caching_off() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    compute(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(req("b", list(range(9)))) == 0


def test_forget_prefixes_drops_blocks_in_use_too() -> None:
    """After the KV is lost, no block (in use or not) answers a prefix lookup, and a request that
    keeps its blocks registers nothing more (its later blocks hang off lost KV)."""
    bm = BlockManager(16, BS)
    held, done = req("held", list(range(12))), req("done", list(range(100, 110)))
    compute(bm, held, 8)
    compute(bm, done)
    bm.free(done)
    assert bm.num_cached_blocks == 4 and not bm.reset_prefix_cache() and bm.num_cached_blocks == 2  # in use: kept
    bm.forget_prefixes()
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 2  # `held` keeps its blocks
    assert bm.match_prefix(req("again", list(range(12)))) == 0
    assert bm.allocate(held, 12)
    held.num_computed_tokens = 12
    bm.cache_full_blocks(held)  # its third block fills, off KV that is lost: not registered
    assert bm.num_cached_blocks == 0
    bm.free(held)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 0
