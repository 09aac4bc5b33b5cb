"""Counts Triton JIT compilations inside a timed region.

A compile inside a timed run (a kernel meeting an argument specialization that the warm-up did
not, e.g. an int argument divisible by 16 for the first time) stalls the whole engine for a
second or more on a GPU, so a benchmark reports them rather than hide them in its wall time.
Uses Triton's `knobs.runtime` JIT hooks (Triton >= 3.4); elsewhere it records nothing and says so.
"""
from __future__ import annotations

import time


class JitCompiles:
    """Context manager: `events` holds (kernel name, seconds, Triton's signature repr) per
    compile while active."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, str]] = []
        self.supported = False
        self._knobs = None
        self._saved = (None, None)
        self._started: dict[str, float] = {}

    def __enter__(self) -> "JitCompiles":
        try:
            from triton import knobs
        except ImportError:          # no triton, or one without knobs: nothing to watch
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._knobs, self.supported = runtime, True
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._saved

    def _before(self, *args, **kwargs) -> bool:
        self._started[str(kwargs.get("repr"))] = time.perf_counter()
        return False                 # False: compile as usual

    def _after(self, *args, **kwargs) -> bool:
        sig = str(kwargs.get("repr"))
        start = self._started.pop(sig, None)
        seconds = time.perf_counter() - start if start is not None else 0.0
        name = getattr(kwargs.get("fn"), "name", None) or sig.split("[")[0]
        # the key holds the specialisation (each argument's type and its ==1 / %16 pattern)
        self.events.append((name, seconds, f"{sig.split('(')[0]} key {kwargs.get('key')}"))
        return False

    def describe(self) -> str:
        if not self.supported:
            return "not watched (this Triton has no JIT hooks)"
        if not self.events:
            return "none"
        total = sum(e[1] for e in self.events)
        names = ", ".join(f"{n} {s:.2f} s" for n, s, _ in self.events[:8])
        more = f", +{len(self.events) - 8} more" if len(self.events) > 8 else ""
        return f"{len(self.events)} ({total:.2f} s: {names}{more})"
