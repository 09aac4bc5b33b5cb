"""nano-vllm's offline workload: random prompt token ids, input and output lengths each uniform.

Every request ignores EOS and produces exactly its drawn output length, so the token count is
fixed by the seed and two engines run the same work.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine_common.params import ParamError

# Prompt ids are drawn from [0, PROMPT_ID_LIMIT) (or the vocabulary, if smaller), as nano-vllm does.
PROMPT_ID_LIMIT = 10_000


@dataclass(frozen=True)
class Workload:
    """prompts[i] (token ids) is to be continued by exactly output_lens[i] tokens."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab_size: int,
                  seed: int = 0) -> Workload:
    """`num_seqs` prompts with lengths and output lengths uniform in [min_len, max_len]."""
    if num_seqs < 1:
        raise ParamError("num_seqs", num_seqs, ">= 1")
    if min_len < 1:
        raise ParamError("min_len", min_len, ">= 1")
    if max_len < min_len:
        raise ParamError("max_len", max_len, f">= min_len ({min_len})")
    rng = random.Random(seed)
    id_limit = min(PROMPT_ID_LIMIT, vocab_size)
    prompts = [[rng.randrange(id_limit) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(prompts, output_lens, seed)
