"""transformers' prompt logprobs on the same weights (float32), and the check of ours against
them: vLLM's definition (log_softmax of the raw logits at position i - 1 for prompt token i,
rank = how many ids are at least as likely, top-k best first)."""
from __future__ import annotations

from functools import lru_cache

import torch

from tests.support.hf_reference import hf_model

ATOL = 1e-4


@lru_cache(maxsize=64)
def hf_prompt_logprobs(model_dir: str, prompt: tuple[int, ...], k: int) -> list:
    """[None] + per position i >= 1: (logprob of prompt[i], its rank, top-k ids, top-k
    logprobs), from transformers' float32 forward over the prompt."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    lp = logits.log_softmax(dim=-1)
    out = [None]
    for i in range(1, len(prompt)):
        row, t = lp[i - 1], prompt[i]
        top = row.topk(k) if k else None
        out.append((float(row[t]), int((row >= row[t]).sum()),
                    [] if top is None else top.indices.tolist(),
                    [] if top is None else top.values.tolist()))
    return out


def assert_matches_hf(got: list, model_dir: str, prompt: list[int], k: int,
                      ranks: bool = True) -> None:
    """`got` (RequestOutput.prompt_logprobs entries) equals transformers': None first, then the
    prompt token, its logprob (ATOL), its rank (unless `ranks` is False: a protocol without
    them) and the top-k ids (logprobs within ATOL)."""
    ref = hf_prompt_logprobs(model_dir, tuple(prompt), k)
    assert got is not None and len(got) == len(prompt), (None if got is None else len(got))
    assert got[0] is None
    for i in range(1, len(prompt)):
        e, (logprob, rank, top_ids, top_lps) = got[i], ref[i]
        assert e.token_id == prompt[i], i
        assert abs(e.logprob - logprob) <= ATOL, (i, e.logprob, logprob)
        assert e.rank == rank or not ranks, (i, e.rank, rank)
        assert list(e.top_token_ids) == top_ids, (i, e.top_token_ids, top_ids)
        assert all(abs(a - b) <= ATOL for a, b in zip(e.top_logprobs, top_lps)), i
