"""The public port's tokenizer threads, shared by deltaserve.v1.Generation and VllmEngine.

Tokenizing, chat rendering and llguidance's validation of a structured-output constraint run
here, never on the event loop (the tokenizer and llguidance release the GIL), so one long prompt
or big constraint cannot stall the other streams. `--tokenizer-threads` threads in all.

One caller (an API key; without keys a client address) holds at most `per_caller` threads at
once (threads - 1 by default), so its jobs queue behind each other while another caller's run
(issue 23: eight 4-million-character prompts of one client held every thread for a minute). A
thread counts as held until its job ends, even when the request that asked for it was
cancelled: cancelling and resending cannot take more.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, threads: int, per_caller: int | None = None):
        self.threads = threads
        self.per_caller = per_caller or max(1, threads - 1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._slots: dict[str, asyncio.Semaphore] = {}   # event loop only
        self._users: dict[str, int] = {}                 # caller -> jobs waiting or running

    async def run(self, fn: Callable[..., T], *args, caller: str = "") -> T:
        """fn(*args) on a pool thread once `caller` holds fewer than `per_caller` of them; the
        calling coroutine waits without blocking the loop."""
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(caller, asyncio.Semaphore(self.per_caller))
        self._users[caller] = self._users.get(caller, 0) + 1
        try:
            await slots.acquire()
        except BaseException:
            self._leave(caller)
            raise
        try:
            job = self._pool.submit(fn, *args)
        except BaseException:       # the pool is shut down
            self._release(caller)
            raise
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, caller))
        return await asyncio.wrap_future(job)

    def num_jobs(self, caller: str) -> int:
        """`caller`'s jobs waiting for a thread or running."""
        return self._users.get(caller, 0)

    def _release(self, caller: str) -> None:
        self._slots[caller].release()
        self._leave(caller)

    def _leave(self, caller: str) -> None:
        self._users[caller] -= 1
        if not self._users[caller]:
            del self._users[caller], self._slots[caller]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
