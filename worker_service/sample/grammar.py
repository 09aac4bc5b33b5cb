"""Structured output on the worker: compiled grammars, one matcher per constrained request, and
the token masks computed from them, identically on every rank.

A mask depends only on the constraint and the ids the request sampled, and every rank samples
the same ids, so every rank computes the same masks itself: nothing about grammars travels on the
step diff after the constraint itself (sent once, with the new request).

Per step (the model runner drives it):
    start_masks(handles)  -> on a helper thread, while the forward pass runs: the masks of the
                             sampling rows whose request is constrained (GrammarMasks)
    the sampler           -> -inf outside each row's mask (sampler.apply_grammar_bias: the mask
                             as a 0 / -inf bias, unpacked on the helper thread on CPU)
    advance(handles, ids) -> after the read-back: every matcher consumes its sampled id

Bitmask layout (llguidance's and xgrammar's): int32 [rows, ceil(vocab / 32)]; token t is allowed
when bit (t % 32) of word t // 32 is set. Ids past the tokenizer's vocabulary are never allowed.

Compiling is off the step path (docs/structured-output.md, "Compiling off the step"): a new
constraint is compiled on the compile thread, the request's matcher is made from it the first
time its row samples (blocking then only if it is not done, which the scheduler avoids by never
scheduling that row's sampling before the output rank reported the handle compiled:
`newly_compiled`, sent back in RunnerOutput.compiled_handles). Resolving a matcher only where a
row samples keeps every rank's state, and so its digest, the same whenever its compile ends.

When a grammar is complete and nothing may follow, its mask allows only the eos ids, so the
request ends with STOP_TOKEN. Once an eos id is sampled the constraint is done (`terminated`): the
row is masked no more (with ignore_eos it goes on unconstrained, as in vLLM). A preempted request
drops its matcher; on resumption the matcher is rebuilt by replaying the request's output ids.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from engine_common.runtime.big_stack import call_with_big_stack
from engine_common.constraints.constraint import Constraint
from engine_common.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_MAX_COMPILED = 256


# byte value -> the bias of its 8 ids (bit j of the byte is id 8b + j): 0 allowed, -inf not.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                    bitorder="little").astype(bool),
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


def bitmask_bias(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """float32 [K, vocab]: the bitmask as an additive bias (0 allowed, -inf not)."""
    k = bitmask.shape[0]
    return np.ascontiguousarray(_BYTE_BIAS[bitmask.view(np.uint8)].reshape(k, -1)[:, :vocab_size])


class GrammarCompiler:
    """Compiles constraints against the model's tokenizer, one at a time on its compile thread;
    compiled grammars are cached by the constraint's key (a hash; at most `max_compiled`, least
    recently used out), and each request gets a copy. The tokenizer (about a second to build at
    a 49K vocabulary) is built on the first compile, so unconstrained serving pays nothing."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: Sequence[int], max_compiled: int = _MAX_COMPILED):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()       # _compiled and _compiling: step and compile threads
        self._max_compiled = max_compiled
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")

    @classmethod
    def for_model(cls, model_dir: str, vocab_size: int,
                  eos_token_ids: Sequence[int]) -> "GrammarCompiler":
        """Compiles against the model directory's (or GGUF file's) tokenizer, read when the
        first constraint arrives."""
        return cls(lambda: Tokenizer.from_dir(model_dir).backend.to_str(), vocab_size,
                   eos_token_ids)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self.vocab_size,
                eos_token=sorted(self.eos_token_ids))
        return self._tokenizer

    def prepare(self, constraint: Constraint) -> concurrent.futures.Future:
        """A Future of the compiled grammar (an LLMatcher to copy): done at once when cached,
        else compiling on the compile thread. Its exception, if any, is the compile's."""
        key = constraint.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                done = concurrent.futures.Future()
                done.set_result(compiled)
                return done
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self.pool.submit(self._compile, constraint)
            return future

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher (at the start of the output) for `constraint`, waiting for its
        compile."""
        return self.prepare(constraint).result().deep_copy()

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """On the compile thread. The library compiles recursively: a constraint too deep is
        refused (ParamError; the diff check refused it already), and compiling runs on a 64 MiB
        stack. The first mask is computed here too: llguidance builds much of its lexer lazily
        on it (8 s of the 60,000-choice constraint's 12), which would otherwise land on a step."""
        try:
            constraint.check_depth()
            tokenizer = self.tokenizer
            compiled = call_with_big_stack(
                lambda: llguidance.LLMatcher(tokenizer, constraint.to_grammar(), log_level=0))
            if compiled.is_error():
                # Validated at admission: reaching this is a library/version mismatch.
                raise ValueError(f"{constraint.field}: {compiled.get_error()}")
            warm = np.zeros((1, -(-self.vocab_size // 32)), dtype=np.int32)
            fill_next_token_bitmask_par(llguidance.LLExecutor(), [(compiled.deep_copy(), 0)], warm)
            with self._lock:
                self._compiled[constraint.key] = compiled
                if len(self._compiled) > self._max_compiled:
                    self._compiled.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self._compiling.pop(constraint.key, None)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)


@dataclass
class RequestGrammar:
    """One constrained request's matcher and how far it got. No matcher once resolved: the
    grammar did not compile on this worker (validated at admission, so a library or tokenizer
    fault): only eos is allowed, the request ends at once with STOP_TOKEN and the step goes on
    for the others."""

    matcher: llguidance.LLMatcher | None
    num_consumed: int = 0          # output ids the matcher has seen
    terminated: bool = False       # an eos id was sampled: the constraint is done
    # Until its row first samples: the compiled grammar's Future and the ids to replay then.
    compiling: concurrent.futures.Future | None = None
    replay: Sequence[int] = ()

    @property
    def stopped(self) -> bool:
        """Complete (or failed): only eos may follow."""
        return self.matcher is None or self.matcher.is_stopped()


@dataclass
class GrammarMasks:
    """One step's masks: row `indices` (into the step's sampling rows), their bitmask, and
    (when asked for: a CPU device) the same as an additive bias, unpacked on the helper thread."""

    indices: np.ndarray            # int64 [K]
    bitmask: np.ndarray            # int32 [K, ceil(vocab / 32)]
    bias: np.ndarray | None = None  # float32 [K, vocab]: 0 allowed, -inf not
    all_rows: bool = False         # indices == every sampling row, in order


class GrammarBook:
    """The matchers of the cached requests that carry a constraint, by handle."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        # every cached constrained request: its compiled grammar (a Future)
        self._constraints: dict[int, concurrent.futures.Future] = {}
        self._live: dict[int, RequestGrammar] = {}      # those in the batch
        self._unreported: set[int] = set()    # handles whose compile end is not reported yet
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._last_masks_digest = b""

    # -- membership (the diff) ------------------------------------------------------------------

    def add(self, handle: int, constraint: Constraint | None,
            output_token_ids: Sequence[int] = ()) -> None:
        """A new request: its grammar starts compiling (or is cached); its matcher is made, and
        replays `output_token_ids`, when its row first samples."""
        if constraint is None:
            return
        compiled = self.compiler.prepare(constraint)
        self._constraints[handle] = compiled
        self._unreported.add(handle)
        self._live[handle] = RequestGrammar(None, compiling=compiled, replay=output_token_ids)

    def resume(self, handle: int, output_token_ids: Sequence[int]) -> None:
        """A preempted request back in the batch: a new matcher replays its output ids."""
        if handle in self._constraints:
            self._live[handle] = RequestGrammar(None, compiling=self._constraints[handle],
                                                replay=list(output_token_ids))

    def preempt(self, handle: int) -> None:
        self._live.pop(handle, None)

    def finish(self, handle: int) -> None:
        self._live.pop(handle, None)
        self._constraints.pop(handle, None)
        self._unreported.discard(handle)

    def clear(self) -> None:
        self._live.clear()
        self._constraints.clear()
        self._unreported.clear()

    def newly_compiled(self, wait_s: float = 0.0) -> list[int]:
        """Handles whose grammar finished compiling (or failing) since the last call, sorted;
        waits up to `wait_s` for one when none has (a step with nothing else to do)."""
        if not self._unreported:
            return []
        if wait_s > 0 and not any(self._constraints[h].done() for h in self._unreported):
            concurrent.futures.wait([self._constraints[h] for h in self._unreported], wait_s,
                                    concurrent.futures.FIRST_COMPLETED)
        done = sorted(h for h in self._unreported if self._constraints[h].done())
        self._unreported.difference_update(done)
        return done

    def __bool__(self) -> bool:
        return bool(self._live)

    # -- one step -------------------------------------------------------------------------------

    def stopped(self, handles: Sequence[int]) -> np.ndarray | None:
        """bool per handle: its grammar is complete (only eos allowed), so min_tokens must not
        mask eos; None when no row is constrained."""
        if not self._live:
            return None
        return np.array([(g := self._masked(h)) is not None and g.stopped for h in handles],
                        dtype=bool)

    def start_masks(self, handles: Sequence[int],
                    bias: bool = False) -> concurrent.futures.Future | None:
        """Compute the masks of `handles` on the helper thread (a Future of GrammarMasks, with
        the additive bias too when `bias`); None when no handle is constrained."""
        picks = [(i, self._live[h]) for i, h in enumerate(handles) if self._masked(h)]
        if not picks:
            self._last_masks_digest = b""
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
        return self._pool.submit(self._masks, picks, len(picks) == len(handles), bias)

    def _masks(self, picks, all_rows: bool, bias: bool) -> GrammarMasks:
        masks = self.compute_masks(picks)
        masks.all_rows = all_rows
        if bias:
            masks.bias = bitmask_bias(masks.bitmask, self.compiler.vocab_size)
        return masks

    def compute_masks(self, picks: list[tuple[int, RequestGrammar]]) -> GrammarMasks:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = -(-self.compiler.vocab_size // 32)
        bitmask = np.zeros((len(picks), words), dtype=np.int32)
        matchers = [(g.matcher, k) for k, (_, g) in enumerate(picks) if g.matcher]
        if matchers:
            fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        for k, (_, g) in enumerate(picks):
            if g.matcher is None:
                for eos in self.compiler.eos_token_ids:
                    bitmask.view(np.uint32)[k, eos // 32] |= np.uint32(1 << eos % 32)
        self._last_masks_digest = hashlib.blake2b(bitmask.tobytes(), digest_size=16).digest()
        return GrammarMasks(np.array([i for i, _ in picks], dtype=np.int64), bitmask)

    def advance(self, handles: Sequence[int], token_ids: Sequence[int]) -> None:
        """Every constrained request consumes the id it sampled."""
        if not self._live:
            return
        for handle, token_id in zip(handles, token_ids):
            state = self._live.get(handle)
            if state is not None:
                if state.compiling is not None:     # sampled without masks: never expected
                    self._resolve(handle, state)
                self._consume(handle, state, token_id)

    def digest(self) -> bytes:
        """The matchers' state for verify_symmetry: per constrained request (by handle) the ids
        consumed, terminated/stopped/accepting/error, and the last step's masks."""
        h = hashlib.blake2b(digest_size=16)
        for handle in sorted(self._live):
            g, m = self._live[handle], self._live[handle].matcher
            if g.compiling is not None:          # not resolved: the same on every rank
                h.update(np.array([handle, -1], dtype=np.int64).tobytes())
                continue
            flags = [True, False, True] if m is None else [m.is_stopped(), m.is_accepting(),
                                                          m.is_error()]
            h.update(np.array([handle, g.num_consumed, g.terminated, *flags],
                              dtype=np.int64).tobytes())
        h.update(self._last_masks_digest)
        return h.digest()

    # -- internals ------------------------------------------------------------------------------

    def _masked(self, handle: int) -> RequestGrammar | None:
        """The state of a sampling row's request, its matcher resolved; None if unconstrained
        or done."""
        state = self._live.get(handle)
        if state is not None and state.compiling is not None:
            self._resolve(handle, state)
        return None if state is None or state.terminated else state

    def _resolve(self, handle: int, state: RequestGrammar) -> None:
        """Its row samples: the matcher from the compiled grammar (waiting for the compile if
        the scheduler did not), then the replayed ids."""
        try:
            state.matcher = state.compiling.result().deep_copy()
        except Exception:                # never fail the step for one request's grammar
            log.exception("request handle %d: its constraint did not compile; only eos is "
                          "allowed", handle)
        state.compiling = None
        for token_id in state.replay:
            self._consume(handle, state, token_id)
        state.replay = ()

    def _consume(self, handle: int, state: RequestGrammar, token_id: int) -> None:
        state.num_consumed += 1
        if state.terminated:
            return
        if token_id in self.compiler.eos_token_ids:
            state.terminated = True
            return
        if state.matcher is None:
            return
        # A refused id leaves the matcher in its error state, whose mask allows only eos: the
        # request then ends with STOP_TOKEN. Masked sampling never picks a refused id.
        was_error = state.matcher.is_error()
        if not state.matcher.consume_token(token_id) and not was_error:
            log.warning("request handle %d: grammar matcher refused token %d: %s", handle,
                        token_id, state.matcher.get_error())
