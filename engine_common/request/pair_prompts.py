"""A Score call's pairs tokenized up front, held compactly (LLM.score and deltaserve.v1 Score).

Every pair is tokenized and checked before the first is sent (a bad pair fails the call, not
half of it), but a pair's full ids are built only when it is sent (`prompt`): the call holds
each text's ids once, as uint32 arrays (4 bytes a token, not a Python int's 28 plus its list
slot), and a 1-to-N call tokenizes its first text once, not N times, when the tokenizer's pair
template decomposes (engine_common/text/pair_template.py). A model that `concatenates_pairs`
tokenizes each text_1 + text_2 whole, as vLLM does.

A call's pairs together may hold at most `max_tokens` tokens (--max-score-tokens): 1024 pairs
of 32k tokens would otherwise be 32M ids held at once. The count stops at the first pair past
it, before the rest are tokenized.
"""
from __future__ import annotations

from array import array

from engine_common.request.classify import concatenates_pairs, encode_score_pair
from engine_common.request.params import ParamError

# --max-score-tokens' default: 8 Mi tokens (32 MiB of ids), 1024 pairs of 8k tokens each.
DEFAULT_MAX_SCORE_TOKENS = 1 << 23


class PairPrompts:
    """Pairs added in order (`add`), each retrievable as (ids, token type ids) (`prompt`)."""

    def __init__(self, tokenizer, hf_config: dict, max_tokens: int = DEFAULT_MAX_SCORE_TOKENS,
                 field: str = "text_2"):
        self._tokenizer = tokenizer
        self._template = None if concatenates_pairs(hf_config) else tokenizer.pair_template()
        self._hf_config = hf_config
        self._max_tokens = max_tokens
        self._field = field
        self._firsts: dict[str, array] = {}       # text_1 -> its ids (a 1-to-N call: one)
        self._pairs: list[tuple] = []             # (text_1 ids, text_2 ids), or (ids, types)
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._pairs)

    def add(self, text_1: str, text_2: str) -> int:
        """Tokenize one pair; its number of tokens. ParamError naming `field` when the call's
        pairs pass `max_tokens` together."""
        if self._template is None or not text_2:      # an empty text_2: text_1 alone
            ids, types = self._whole(text_1, text_2)
            entry, n = (array("I", ids), array("B", types)), len(ids)
        else:
            first = self._firsts.get(text_1)
            if first is None:
                first = array("I", self._tokenizer.encode(text_1, add_special_tokens=False))
                self._firsts[text_1] = first
            second = array("I", self._tokenizer.encode(text_2, add_special_tokens=False))
            entry, n = (first, second), len(first) + len(second) + self._template.num_added
        total = self.num_tokens + n
        if total > self._max_tokens:
            raise ParamError(self._field, f"{total} tokens in the first {len(self) + 1} pairs",
                             f"at most {self._max_tokens} tokens in one call's pairs together "
                             "(--max-score-tokens; split the call)")
        self.num_tokens = total
        self._pairs.append(entry)
        return n

    def _whole(self, text_1: str, text_2: str) -> tuple[list[int], list[int]]:
        return encode_score_pair(self._tokenizer, self._hf_config, text_1, text_2)

    def prompt(self, i: int) -> tuple[list[int], list[int]]:
        """Pair i's (ids, token type ids), as the tokenizer's encode_pair gives them."""
        first, second = self._pairs[i]
        if second.typecode == "I":          # (text_1 ids, text_2 ids)
            return self._template.join(first, second)
        return first.tolist(), second.tolist()
