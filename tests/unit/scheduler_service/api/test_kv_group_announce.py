"""A hybrid model's KV events on a stream that starts while the cache already holds blocks,
read as SMG 1.13's KV event monitor reads them (model_gateway/src/worker/kv_event_monitor.rs,
WorkerIndexState::admits): a group is skipped once a store has named its kind non-main
(sliding_window); a removal names only group_idx, and one of a group not yet named is applied
to the index as full attention. The window group evicting a block stored before the
subscriber came, ahead of its first store on the stream, would then drop the full group's
block of the same hash: a cached prefix the router no longer routes to. kv_batch_to_proto
announces the group's kind (a KvBlocksStored without blocks) before such a removal."""
from __future__ import annotations

import random

from engine_common.request.kv_groups import WindowGroup
from scheduler_service.api import vllm_convert as vc
from scheduler_service.core.block_hashes import hash_block
from scheduler_service.core.kv_events import (FULL_GROUP, BlockRemoved, BlockStored,
                                              KvEventFeed, KvGroupTag)
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.kv_event_publisher import KvEventBatch
from tests.support.scheduler_sim import SimWorker, make, make_request, run_steps

MAIN_KINDS = ("full_attention", "mla_attention", "sink_full_attention")   # SMG's
WINDOW = KvGroupTag(1, "sliding_window", 8)


class SmgIndex:
    """One worker's blocks in SMG's prefix index, fed the wire events."""

    def __init__(self):
        self.blocks: set[int] = set()
        self.non_main: set[int] = set()

    def _admits(self, kind: str | None, group: int | None) -> bool:
        if kind is not None:
            main = kind in MAIN_KINDS
            if group is not None:
                (self.non_main.discard if main else self.non_main.add)(group)
            return main
        return group is None or group not in self.non_main

    def apply(self, batch) -> None:
        for event in batch.events:
            which = event.WhichOneof("data")
            if which == "cleared":
                self.blocks.clear()
            elif which == "stored":
                st = event.stored
                group = st.group_idx if st.HasField("group_idx") else None
                kind = st.kv_cache_spec_kind if st.HasField("kv_cache_spec_kind") else None
                if self._admits(kind, group):
                    self.blocks.update(b.block_hash for b in st.blocks)
            else:
                rm = event.removed
                if self._admits(None, rm.group_idx if rm.HasField("group_idx") else None):
                    self.blocks.difference_update(rm.block_hashes)


def _run(seed: int) -> tuple[int, int]:
    """Waves of shared-prefix requests through a window of 8; a stream joins after two.
    Returns (full blocks the index lost while cached, window removals sent before a store)."""
    rnd = random.Random(seed)
    config = make()[0].config
    feed, group = KvEventFeed(), WindowGroup(8, 18)
    sched = Scheduler(config, 40, rng=random.Random(0), kv_events=feed, window_group=group)
    worker = SimWorker(40, config.block_size, window_group=group)
    index, announced, seen = SmgIndex(), set(), set()
    lost = early = 0
    window_stored = False

    def on_step(*_):
        nonlocal lost, early, window_stored
        events = feed.take()
        for e in events:
            if isinstance(e, BlockStored) and e.group == WINDOW:
                window_stored = True
            early += isinstance(e, BlockRemoved) and e.group == WINDOW and not window_stored
            if isinstance(e, BlockStored) and e.group == FULL_GROUP:
                seen.update(vc.block_hash_to_int64(h) for h in e.block_hashes)
        index.apply(vc.kv_batch_to_proto(KvEventBatch(1, 0.0, tuple(events)), announced))
        cached = {vc.block_hash_to_int64(h) for h in sched.kv.pool._cached}
        lost += len((seen & cached) - index.blocks)

    prefixes = [[rnd.randrange(100, 600) for _ in range(rnd.randrange(12, 30))]
                for _ in range(3)]
    for wave in range(6):
        feed.enabled = wave >= 2
        for i in range(rnd.randrange(1, 5)):
            prompt = rnd.choice(prefixes) + [rnd.randrange(100, 600)
                                             for _ in range(rnd.randrange(1, 12))]
            sched.add_request(make_request(f"w{wave}-{i}", prompt,
                                           max_tokens=rnd.randrange(1, 12)))
        run_steps(sched, worker, on_step=on_step)
    return lost, early


def test_a_late_stream_keeps_every_cached_full_block_in_the_routers_index():
    """40 seeds: no full-attention block stored on the stream and still cached ever leaves
    the index; some seeds do evict window blocks before the group's first store (the case)."""
    results = [_run(seed) for seed in range(40)]
    assert [seed for seed, (lost, _) in enumerate(results) if lost] == []
    assert sum(early for _, early in results) > 0


def test_the_window_group_is_announced_once_per_stream_before_its_first_removal():
    """Its kind in a KvBlocksStored with no blocks, sharing the removal's id; not again on the
    stream, nor where a store named it first, nor for the full group; without a stream's set
    (or for another model) the events are converted one to one as before."""
    h = hash_block(None, [1, 2])
    batch = KvEventBatch(3, 0.0, (BlockRemoved([h], FULL_GROUP), BlockRemoved([h], WINDOW),
                                  BlockRemoved([h], WINDOW)), first_event_id=10)
    announced: set[int] = set()
    events = vc.kv_batch_to_proto(batch, announced).events
    assert [e.WhichOneof("data") for e in events] == ["removed", "stored", "removed", "removed"]
    note = events[1].stored
    assert (events[1].event_id, note.group_idx, note.kv_cache_spec_kind,
            note.kv_cache_spec_sliding_window, len(note.blocks)) == (11, 1, "sliding_window", 8, 0)
    assert [e.event_id for e in events] == [10, 11, 11, 12]
    assert announced == {0, 1}
    assert [e.WhichOneof("data") for e in vc.kv_batch_to_proto(batch, announced).events] == [
        "removed"] * 3
    stored_first = KvEventBatch(4, 0.0, (BlockStored([h], None, [1, 2], 2, group=WINDOW),
                                         BlockRemoved([h], WINDOW)))
    assert len(vc.kv_batch_to_proto(stored_first, set()).events) == 2
    assert len(vc.kv_batch_to_proto(batch).events) == 3
    plain = KvEventBatch(5, 0.0, (BlockRemoved([h]),))
    assert len(vc.kv_batch_to_proto(plain, set()).events) == 1
