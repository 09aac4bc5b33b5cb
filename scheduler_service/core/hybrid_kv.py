"""The KV cache manager of a hybrid model (engine_common/request/kv_groups.py): the full group
is this manager's own pool and tables, the window group a second KVCacheManager with the window,
which frees the blocks behind it (sliding_window.py).

Every allocation takes room in both groups or in neither; a free returns both. The scheduler's
counts (admission, growth, preemption, priority) read the full group only: the window pool is
sized never to run short (kv_groups.window_pool_bound), and an allocation checks it anyway, so a
shortage there reads as any shortage (None: wait or preempt) rather than a block-less step.

The window group's block ids reach the workers in the diff's new_window_block_ids: a new or
resumed request's whole window table (the workers start it empty), then the blocks appended.
A prefix hit holds in both groups: the full group's longest cached prefix, cut to the window
group's longest_window_hit within it (the blocks the first query after it sees must be cached
there too). get_computed_blocks returns the full group's hit blocks as a list whose `window`
holds the window group's (null blocks below the window), which allocate_slots takes back.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.kv_groups import WindowGroup
from scheduler_service.core.block_pool import KVCacheBlock
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.kv_events import FULL_GROUP, KvEventFeed, KvGroupFeed, KvGroupTag
from scheduler_service.core.request import Request
from scheduler_service.core.sliding_window import longest_window_hit

log = logging.getLogger(__name__)


def make_kv_manager(config: SchedulerConfig, num_blocks: int, events: KvEventFeed | None,
                    sliding_window: int, window_group: WindowGroup | None) -> KVCacheManager:
    """The scheduler's manager: a hybrid one when the workers report a window group."""
    if window_group is None:
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                              events, sliding_window)
    log.info("hybrid KV cache: %d full-group blocks, %d window-group blocks (window %d)",
             num_blocks, window_group.num_blocks, window_group.window)
    return HybridKVCacheManager(num_blocks, config.block_size, window_group,
                                config.enable_prefix_caching, events)


class HybridHits(list):
    """A prefix hit of a hybrid model: the full group's blocks, `window` the window group's."""

    window: list[KVCacheBlock]

    def __init__(self, full: Sequence[KVCacheBlock], window: list[KVCacheBlock]):
        super().__init__(full)
        self.window = window


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager over the full group, with the window group alongside."""

    def __init__(self, num_blocks: int, block_size: int, window_group: WindowGroup,
                 enable_caching: bool = False, events: KvEventFeed | None = None):
        """`events`: both groups record into it, each event tagged with its group (vLLM's
        group_idx and kind: kv_events.py), so a router can index the full group's alone."""
        full_events = window_events = None
        if events is not None:
            full_events = KvGroupFeed(events, FULL_GROUP)
            window_events = KvGroupFeed(events, KvGroupTag(1, "sliding_window",
                                                           window_group.window))
        super().__init__(num_blocks, block_size, enable_caching, full_events)
        self.window_group = KVCacheManager(window_group.num_blocks, block_size, enable_caching,
                                           window_events, window_group.window)
        # Blocks freed behind the window are churn (sliding_window.split_churn). Half the pool
        # keeps the latest of them cached: enough for a shared system prompt followed by a long
        # question, chunked (the prefix-retention figures in docs/models-and-chat.md).
        self.window_group.evict_behind_first = True
        self.window_group.pool.churn_cap = window_group.num_blocks // 2
        # handle -> window-group block ids for the next diff (new_window_block_ids)
        self.window_ids: dict[int, list[int]] = {}

    def take_window_ids(self) -> dict[int, list[int]]:
        """The window-group block ids gathered since the last call (for one diff)."""
        out, self.window_ids = self.window_ids, {}
        return out

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix hit both groups hold (HybridHits), and its tokens."""
        full, _ = super().get_computed_blocks(request)
        if not full:
            return full, 0
        window = self.window_group
        hits = longest_window_hit(window._block_hashes(request, len(full)), len(full),
                                  window.sliding_window, self.block_size,
                                  window.pool.get_cached_block, window.null_block)
        return HybridHits(full[:len(hits)], hits), len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_slots in both groups (a running request: grow_slots);
        `new_computed_blocks`: get_computed_blocks' hit."""
        rid, window = request.request_id, self.window_group
        window_hits = getattr(new_computed_blocks, "window", ())
        if len(window_hits) != len(new_computed_blocks):
            raise ValueError(f"request {rid}: a prefix hit of {len(new_computed_blocks)} "
                             f"blocks without its window group's ({len(window_hits)})")
        first = not self._blocks.get(rid)
        if first and window.num_free_blocks_needed(request, num_new_tokens, window_hits) \
                > window.num_free_blocks:
            return None
        out = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        if out is not None and first:
            window.allocate_slots(request, num_new_tokens, window_hits)    # room checked
            self.window_ids[request.handle] = window.get_block_ids(request)
            self.quiet_until[rid] = min(self.quiet_until[rid], window.quiet_until[rid])
        return out

    def grow_slots(self, request: Request, num_new_tokens: int,
                   free_skipped: bool = True) -> list[int] | None:
        """KVCacheManager.grow_slots in both groups; the full group's new ids are returned, the
        window group's kept for the diff. None (nothing changed but the window group's blocks
        behind the window freed) when either group is short."""
        rid, window = request.request_id, self.window_group
        need = window.num_free_blocks_needed(request, num_new_tokens)
        if free_skipped:
            need -= window.num_freed_by_window(request)
        if need > window.num_free_blocks:
            return None
        new_ids = super().grow_slots(request, num_new_tokens, free_skipped)
        if new_ids is None:
            return None
        window_new = window.grow_slots(request, num_new_tokens, free_skipped)
        if window_new is None:       # the check above makes this impossible
            raise RuntimeError(f"KV cache: the window group of {rid} is short after its check")
        if window_new:
            self.window_ids.setdefault(request.handle, []).extend(window_new)
        self.quiet_until[rid] = min(self.quiet_until[rid], window.quiet_until[rid])
        return new_ids

    def num_fitting_tokens(self, request: Request) -> int:
        """New tokens both groups hold for the request."""
        return min(super().num_fitting_tokens(request),
                   self.window_group.num_fitting_tokens(request))

    def free(self, request: Request) -> None:
        """Release the request's blocks in both groups; its ids not yet sent are dropped."""
        super().free(request)
        self.window_group.free(request)
        self.window_ids.pop(request.handle, None)

    def reset_prefix_cache(self) -> bool:
        """Forget both groups' cached hashes (only while no block is in use)."""
        return super().reset_prefix_cache() and self.window_group.reset_prefix_cache()

    def get_window_block_ids(self, request: Request) -> list[int]:
        """The request's window-group table (null block ids at the places behind the window)."""
        return self.window_group.get_block_ids(request)

    @property
    def window_usage(self) -> float:
        """Fraction of the window group's blocks held by requests."""
        return self.window_group.usage
