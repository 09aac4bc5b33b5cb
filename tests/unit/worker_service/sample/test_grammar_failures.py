"""A grammar that fails mid-request on the worker fails that request alone, reported once in
GrammarBook.take_errors (RunnerOutput.request_errors): the matcher entering its error state while
a mask is computed (a resource limit of the grammar engine), and a mask that leaves none of the
row's allowed_token_ids (every logit -inf: the sampler's argmax would pick id 0). The other rows
are unaffected, and every rank decides the same (the digest agrees)."""
from __future__ import annotations

import llguidance
import numpy as np
import pytest

from engine_common.constraints.constraint import Constraint
from tests.support.grammar_text import EOS, encode, tiny_compiler
from worker_service.sample.grammar import GrammarBook

DIGITS = Constraint("regex", "[0-9]{2}-[a-z]{2}")
# Passes llguidance's validation (counted repetitions stay symbolic there), but the compile
# thread's first mask spends the lexer's whole fuel: the request's first mask puts its matcher in
# its error state ("lexer error: too many expressions constructed"), whose mask allows only eos,
# so it used to end at once as a normal STOP_TOKEN with an empty text the regex does not match.
# Admission now refuses it; a worker must still survive one (an older scheduler, another client
# of the step protocol).
HUGE = Constraint("regex", "a{1000000}")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return tiny_compiler(tmp_path_factory.mktemp("grammar"))


def allowed_ids(row: np.ndarray, vocab: int) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]).tolist()


def test_a_matcher_that_errs_computing_a_mask_fails_its_request_alone(compiler):
    books = [GrammarBook(compiler), GrammarBook(compiler)]     # two ranks
    for book in books:
        book.add(0, HUGE)
        book.add(1, DIGITS)
    reports = []
    for book in books:
        first = book.start_masks([0, 1]).result()
        assert allowed_ids(first.bitmask[0], compiler.vocab_size) == [EOS]
        book.advance([0, 1], [EOS, encode(compiler, "1")[0]])
        assert not book._live[0].terminated           # a failed grammar consumes nothing
        second = book.start_masks([0, 1]).result()    # the other row goes on
        assert allowed_ids(second.bitmask[1], compiler.vocab_size) == \
            allowed_ids(first.bitmask[1], compiler.vocab_size)
        reports.append(book.take_errors())
    assert reports[0] == reports[1]
    assert list(reports[0]) == [0]
    assert reports[0][0] == ("its grammar failed: lexer error: too many expressions "
                             "constructed")
    assert books[0].digest() == books[1].digest()
    assert books[0].take_errors() == {}                 # reported once


def test_allowed_token_ids_disjoint_from_the_mask_fail_the_request(compiler):
    book = GrammarBook(compiler)
    book.add(0, DIGITS)
    book.add(1, DIGITS)
    letters = encode(compiler, "x")
    digit = encode(compiler, "7")
    m = book.start_masks([0, 1], allowed=[letters, digit]).result()
    assert len(allowed_ids(m.bitmask[0], compiler.vocab_size)) > 0   # the grammar's own mask
    assert book.take_errors() == {0: "allowed_token_ids and its grammar leave no token to "
                                     "sample (none of the 1 allowed ids may come next)"}
    assert book._live[1].error is None


def test_allowed_token_ids_that_meet_the_mask_and_unrestricted_rows_pass(compiler):
    book = GrammarBook(compiler)
    book.add(0, DIGITS)
    book.add(1, DIGITS)
    book.start_masks([0, 1], allowed=[encode(compiler, "x5"), ()]).result()
    assert book.take_errors() == {}
    feed = encode(compiler, "12-ab")
    for token in feed:
        book.advance([0], [token])
    book.start_masks([0], allowed=[encode(compiler, "x")]).result()
    assert book.take_errors() == {0: "allowed_token_ids and its grammar leave no token to "
                                     "sample (none of the 1 allowed ids may come next)"}
    assert EOS not in encode(compiler, "x")


@pytest.fixture
def raw_compiler(tmp_path):
    """A compiler on llguidance's own tokenizer of the JSON, which reads "</s>" in forced text
    as the eos token (the compiler's own reads it as text: grammar_tokenizer.py)."""
    compiler = tiny_compiler(tmp_path)
    compiler._tokenizer = llguidance.LLTokenizer(compiler._tokenizer_json(),
                                                 n_vocab=compiler.vocab_size, eos_token=[EOS])
    return compiler


@pytest.mark.parametrize("choice, before", [("</s>", ""), ("ab</s>", "ab"), ("<s>", "")])
def test_a_mask_offering_only_a_special_token_before_the_text_is_done_fails(raw_compiler,
                                                                          choice, before):
    """With a tokenizer that reads forced "</s>" as the eos token the mask offered eos alone,
    and the request ended as a normal STOP_TOKEN whose text ("", "ab") broke the constraint (on
    SmolLM2, choice ["<|im_end|>"] did). Should it happen again, the request fails at that
    mask, saying why; a grammar that is done offers eos and goes on."""
    book = GrammarBook(raw_compiler)
    book.add(0, Constraint("choice", (choice,)))
    book.add(1, Constraint("choice", ("ab",)))
    for token_id in encode(raw_compiler, before):
        book.start_masks([0, 1]).result()
        book.advance([0, 1], [token_id, token_id])
    masks = book.start_masks([0, 1]).result()
    if before:
        assert allowed_ids(masks.bitmask[1], raw_compiler.vocab_size) == [EOS]
    errors = book.take_errors()
    assert list(errors) == [0]
    special = choice[len(before):]
    assert errors[0].startswith(f"its grammar must write {special!r} as text, which the "
                                "tokenizer reads as a special token")


@pytest.mark.parametrize("choice", ["</s>", "ab</s>", "<s>", "x <s> y"])
def test_a_special_tokens_text_in_a_constraint_is_written_as_text(compiler, choice):
    """The compiler's tokenizer reads forced "</s>" as text: the choice is written out in
    ordinary tokens and accepted, and eos comes only after it."""
    book = GrammarBook(compiler)
    book.add(0, Constraint("choice", (choice,)))
    ids = encode(compiler, choice)
    assert EOS not in ids and 0 not in ids
    for token_id in ids:
        assert EOS not in allowed_ids(book.start_masks([0]).result().bitmask[0],
                                      compiler.vocab_size)
        book.advance([0], [token_id])
    assert allowed_ids(book.start_masks([0]).result().bitmask[0], compiler.vocab_size) == [EOS]
    assert book.take_errors() == {} and book._live[0].matcher.is_accepting()
