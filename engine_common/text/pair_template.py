"""A sentence pair's special tokens, read once, so a pair is its two texts' plain ids joined:

    ids   = pre + ids(text_1) + mid + ids(text_2) + suf
    types = pre_types + [type_1] * len(text_1) + mid_types + [type_2] * len(text_2) + suf_types

BERT: pre [CLS], mid [SEP], suf [SEP], types 0 then 1; RoBERTa: <s> / </s></s> / </s>, all 0.
Scoring one text against N (1-to-N) then tokenizes the first text once, and a call holds each
text's ids once, not every pair's (engine_common/request/pair_prompts.py).

The template is read off tokenizer.json's post-processor by encoding probe pairs (None when
they do not decompose this way), as transformers' tokenizer(text_1, text_2) applies it:
tokenizer_config.json's add_bos_token / add_eos_token play no part (transformers 5 drops them
when tokenizer.json is there).
"""
from __future__ import annotations

from dataclasses import dataclass

# Probe pairs: the second one checks the template the first one gives.
_PROBES = (("a", "b"), ("hello world", "the fox, 12 times"))


@dataclass(frozen=True)
class PairTemplate:
    """The special tokens (and token types) around and between a pair's two texts."""

    pre: tuple[int, ...]
    pre_types: tuple[int, ...]
    mid: tuple[int, ...]
    mid_types: tuple[int, ...]
    suf: tuple[int, ...]
    suf_types: tuple[int, ...]
    type_1: int = 0
    type_2: int = 0

    @property
    def num_added(self) -> int:
        """Special tokens a pair gets beyond its two texts' own."""
        return len(self.pre) + len(self.mid) + len(self.suf)

    def join(self, ids_1, ids_2) -> tuple[list[int], list[int]]:
        """(ids, token type ids) of the pair whose texts' plain ids are `ids_1`, `ids_2`."""
        ids = [*self.pre, *ids_1, *self.mid, *ids_2, *self.suf]
        types = [*self.pre_types, *([self.type_1] * len(ids_1)), *self.mid_types,
                 *([self.type_2] * len(ids_2)), *self.suf_types]
        return ids, types

    @classmethod
    def probe(cls, backend) -> "PairTemplate | None":
        """Read off a tokenizers.Tokenizer's pair post-processing; None when a probe pair is not
        `pre + a + mid + b + suf` with one type per text."""
        found = _split(backend, *_PROBES[0])
        if found is None or _split(backend, *_PROBES[1]) != found:
            return None
        return found


def _split(backend, text_1: str, text_2: str) -> PairTemplate | None:
    full = backend.encode_batch([(text_1, text_2)], add_special_tokens=True)[0]
    a, b = (backend.encode_batch([t], add_special_tokens=False)[0].ids for t in (text_1, text_2))
    ids, types = list(full.ids), list(full.type_ids)
    for start in range(len(ids) - len(a) - len(b) + 1):
        if ids[start:start + len(a)] != a:
            continue
        rest = start + len(a)
        for mid_end in range(rest, len(ids) - len(b) + 1):
            if ids[mid_end:mid_end + len(b)] != b:
                continue
            end = mid_end + len(b)
            type_a, type_b = set(types[start:rest]), set(types[mid_end:end])
            if len(type_a) != 1 or len(type_b) != 1:
                return None
            return PairTemplate(tuple(ids[:start]), tuple(types[:start]),
                                tuple(ids[rest:mid_end]), tuple(types[rest:mid_end]),
                                tuple(ids[end:]), tuple(types[end:]),
                                type_a.pop(), type_b.pop())
    return None
