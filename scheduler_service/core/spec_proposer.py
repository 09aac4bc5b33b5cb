"""The n-gram (prompt lookup) proposer: drafts a request's next tokens from its own history.

For a request's tokens t[0..L) (prompt, then output) it looks for the longest suffix n-gram
t[L-n..L), n from prompt_lookup_max down to prompt_lookup_min, that occurs earlier in t, takes
its last earlier occurrence, and proposes the k tokens that followed it there. When fewer than
k follow it (it ends p tokens before the suffix does: the tail is taken to repeat with period
p), the continuation goes on periodically, t[start + i % p], as the text would if the repeat
held. Without that a tail of period p drafts only p tokens, and async
scheduling, which spends one on its guess of the step in flight, none on a repeated token.
The last occurrence, not the earliest, is kept: in the async simulator tests it predicted better.

Cost (numpy, no Python per token): the positions holding the last token are found in one
compare over t; each further suffix length is one gather and compare over those candidates
only. `tokens` is a request's growing int32 buffer (TokenBuffers), never rebuilt per step.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to `k` drafts (int32, possibly none) for the sequence `tokens` (1-D int32)."""
    size = len(tokens)
    if size < n_min + 1 or k <= 0:
        return tokens[:0]
    last = tokens[-1]
    # Candidate ends c (< size - 1): t[c] == t[-1]; a match of length n ends there when
    # t[c-j] == t[size-1-j] for j < n (and c - n + 1 >= 0).
    ends = np.flatnonzero(tokens[:size - 1] == last)
    if not len(ends):
        return tokens[:0]
    n_max = min(n_max, size - 1)
    best_n, alive = 1, ends
    for j in range(1, n_max):
        alive = alive[alive >= j]
        if not len(alive):
            break
        alive = alive[tokens[alive - j] == tokens[size - 1 - j]]
        if not len(alive):
            break
        best_n, ends = j + 1, alive
    if best_n < n_min:
        return tokens[:0]
    start = int(ends[-1]) + 1            # the last occurrence of the longest suffix found
    if start + k <= size:
        return tokens[start:start + k]
    period = size - start                # the occurrence ends this many tokens before the suffix
    return tokens[start + np.arange(k) % period]


class TokenBuffers:
    """Each drafting request's prompt + output ids as a growing int32 array (only the new
    output ids are copied in per step), kept for the requests of the last proposal round."""

    def __init__(self) -> None:
        self._bufs: dict[str, tuple[np.ndarray, int]] = {}
        self._next: dict[str, tuple[np.ndarray, int]] = {}

    def tokens(self, request) -> np.ndarray:
        """The request's ids so far (a view; valid until the next call for it)."""
        rid = request.request_id
        prompt, output = request.prompt_token_ids, request.output_token_ids
        total = len(prompt) + len(output)
        buf, size = self._bufs.get(rid) or self._next.get(rid) or (None, 0)
        if buf is None:
            buf = np.empty(max(64, 2 * total), dtype=np.int32)
            buf[:len(prompt)] = prompt
            size = len(prompt)
        if total > len(buf):
            grown = np.empty(2 * total, dtype=np.int32)
            grown[:size] = buf[:size]
            buf = grown
        if total > size:
            p = len(prompt)
            buf[size:total] = output[size - p:]
        self._next[rid] = (buf, total)
        return buf[:total]

    def end_round(self) -> None:
        """Forget the requests not asked about since the last round (finished, preempted,
        no longer drafting): their buffers are rebuilt if they ask again."""
        self._bufs, self._next = self._next, {}
