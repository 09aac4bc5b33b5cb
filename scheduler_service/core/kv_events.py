"""What the prefix cache stores and drops, as events for routers outside the process.

A cache-aware router (the Shepherd Model Gateway) keeps an index of the blocks each replica holds;
these events keep it true. The block pool and the KV-cache manager record them into a
`KvEventFeed` on the engine thread, in the order they happen:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, namespace)
        full blocks that just entered the prefix cache, consecutive blocks of one chain: block i's
        parent is block i-1, the first one's is `parent_block_hash` (None: a prompt's first block);
        `token_ids` holds block_size tokens per block, in order; `namespace` what else went into
        their hashes (the adapter, the tenant's salt): a router hashing token ids itself must
        fold it in, or it takes two adapters' blocks of the same tokens for one
    BlockRemoved(block_hashes)
        cached blocks evicted (their KV is about to be overwritten)
    AllBlocksCleared()
        the whole cache is gone: a new block pool (a new epoch after a worker failure), a reset

A hybrid model (hybrid_kv.py) reports both KV groups' blocks, as vLLM's hybrid allocator does:
each stored and removed event carries its `group` (vLLM's group_idx, kv_cache_spec_kind and
kv_cache_spec_sliding_window): FULL_GROUP (0, "full_attention") for the full group, (1,
"sliding_window", W) for the window group, which holds only the blocks its window still sees.
A router indexes the full-attention group's (the prefix a hit needs from the start; SMG's
prefix index takes only those). Another model's events carry no group, as before.

Hashes are the chained block hashes of block_hashes.hash_block (bytes; the API edge turns
them into what its protocol wants). The feed records only while `enabled` (someone listens), so
a replica nobody routes by pays one attribute read per newly cached block. The feed is not
thread-safe: only the engine thread records and takes; other threads only flip `enabled`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockNamespace:
    """What besides token ids entered a block's hash, as vLLM's BlockStored names it. None: not
    part of it (the base model; no salt)."""

    lora_id: int | None = None      # the adapter's load generation: unique per load, as vLLM's
    lora_name: str | None = None    # lora_int_id (the same name loaded again: another id)
    cache_salt: str | None = None   # the tenant salt's digest (hex), never the salt itself


BASE_NAMESPACE = BlockNamespace()


@dataclass(frozen=True)
class KvGroupTag:
    """A hybrid model's KV-cache group, as vLLM's events name it: group_idx, kv_cache_spec_kind
    ("full_attention" or "sliding_window") and kv_cache_spec_sliding_window (tokens)."""

    index: int
    kind: str
    sliding_window: int | None = None


FULL_GROUP = KvGroupTag(0, "full_attention")


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    namespace: BlockNamespace = BASE_NAMESPACE
    group: KvGroupTag | None = None       # a hybrid model's group; None for another model


@dataclass
class BlockRemoved:
    block_hashes: list[bytes] = field(default_factory=list)
    group: KvGroupTag | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventFeed:
    """Collects events until the engine thread takes them (once per loop turn). Consecutive
    stores of one chain and consecutive removals coalesce into one event each."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[KvEvent] = []

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int],
               block_size: int, namespace: BlockNamespace = BASE_NAMESPACE,
               group: KvGroupTag | None = None) -> None:
        """A full block entered the cache; `parent` is the hash of the block before it."""
        if not self.enabled:
            return
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and last.block_size == block_size
                and parent is not None and last.block_hashes[-1] == parent
                and last.namespace == namespace and last.group == group):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(BlockStored([block_hash], parent, list(token_ids), block_size,
                                            namespace, group))

    def removed(self, block_hash: bytes, group: KvGroupTag | None = None) -> None:
        """A cached block was evicted."""
        if not self.enabled:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.group == group:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], group))

    def cleared(self) -> None:
        """The whole cache is gone; earlier events not taken yet no longer matter."""
        if self.enabled:
            self._events = [AllBlocksCleared()]

    def take(self) -> list[KvEvent]:
        """The events recorded since the last take, oldest first (none while disabled)."""
        events, self._events = self._events, []
        return events if self.enabled else []


class KvGroupFeed:
    """One KV group's view of a shared KvEventFeed (a hybrid model's pools each record through
    one): what it records carries the group's tag; `enabled` and `cleared` are the feed's."""

    def __init__(self, feed: KvEventFeed, group: KvGroupTag):
        self.feed = feed
        self.group = group

    @property
    def enabled(self) -> bool:
        return self.feed.enabled

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int],
               block_size: int, namespace: BlockNamespace = BASE_NAMESPACE) -> None:
        """KvEventFeed.stored, tagged with this group."""
        self.feed.stored(block_hash, parent, token_ids, block_size, namespace, self.group)

    def removed(self, block_hash: bytes) -> None:
        """KvEventFeed.removed, tagged with this group."""
        self.feed.removed(block_hash, self.group)

    def cleared(self) -> None:
        """The group's cache is gone: every group's is (AllBlocksCleared names none)."""
        self.feed.cleared()
