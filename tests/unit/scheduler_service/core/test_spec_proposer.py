"""The n-gram proposer: the longest suffix n-gram's last earlier occurrence, and what follows
(continued periodically where it runs into the sequence end)."""
from __future__ import annotations

import numpy as np

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.core.spec_proposer import TokenBuffers, propose_ngram


def _p(tokens, k=3, lo=1, hi=3) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int32), k, lo, hi).tolist()


def test_follows_the_last_occurrence_of_the_suffix():
    # suffix [1, 2] occurs at 0 and 4: the later one is followed by 9, 9
    assert _p([1, 2, 7, 7, 1, 2, 9, 9, 5, 1, 2]) == [9, 9, 5]


def test_prefers_the_longest_suffix_over_a_later_shorter_match():
    # [5, 1, 2] occurs once early (followed by 8); [1, 2] alone later (followed by 3)
    tokens = [5, 1, 2, 8, 8, 1, 2, 3, 4, 5, 1, 2]
    assert _p(tokens, hi=3) == [8, 8, 1]
    assert _p(tokens, hi=2) == [3, 4, 5]


def test_min_length_and_no_match():
    assert _p([1, 2, 3, 4, 5]) == []                     # the last id never occurred before
    assert _p([7, 1, 9, 1], lo=2) == []                  # only a 1-gram matches
    assert _p([7, 1, 9, 1], lo=1) == [9, 1, 9]          # period 2 from the 1-gram match
    assert _p([4], lo=1) == []


def test_drafts_stop_at_k():
    assert _p([1, 2, 3, 1, 2, 3, 1, 2, 3], k=2, hi=4) == [1, 2]
    assert _p([1, 2, 3, 1], k=0) == []


def test_a_repeated_token_drafts_k():
    # period 1: the last occurrence is one token back; only one token follows it
    assert _p([3, 3], k=5) == [3] * 5
    assert _p([200] * 7, k=5, lo=2, hi=4) == [200] * 5


def test_period_two_and_three_tails_continue_periodically():
    assert _p([9, 4, 5, 4, 5, 4, 5], k=5, hi=4) == [4, 5, 4, 5, 4]
    assert _p([8, 1, 2, 3, 1, 2, 3], k=7, hi=3) == [1, 2, 3, 1, 2, 3, 1]
    # a longer period than the match: [6] at distance 3, the period holds 7, 2, 6
    assert _p([7, 2, 6, 7, 2, 6], k=4, lo=1, hi=1) == [7, 2, 6, 7]


def test_a_continuation_inside_the_sequence_is_unchanged():
    tokens = [1, 2, 9, 8, 7, 6, 5, 4, 1, 2]
    assert _p(tokens, k=5) == [9, 8, 7, 6, 5]            # a slice of the history, not periodic
    assert _p(tokens, k=8) == [9, 8, 7, 6, 5, 4, 1, 2]   # exactly reaches the end
    assert _p(tokens, k=10) == [9, 8, 7, 6, 5, 4, 1, 2, 9, 8]


def test_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        lo, hi, k = int(rng.integers(1, 3)), int(rng.integers(2, 6)), int(rng.integers(1, 5))
        hi = max(hi, lo)
        want = []
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
            if starts:
                start = starts[-1] + n
                history = list(tokens)
                while len(history) < start + k:              # the tail's period repeats
                    history.append(history[len(history) - (len(tokens) - start)])
                want = history[start:start + k]
                break
        assert _p(tokens, k, lo, hi) == want, (tokens, lo, hi, k)


def test_token_buffers_follow_the_growing_request():
    req = Request("r", [5, 6, 7], SamplingParams(), StoppingParams())
    bufs = TokenBuffers()
    assert bufs.tokens(req).tolist() == [5, 6, 7]
    bufs.end_round()
    for t in range(200):                 # grows past its first capacity
        req.output_token_ids.append(t)
        assert bufs.tokens(req).tolist() == [5, 6, 7, *range(t + 1)]
        bufs.end_round()
    bufs.end_round()                     # not asked about in a round: forgotten
    assert bufs._bufs == {}
    assert bufs.tokens(req).tolist() == [5, 6, 7, *range(200)]
