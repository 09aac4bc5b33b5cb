"""KvEventPublisher: the engine thread's turn's events reach every subscriber as one numbered
batch, with one loop wake-up per subscriber per batch (not per event); the feed records only
while someone listens; a subscriber that falls behind is dropped, not buffered forever."""
from __future__ import annotations

import asyncio
import threading

import pytest

from scheduler_service.core.kv_events import BlockRemoved, BlockStored
from scheduler_service.engine.kv_event_publisher import KvEventPublisher, SubscriberLagging

H = [bytes([i]) * 16 for i in range(8)]


def record_turn(publisher: KvEventPublisher, n: int, base: int = 0) -> None:
    """What the engine thread does in one turn that stores n blocks of one chain."""
    for i in range(n):
        publisher.feed.stored(H[base + i], H[base + i - 1] if i else None, [i], 1)


async def let_the_new_tasks_run() -> None:
    """One pass of the event loop (no timed wait): tasks created before this call run up to
    their first await; a subscription registers there."""
    await asyncio.sleep(0)


def on_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join(10)


def test_batches_are_numbered_and_reach_every_subscriber():
    publisher = KvEventPublisher()

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
        streams = [publisher.subscribe(), publisher.subscribe()]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await let_the_new_tasks_run()
        assert publisher.num_subscribers == 2 and publisher.feed.enabled
        on_thread(lambda: (record_turn(publisher, 3), publisher.publish()))
        batches = await asyncio.gather(*firsts)
        on_thread(lambda: (publisher.feed.removed(H[0]), publisher.publish()))
        seconds = [await s.__anext__() for s in streams]
        for s in streams:
            await s.aclose()
        return wakeups, batches, seconds

    wakeups, batches, seconds = asyncio.run(main())
    assert len(wakeups) == 4                          # 2 batches x 2 subscribers, 4 events
    for first, second in zip(batches, seconds):
        assert (first.sequence_number, first.first_event_id) == (1, 1)
        assert first.events == (BlockStored([H[0], H[1], H[2]], None, [0, 1, 2], 1),)
        assert (second.sequence_number, second.first_event_id) == (2, 2)
        assert second.events == (BlockRemoved([H[0]]),)
    assert not publisher.feed.enabled and publisher.num_subscribers == 0


def test_nothing_is_recorded_or_numbered_without_subscribers():
    publisher = KvEventPublisher()
    record_turn(publisher, 2)
    assert publisher.publish() is None

    async def main():
        stream = publisher.subscribe()
        first = asyncio.ensure_future(stream.__anext__())
        await let_the_new_tasks_run()
        assert publisher.num_subscribers == 1
        assert publisher.publish() is None            # a turn without events sends nothing
        on_thread(lambda: (record_turn(publisher, 1, base=4), publisher.publish()))
        batch = await first
        await stream.aclose()
        return batch

    batch = asyncio.run(main())
    assert batch.sequence_number == 1 and batch.events[0].block_hashes == [H[4]]


def test_a_lagging_subscriber_is_dropped():
    publisher = KvEventPublisher(max_backlog=3)

    async def main():
        stream = publisher.subscribe()
        first = asyncio.ensure_future(stream.__anext__())
        await let_the_new_tasks_run()
        assert publisher.num_subscribers == 1

        def turns():
            for i in range(5):
                publisher.feed.removed(H[i])
                publisher.publish()
        on_thread(turns)       # the five deliveries now wait on the loop, to run in one pass
        got = [await first]
        with pytest.raises(SubscriberLagging):
            while True:
                got.append(await stream.__anext__())
        return got

    got = [b.sequence_number for b in asyncio.run(main())]
    # The backlog is counted when a batch arrives; the reader may or may not have taken the
    # first one by then.
    assert got in ([1, 2, 3], [1, 2, 3, 4])
    assert publisher.num_subscribers == 0 and not publisher.feed.enabled


def test_wait_subscribers_wakes_on_a_subscription_and_its_end_from_another_thread():
    """A thread waiting for the count is woken by the loop's subscribe and by the stream's
    close; a count that is not reached returns False when its time is up."""
    publisher = KvEventPublisher()
    woken = []
    joined = threading.Thread(target=lambda: woken.append(publisher.wait_subscribers(1, 10)))
    joined.start()

    async def main():
        stream = publisher.subscribe()
        first = asyncio.ensure_future(stream.__anext__())
        await let_the_new_tasks_run()
        await asyncio.to_thread(joined.join, 10)       # the waiter saw the subscription
        left = threading.Thread(target=lambda: woken.append(publisher.wait_subscribers(0, 10)))
        left.start()
        first.cancel()                  # the stream ends: its subscriber leaves
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.to_thread(left.join, 10)

    asyncio.run(main())
    assert woken == [True, True]
    assert publisher.wait_subscribers(1, 0) is False
