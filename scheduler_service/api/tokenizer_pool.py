"""The public port's tokenizer threads, shared by deltaserve.v1.Generation and VllmEngine.

Tokenizing, chat rendering and llguidance's validation of a structured-output constraint run
here, never on the event loop (the tokenizer and llguidance release the GIL), so one long prompt
or big constraint cannot stall the other streams. `--tokenizer-threads` threads in all.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a pool thread; the calling coroutine waits without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
