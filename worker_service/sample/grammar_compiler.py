"""Compiling structured-output constraints on a worker: against the model's tokenizer, one at a
time on the compile thread, cached by the constraint's key (docs/structured-output.md,
"Compiling off the step"). GrammarBook (grammar.py) makes each request's matcher from these."""
from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from engine_common.runtime.big_stack import call_with_big_stack
from engine_common.constraints.constraint import Constraint
from engine_common.text.tokenizer import Tokenizer
from worker_service.sample.grammar_tokenizer import text_only_tokenizer

_MAX_COMPILED = 256


class GrammarCompiler:
    """Compiles constraints against the model's tokenizer, one at a time on its compile thread;
    compiled grammars are cached by the constraint's key (a hash; at most `max_compiled`, least
    recently used out), and each request gets a copy. The tokenizer (about a second to build at
    a 49K vocabulary, 1.5 s with its text-only tokenize) is built on the first compile, so
    unconstrained serving pays nothing."""

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
        if self._tokenizer is None:      # special tokens' text stays text (grammar_tokenizer.py)
            self._tokenizer = text_only_tokenizer(self._tokenizer_json(), self.vocab_size,
                                                  self.eos_token_ids)
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
