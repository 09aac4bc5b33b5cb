"""TokenizerPool: one caller never holds every thread (issue 23, item 5), even by cancelling its
requests and sending them again; another caller's job runs meanwhile. Event-driven: the jobs
block on events the test sets."""
from __future__ import annotations

import asyncio
import threading

from scheduler_service.api.tokenizer_pool import TokenizerPool


def _blocking(started: threading.Event, release: threading.Event, name: str):
    def job() -> str:
        started.set()
        release.wait(30)
        return name
    return job


def test_one_caller_leaves_a_thread_for_the_others():
    async def scenario() -> list[str]:
        pool = TokenizerPool(3)                       # per caller: 2
        assert pool.per_caller == 2
        release = threading.Event()
        started = [threading.Event() for _ in range(4)]
        flood = [asyncio.ensure_future(pool.run(_blocking(started[i], release, f"a{i}"),
                                                caller="a")) for i in range(4)]
        assert await asyncio.to_thread(started[0].wait, 30)
        assert await asyncio.to_thread(started[1].wait, 30)
        # a's first two jobs hold two threads; its others wait; b's job runs on the third.
        assert await pool.run(lambda: "b", caller="b") == "b"
        assert not started[2].is_set() and not started[3].is_set()
        release.set()
        done = await asyncio.gather(*flood)
        pool.close()
        return done

    assert asyncio.run(scenario()) == ["a0", "a1", "a2", "a3"]


def test_a_cancelled_request_holds_its_thread_until_the_job_ends():
    async def scenario() -> None:
        pool = TokenizerPool(2)                       # per caller: 1
        release, first, second = threading.Event(), threading.Event(), threading.Event()
        running = asyncio.ensure_future(pool.run(_blocking(first, release, "x"), caller="a"))
        assert await asyncio.to_thread(first.wait, 30)
        running.cancel()                              # the client gives up; the job runs on
        again = asyncio.ensure_future(pool.run(_blocking(second, release, "y"), caller="a"))
        assert await pool.run(lambda: "b", caller="b") == "b"
        assert not second.is_set()                    # a still holds its one thread
        release.set()
        assert await again == "y"
        assert pool._users == {} and pool._slots == {}
        pool.close()

    asyncio.run(scenario())
