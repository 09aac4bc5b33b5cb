"""Grammar masks at speculative draft positions (worker_service/sample/grammar_drafts.py) on a
tiny real tokenizer: the mask at position p is the one a matcher fed the drafts before p
computes; the matcher is left where it was; a draft the grammar refuses ends the walk there;
a grammar that completes inside the drafts offers only eos there and nothing is masked after
an eos; a failure at a later position counts only when the accepted run reaches it."""
from __future__ import annotations

import llguidance
import numpy as np
import pytest

from engine_common.constraints.constraint import Constraint
from tests.support.grammar_text import EOS, encode, tiny_compiler
from worker_service.sample.grammar import GrammarBook
from worker_service.sample.spec_verify import grammar_trim

DIGITS = Constraint("regex", "[0-9]{2}-[a-z]{2}")
YES_NO = Constraint("choice", ("yes", "no"))


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return tiny_compiler(tmp_path_factory.mktemp("grammar-drafts"))


def allowed_ids(row: np.ndarray, vocab: int) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]).tolist()


def fed_book(compiler, constraint, ids) -> GrammarBook:
    book = GrammarBook(compiler)
    book.add(0, constraint)
    book.stopped([0])
    book.advance([0] * len(ids), ids)
    return book


def one_mask(book: GrammarBook) -> list[int]:
    m = book.start_masks([0]).result()
    return allowed_ids(m.bitmask[0], book.compiler.vocab_size)


def drafted_masks(book: GrammarBook, drafts: list[int], allowed=None):
    """The step's masks for handle 0 with `drafts`, drawn as sampling row 0 (the bonus) and
    draws 1..k (positions 0..k-1), as SpecStep.sampling_rows lays them out: (walk, position
    -> allowed ids, or None where nothing is masked)."""
    book.stopped([0])
    walks = book.walk_drafts([0], [drafts])
    w = walks[0]
    k = len(drafts)
    w.draws = [*range(1, k + 1), 0]
    m = book.start_masks([0], allowed=allowed, walks=walks).result()
    rows = {int(i): allowed_ids(r, book.compiler.vocab_size) for i, r in zip(m.indices, m.bitmask)}
    return w, {p: rows.get(w.draws[p]) for p in range(k + 1)}


def test_each_position_masks_with_the_state_after_the_drafts_before_it(compiler):
    """A mutation that gives every position the step's first mask fails here: the regex
    allows digits, then '-', then letters."""
    drafts = encode(compiler, "12-ab")
    assert len(drafts) >= 4
    book = fed_book(compiler, DIGITS, [])
    before = book.digest()
    w, got = drafted_masks(book, drafts)
    assert w.valid == len(drafts) and not w.eos
    for p in range(len(drafts) + 1):
        want = one_mask(fed_book(compiler, DIGITS, drafts[:p]))
        assert got[p] == want, p
    assert got[0] != got[len(drafts) - 1]
    assert got[len(drafts)] == [EOS] and w.stopped[-1] and not any(w.stopped[:-1])
    # the matcher is where it was: the same masks and state as before the walk
    book.start_masks([0]).result()
    assert one_mask(book) == one_mask(fed_book(compiler, DIGITS, []))
    assert book._live[0].num_consumed == 0 and book.digest() != b"" and before


def test_a_draft_the_grammar_refuses_ends_the_walk(compiler):
    ok = encode(compiler, "1")
    bad = encode(compiler, "x")             # a letter where the regex wants a digit
    drafts = ok + bad + encode(compiler, "2-a")
    book = fed_book(compiler, DIGITS, [])
    w, got = drafted_masks(book, drafts)
    assert w.valid == len(ok)
    at = len(ok)
    assert bad[0] not in got[at]                       # its draw can never be the draft
    assert got[at] == one_mask(fed_book(compiler, DIGITS, ok))
    for p in range(at + 1, len(drafts) + 1):           # never reached: `valid`'s mask
        assert got[p] == got[at]
    assert book.take_errors() == {}


def test_a_grammar_that_completes_inside_the_drafts(compiler):
    """"yes" then eos then more: the eos position offers eos alone; after it nothing is
    masked (the grammar is done, as after a sampled eos)."""
    yes = encode(compiler, "yes")
    drafts = yes + [EOS] + encode(compiler, "no")
    book = fed_book(compiler, YES_NO, [])
    w, got = drafted_masks(book, drafts)
    assert w.valid == len(yes) and w.eos
    assert got[len(yes)] == [EOS] and w.stopped[len(yes)]
    assert all(got[p] is None for p in range(len(yes) + 1, len(drafts) + 1))
    assert not any(w.stopped[len(yes) + 1:])
    # the accepted run: the matcher consumes it as one-token decoding would
    book.advance([0] * (len(yes) + 1), yes + [EOS])
    assert book._live[0].terminated and book.start_masks([0]) is None


