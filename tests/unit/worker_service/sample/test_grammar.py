"""Grammar matchers and masks on the worker: compiled once per constraint, masks that allow
exactly what the grammar may continue with, eos alone once the text is complete, replay after
preemption equal to an uninterrupted run, and a digest that follows the matchers' state."""
from __future__ import annotations

import re
import threading

import llguidance
import numpy as np
import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.request.params import ParamError
from tests.support.deep_constraints import lark_chain
from tests.support.grammar_text import EOS, encode, tiny_compiler
from worker_service.sample.grammar import GrammarBook, GrammarCompiler

DIGITS = Constraint("regex", "[0-9]{2}-[a-z]{2}")
YES_NO = Constraint("choice", ("yes", "no"))


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    return tiny_compiler(tmp_path_factory.mktemp("grammar"))


def allowed_ids(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def masks(book: GrammarBook, handles) -> dict[int, np.ndarray]:
    """handle -> allowed ids, for the constrained handles among `handles`."""
    future = book.start_masks(handles)
    if future is None:
        return {}
    m = future.result()
    return {handles[i]: allowed_ids(row, book.compiler.vocab_size)
            for i, row in zip(m.indices, m.bitmask)}


def feed(book: GrammarBook, handle: int, ids) -> None:
    for token in ids:
        book.advance([handle], [token])


def greedy_walk(book: GrammarBook, handle: int, max_steps: int = 40) -> list[int]:
    """Always take the smallest allowed id, as a model would take its argmax, until eos."""
    out = []
    for _ in range(max_steps):
        token = int(masks(book, [handle])[handle][0])
        book.advance([handle], [token])
        out.append(token)
        if token == EOS:
            return out
    raise AssertionError("the grammar never ended")


def test_the_tokenizer_is_built_on_the_first_constraint_only(tmp_path):
    calls = []
    inner = tiny_compiler(tmp_path)
    compiler = GrammarCompiler(lambda: calls.append(1) or inner._tokenizer_json(),
                               inner.vocab_size, (EOS,))
    book = GrammarBook(compiler)
    book.add(0, None)
    assert not book and book.start_masks([0]) is None and calls == []
    book.add(1, YES_NO)
    book.add(2, YES_NO)
    compiler.prepare(YES_NO).result()        # compiled on the compile thread
    assert calls == [1] and compiler.num_compiled == 1


def test_a_constraint_compiles_off_the_step_and_is_reported_once(tmp_path):
    """add() returns while the compile thread is busy (held here by a job ahead of it); the
    handle is reported once compiled; a rank whose compile ended and one whose did not have the
    same digest until the row samples (the matcher is made only then, on every rank)."""
    slow, fast = tiny_compiler(tmp_path), tiny_compiler(tmp_path)
    gate = threading.Event()
    slow.pool.submit(gate.wait)
    a, b = GrammarBook(slow), GrammarBook(fast)
    a.add(3, YES_NO)
    b.add(3, YES_NO)
    fast.prepare(YES_NO).result()
    assert a.newly_compiled() == [] and b.newly_compiled() == [3] and b.newly_compiled() == []
    assert a.digest() == b.digest()
    gate.set()
    slow.prepare(YES_NO).result()
    assert a.newly_compiled() == [3]
    assert masks(a, [3])[3].tolist() == masks(b, [3])[3].tolist() != []
    assert a.digest() == b.digest()


def test_compiled_grammars_are_cached_by_key_with_a_bound(tmp_path):
    compiler = tiny_compiler(tmp_path, max_compiled=2)
    for c in (YES_NO, DIGITS, YES_NO, Constraint("regex", "a+"), YES_NO):
        compiler.matcher(c)
    assert compiler.num_compiled == 2
    assert set(compiler._compiled) == {YES_NO.key, Constraint("regex", "a+").key}


def test_each_request_gets_its_own_matcher(compiler):
    book = GrammarBook(compiler)
    book.add(0, YES_NO)
    book.add(1, YES_NO)
    feed(book, 0, encode(compiler, "y"))
    got = masks(book, [0, 1])
    text = {h: {compiler.tokenizer.decode_str([int(t)]) for t in ids} for h, ids in got.items()}
    assert text[0] and all("es".startswith(piece) for piece in text[0])
    assert all("yes".startswith(piece) or "no".startswith(piece) for piece in text[1])
    assert {piece[:1] for piece in text[1]} == {"y", "n"}


def test_masks_lead_to_a_full_match_and_then_eos_alone(compiler):
    book = GrammarBook(compiler)
    book.add(7, DIGITS)
    ids = greedy_walk(book, 7)
    text = compiler.tokenizer.decode_str(ids[:-1])
    assert re.fullmatch("[0-9]{2}-[a-z]{2}", text), text
    assert book._live[7].terminated and book.start_masks([7]) is None


def test_a_complete_grammar_allows_only_eos_and_counts_as_stopped(compiler):
    book = GrammarBook(compiler)
    book.add(0, YES_NO)
    book.add(1, YES_NO)
    book.add(2, None)
    feed(book, 0, encode(compiler, "no"))
    assert list(book.stopped([0, 1, 2])) == [True, False, False]
    assert list(masks(book, [0])[0]) == [EOS]


def test_rows_without_constraints_are_left_out(compiler):
    book = GrammarBook(compiler)
    book.add(5, YES_NO)
    m = book.start_masks([9, 5, 8]).result()
    assert list(m.indices) == [1] and m.bitmask.shape == (1, -(-compiler.vocab_size // 32))
    assert book.stopped([9, 8]).tolist() == [False, False]


def test_replay_after_preemption_equals_an_uninterrupted_run(compiler):
    a, b = GrammarBook(compiler), GrammarBook(compiler)
    a.add(3, DIGITS)
    b.add(3, DIGITS)
    done = []
    for token in encode(compiler, "42-x"):
        a.advance([3], [token])
        b.advance([3], [token])
        done.append(token)
    assert len(done) > 1
    b.preempt(3)
    assert not b and b.start_masks([3]) is None
    b.resume(3, done)
    assert np.array_equal(masks(a, [3])[3], masks(b, [3])[3])
    assert a.digest() == b.digest()


def test_resume_replays_a_terminated_constraint(compiler):
    book = GrammarBook(compiler)
    book.add(0, YES_NO)
    book.resume(0, encode(compiler, "yes") + [EOS, 40, 41])
    assert book.start_masks([0]) is None and book._live[0].terminated   # replayed when it samples


def test_finish_forgets_and_resume_of_an_unconstrained_request_is_a_no_op(compiler):
    book = GrammarBook(compiler)
    book.add(0, YES_NO)
    book.finish(0)
    book.resume(0, [])
    book.resume(1, [])
    assert not book


def test_a_refused_token_fails_the_request_once(compiler):
    book = GrammarBook(compiler)
    book.add(0, DIGITS)
    book.add(1, DIGITS)
    x = encode(compiler, "x")[0]
    book.advance([0, 1], [x, encode(compiler, "1")[0]])
    assert book._live[0].matcher.is_error() and not book._live[1].matcher.is_error()
    (error,) = book.take_errors().items()
    assert error[0] == 0 and error[1].startswith(f"its grammar refused token {x}: ")
    assert list(masks(book, [0])[0]) == [EOS]
    book.advance([0], [x])                   # consumes nothing more, reports nothing more
    assert book.take_errors() == {}


def test_digest_follows_the_state(compiler):
    a, b = GrammarBook(compiler), GrammarBook(compiler)
    for book in (a, b):
        book.add(0, YES_NO)
    assert a.digest() == b.digest()
    feed(a, 0, encode(compiler, "y"))
    assert a.digest() != b.digest()
    feed(b, 0, encode(compiler, "y"))
    assert a.digest() == b.digest()
    masks(a, [0])
    assert a.digest() != b.digest()      # the last step's masks count too
    masks(b, [0])
    assert a.digest() == b.digest()
    a.clear()
    assert not a


def test_a_grammar_that_does_not_compile_here_fails_that_request(tmp_path):
    """A worker-side compile failure (a tokenizer the engine cannot read) is reported once for
    the scheduler to end that request with it, instead of failing the step for every request
    (or, before, ending it as a normal stop); until then its row allows only eos."""
    inner = tiny_compiler(tmp_path)

    def broken():
        raise ValueError("no tokenizer here")
    book = GrammarBook(GrammarCompiler(broken, inner.vocab_size, (EOS, 40)))
    book.add(0, YES_NO)
    assert book.stopped([0]).tolist() == [True]
    assert list(masks(book, [0])[0]) == [EOS, 40]
    assert book.take_errors() == {0: "its grammar did not compile on the worker: "
                                     "no tokenizer here"}
    assert book.take_errors() == {}
    book.advance([0], [EOS])
    assert not book._live[0].terminated and book._live[0].error is not None
    book.finish(0)
    assert not book and book.take_errors() == {}


def test_a_constraint_too_deep_is_refused_not_compiled_and_allows_only_eos(compiler):
    """The diff check refuses it first (BAD_PAYLOAD); compiling it overflowed llguidance's
    stack on the rank's main thread (SIGSEGV)."""
    deep = Constraint("grammar", lark_chain(3000))
    with pytest.raises(ParamError, match="nested 3002 deep"):
        compiler.matcher(deep)
    book = GrammarBook(compiler)
    book.add(5, deep)
    assert book.stopped([5]).tolist() == [True]


def test_grammars_compile_on_a_big_stack_thread(tmp_path, monkeypatch):
    real, threads = llguidance.LLMatcher, []

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)
    compiler = tiny_compiler(tmp_path)
    monkeypatch.setattr(llguidance, "LLMatcher", spy)
    compiler.matcher(YES_NO)
    assert threads == ["big-stack"]
