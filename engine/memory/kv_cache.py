"""Paged KV bookkeeping: the blocks each request holds, their reference counts, the prefix cache.

The KV tensor is `kv_budget.make_kv_cache`'s; this file only hands out block ids 0..num_blocks-1.
Block i of a request's `block_table` holds the KV of its tokens [i * block_size, (i + 1) * block_size).

Prefix cache. A FULL block whose tokens are all computed is registered under a hash chained from
its parent block's hash and its own token ids, so a hash names the block's whole prefix. A lookup
is verified, never trusted: the cached block must hold the same token ids and hang off the same
parent entry (entries carry a serial number that is never reused), so a hash collision costs a
miss, never wrong KV. Only full blocks are cached and shared; a request's partially filled last
block is private, and a full block is never written again, so sharing it between requests is safe.

Every block is in exactly one state:
  used       ref_count > 0 (and maybe cached)
  evictable  ref_count == 0 and cached: a prefix hit may revive it until its id is needed; LRU order
  free       ref_count == 0 and not cached
New blocks come from the free list first, then from evicting the least recently used evictable block.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import Request

ROOT_HASH = b""  # the parent hash of a request's first block
ROOT_SERIAL = 0  # the parent serial of a request's first block; cache entries count from 1


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block: blake2b over the parent's hash and the token ids as int64."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class _Entry:
    """What a cached block holds. `serial` is unique to this entry: a child names its parent by it."""

    hash: bytes
    token_ids: tuple[int, ...]
    parent_serial: int
    serial: int


@dataclass(slots=True)
class _Chain:
    """How far a request's blocks are registered: its first `num_blocks` blocks are; `hash` and
    `serial` name the content of the last of them (ROOT_HASH and ROOT_SERIAL when none)."""

    num_blocks: int = 0
    hash: bytes = ROOT_HASH
    serial: int = ROOT_SERIAL


class BlockManager:
    """Block pool and prefix cache for one KV tensor of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # The prefix cache: hash -> block id, and block id -> entry, kept one to one.
        self._cache: dict[bytes, int] = {}
        self._entries: dict[int, _Entry] = {}
        # request id -> how far its blocks are registered; while it holds blocks, caching on.
        self._chains: dict[str, _Chain] = {}
        self._serials = itertools.count(ROOT_SERIAL + 1)

    # ---- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (ref_count > 0)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, used or evictable."""
        return len(self._entries)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entries

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-max(num_tokens, 0) // self.block_size)

    # ---- prefix lookup ------------------------------------------------------------------------

    def match_prefix(self, req: Request) -> int:
        """Tokens of `req` (which holds no blocks) the prefix cache already has, in whole blocks, at
        most num_tokens - 1 so one token is left to compute. A pure lookup: takes no references."""
        if req.block_table:
            raise ValueError(f"match_prefix: request {req.request_id} already holds blocks")
        blocks, _ = self._match(req)
        return len(blocks) * self.block_size

    def max_cached_tokens(self, req: Request) -> int:
        """The most tokens of `req` the prefix cache can serve: whole blocks, at most num_tokens - 1
        (one token is always computed) and none past `req.prefix_cache_limit`."""
        return min(req.num_tokens - 1, req.prefix_cache_limit) // self.block_size * self.block_size

    def _match(self, req: Request) -> tuple[list[int], _Chain]:
        """The cached blocks holding the longest matching prefix, and the chain they end."""
        chain = _Chain()
        blocks: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, chain
        bs = self.block_size
        for i in range(self.max_cached_tokens(req) // bs):
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            h = hash_block(chain.hash, tokens)
            block = self._lookup(h, tokens, chain.serial)
            if block is None:
                break
            blocks.append(block)
            chain = _Chain(i + 1, h, self._entries[block].serial)
        return blocks, chain

    def _lookup(self, h: bytes, tokens: tuple[int, ...], parent_serial: int) -> int | None:
        """The cached block under `h`, if it really holds `tokens` after the parent `parent_serial`."""
        block = self._cache.get(h)
        if block is None:
            return None
        entry = self._entries[block]
        if entry.token_ids != tokens or entry.parent_serial != parent_serial:
            return None  # a hash collision, or a child of an evicted parent
        return block

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make `req.block_table` cover `num_tokens` tokens; all or nothing (False changes nothing).

        On a request's first allocation (empty table, nothing computed) the matched prefix blocks
        are shared first and `num_computed_tokens` jumps past them; `num_cached_tokens` records
        the hit only on the first admission (num_preemptions == 0)."""
        if self.blocks_needed(num_tokens) <= len(req.block_table):
            return True
        fresh = not req.block_table
        if fresh and req.num_computed_tokens != 0:
            raise ValueError(
                f"request {req.request_id} holds no blocks but {req.num_computed_tokens} computed tokens"
            )
        matched, chain = self._match(req) if fresh else ([], _Chain())
        need = max(self.blocks_needed(num_tokens) - len(req.block_table) - len(matched), 0)
        revived = sum(1 for b in matched if self._ref_counts[b] == 0)  # evictable now, used after
        if need > self.num_free_blocks - revived:
            return False
        if fresh:
            for b in matched:
                if self._ref_counts[b] == 0:
                    del self._evictable[b]
                self._ref_counts[b] += 1
            req.block_table = matched
            req.num_computed_tokens = len(matched) * self.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            if self.enable_prefix_caching:
                self._chains[req.request_id] = chain
        req.block_table.extend(self._take() for _ in range(need))
        return True

    def _take(self) -> int:
        """One block for a new allocation: a free one, else the least recently used evictable one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        self._ref_counts[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        entry = self._entries.pop(block)
        del self._cache[entry.hash]

    def free(self, req: Request) -> None:
        """Drop `req`'s references, tail first so its tail blocks are evicted before its head."""
        for b in reversed(req.block_table):
            if self._ref_counts[b] < 1:
                raise RuntimeError(f"block {b} of request {req.request_id} is already free")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if b in self._entries:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        req.block_table = []
        self._chains.pop(req.request_id, None)

    # ---- prefix registration ------------------------------------------------------------------

    def cache_full_blocks(self, req: Request) -> None:
        """Register every block of `req` that is full of computed tokens whose ids are known (a
        pending token is not hashed). Idempotent, and O(new blocks): the request's chain
        remembers how far it got."""
        chain = self._chains.get(req.request_id)
        if chain is None or req.num_computed_tokens < (chain.num_blocks + 1) * self.block_size:
            return  # prefix caching is off, the request holds no blocks, or no new block is full
        bs = self.block_size
        num_full = min(min(req.num_computed_tokens, req.num_known_tokens) // bs, len(req.block_table))
        for i in range(chain.num_blocks, num_full):
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            h = hash_block(chain.hash, tokens)
            serial = self._insert(req.block_table[i], h, tokens, chain.serial)
            chain.num_blocks, chain.hash, chain.serial = i + 1, h, serial

    def _insert(self, block: int, h: bytes, tokens: tuple[int, ...], parent_serial: int) -> int:
        """Cache `block` under `h`; return the serial its children name as their parent."""
        twin = self._lookup(h, tokens, parent_serial)
        if twin is not None:
            # Another request computed the same content first: keep that one, chain on from it.
            return self._entries[twin].serial
        old = self._cache.get(h)
        if old is not None:
            # A collision (or a child of an evicted parent) under the same hash: the newest wins.
            self._uncache(old)
            if self._ref_counts[old] == 0:
                del self._evictable[old]
                self._free.append(old)
        serial = next(self._serials)
        self._entries[block] = _Entry(h, tokens, parent_serial, serial)
        self._cache[h] = block
        return serial

    def forget_prefixes(self) -> None:
        """Drop every prefix hash, of blocks in use too, and register no more blocks of the requests
        that hold blocks now: the KV behind them is lost (a kv_cache release) or was computed from
        other weights (an update). Blocks in use stay with their requests; unused ones become free."""
        self.reset_prefix_cache()
        self._cache.clear()
        self._entries.clear()
        self._chains.clear()  # a request without a chain registers nothing (cache_full_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every unreferenced cached block (they become free). True iff no block is in use,
        so that the whole cache is now empty; blocks in use keep their entries either way."""
        for b in self._evictable:
            self._uncache(b)
            self._free.append(b)
        self._evictable.clear()
        return self.num_used_blocks == 0