def test_a_failure_at_a_later_position_counts_only_when_the_run_reaches_it(compiler):
    """allowed_token_ids of digits only: positions 0 and 1 may sample, '-' at position 2 leaves
    nothing; a run that stops before position 2 does not fail, one that reaches it does."""
    drafts = encode(compiler, "12-ab")
    digits = encode(compiler, "0123456789")
    two = len(encode(compiler, "12"))
    for reached, fails in ((two, False), (two + 1, True)):
        book = fed_book(compiler, DIGITS, [])
        drafted_masks(book, drafts, allowed=[digits])
        assert book.take_errors() == {}                   # nothing yet: position 0 is fine
        book.advance([0] * reached, drafts[:reached])
        errors = book.take_errors()
        assert (0 in errors) == fails, errors
        if fails:
            assert errors[0].startswith("allowed_token_ids and its grammar leave no token")
            assert book._live[0].num_consumed == reached


def limited_book(compiler, max_items_in_row: int) -> GrammarBook:
    """A book whose request 0 has an ambiguous grammar (every split of "aaa.." parses, so
    llguidance's Earley rows grow with the output) under a tight row limit: consuming the
    4th "a" hits it and the matcher enters its error state for good."""
    book = GrammarBook(compiler)
    book.add(0, Constraint("grammar", 'start: s\ns: "a"'))
    book.stopped([0])
    grammar = llguidance.LLMatcher.grammar_from_lark('start: s\ns: s s | "a"')
    limits = llguidance.LLParserLimits(max_items_in_row=max_items_in_row)
    book._live[0].matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0,
                                                 limits=limits)
    return book


def test_a_limit_hit_at_a_draft_the_run_does_not_reach_fails_nothing(compiler):
    """One-token decoding fails this request only once it consumes the 4th "a". Drafts of
    five "a"s from the start walk past that point; a run that stops after two (eos drawn at
    position 2) must not fail, and the matcher must still work; a run that takes the 4th "a"
    fails as one-token decoding would."""
    a = encode(compiler, "a")
    assert len(a) == 1
    for run, fails in ((a * 2 + [EOS], False), (a * 4, True)):
        book = limited_book(compiler, 10)
        w, got = drafted_masks(book, a * 5)
        assert book.take_errors() == {}, run
        assert not book._live[0].matcher.is_error()
        assert w.valid == 3 and all(a[0] in got[p] for p in range(4)) and EOS in got[2]
        book.advance([0] * len(run), run)
        errors = book.take_errors()
        assert (0 in errors) == fails, (run, errors)
        if not fails:
            assert book._live[0].terminated


def mask_limited_book(compiler, step_max_items: int) -> GrammarBook:
    """As limited_book, but under a limit on the items of one mask: consuming goes on, and
    computing the mask after the 3rd "a" fails (step_max_items 10)."""
    book = limited_book(compiler, 10_000)
    grammar = llguidance.LLMatcher.grammar_from_lark('start: s\ns: s s | "a"')
    limits = llguidance.LLParserLimits(step_max_items=step_max_items)
    book._live[0].matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0,
                                                 limits=limits)
    return book


def test_a_mask_failing_at_a_draft_position_ends_the_run_before_it(compiler):
    """Drafts of five "a"s from the start: the mask at position 3 fails. Before, the matcher
    itself computed the drafted masks, entered its error state and failed the request at once
    though the run might stop before position 3. Now the request is unharmed, the run may
    reach position 2 at most (`reach`: its draw there is the one-token decoding's), rows past
    it repeat its mask, and the request fails only when its own next mask fails too."""
    a = encode(compiler, "a")
    book = mask_limited_book(compiler, 10)
    w, got = drafted_masks(book, a * 5)
    assert book.take_errors() == {} and not book._live[0].matcher.is_error()
    assert w.valid == 5 and w.reach == 2
    assert all(got[p] == got[2] for p in range(3, 6)) and a[0] in got[2]
    assert [w.reached(p) for p in range(6)] == [True] * 3 + [False] * 3
    book.advance([0] * 3, a * 3)                     # the run: two drafts, then its draw
    assert book.take_errors() == {}
    one_mask(book)                                   # the real state's mask: the same limit
    errors = book.take_errors()
    assert "Too many items (limit 10; mask)" in errors[0]


def test_a_mask_failing_at_position_0_fails_the_request_as_without_drafts(compiler):
    a = encode(compiler, "a")
    book = mask_limited_book(compiler, 10)
    book.advance([0] * 3, a * 3)
    drafted_masks(book, a * 2)
    errors = book.take_errors()
    assert "Too many items (limit 10; mask)" in errors[0]
    assert book._live[0].matcher.is_error()


def test_drafts_after_an_allowed_eos_are_not_computed(compiler):
    """grammar_trim keeps the drafts up to an allowed eos and cuts those after it: the request
    ends at that eos (with ignore_eos it goes on unconstrained, and the cut drafts' bonus is
    the same draw), so they were forward work for tokens never kept."""
    yes = encode(compiler, "yes")
    drafts = yes + [EOS] + encode(compiler, "no")
    book = fed_book(compiler, YES_NO, [])
    book.stopped([0])
    kept, walks = grammar_trim({0: drafts, 5: [7, 8]}, book)
    assert kept == {0: yes + [EOS], 5: [7, 8]}        # 5: unconstrained, as it was
    w = walks[0]
    assert w.eos and w.valid == len(yes) and w.drafts == yes + [EOS]
    assert len(w.stopped) == len(w.accepting) == len(yes) + 2
    assert w.masked_positions == list(range(len(yes) + 1))      # the bonus is unmasked
