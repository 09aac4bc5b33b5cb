"""The n-gram proposer: the longest suffix n-gram's last earlier occurrence, and what follows."""
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
    assert _p([7, 1, 9, 1], lo=1) == [9, 1]
    assert _p([4], lo=1) == []


def test_drafts_stop_at_the_sequence_end_and_k():
    assert _p([3, 3], k=5) == [3]                        # overlapping match: one token follows
    assert _p([1, 2, 3, 1, 2, 3, 1, 2, 3], k=2, hi=4) == [1, 2]
    assert _p([1, 2, 3, 1], k=0) == []


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
                want = tokens[starts[-1] + n:starts[-1] + n + k]
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
