"""Prompt logprobs on CUDA, where the offline LLM pipelines its runner and replays decode CUDA
graphs: the rows come back through the non-blocking copy and its event, a step that computes
them runs eagerly, and a prompt chunked over steps still gets every position once. Checked
against transformers' float32 log_softmax on the CPU over the same weights (a looser tolerance
than the CPU tests': two devices' float32 GEMMs); and asking changes no greedy token of the
same batch. Marked `gpu`; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import StoppingParams
from tests.support.prompt_logprobs_reference import hf_prompt_logprobs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATOL = 2e-3
CLEAR_GAP = 1e-2          # top-k order compared only where transformers' gaps exceed this
PROMPTS = [list(range(5, 45)), [7, 3, 99, 41, 8, 8, 12], [300, 2, 17]]
STOP = StoppingParams(max_tokens=6, ignore_eos=True)


def _llm(model: str, **kw) -> LLM:
    return LLM(model, device="cuda", dtype="float32", kv_cache_bytes=256 << 20,
               max_model_len=256, max_num_seqs=8, **kw)


def _assert_close(got: list, model: str, prompt: list[int], k: int) -> None:
    ref = hf_prompt_logprobs(model, tuple(prompt), k)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        e, (logprob, _rank, top_ids, top_lps) = got[i], ref[i]
        assert e.token_id == prompt[i], i
        assert abs(e.logprob - logprob) <= ATOL, (i, e.logprob, logprob)
        assert len(e.top_token_ids) == k
        assert all(abs(a - b) <= ATOL for a, b in zip(e.top_logprobs, top_lps)), i
        clear = all(a - b > CLEAR_GAP for a, b in zip(top_lps, top_lps[1:]))
        if clear:
            assert list(e.top_token_ids) == top_ids, (i, e.top_token_ids, top_ids)


@pytest.mark.parametrize("budget", [8, 256])
def test_prompt_logprobs_on_cuda_equal_transformers(tiny_models, budget):
    """budget 8: the 40-token prompt is prefilled over five steps, its neighbours decode
    (graph steps) in between; 256: every prompt in one step."""
    model = tiny_models("qwen3")
    llm = _llm(model, max_num_batched_tokens=budget)
    try:
        assert llm.runner.pipelined
        outs = llm.generate(PROMPTS, None, STOP, num_prompt_logprobs=3)
        for prompt, out in zip(PROMPTS, outs):
            _assert_close(out.prompt_logprobs, model, prompt, 3)
            assert len(out.token_ids) == 6
        assert not llm.runner.prompt_logprobs          # nothing kept after the call
    finally:
        llm.close()


def test_asking_changes_no_token(tiny_models):
    """The same greedy tokens for the same chunked batch whether its requests ask for prompt
    logprobs (those steps run eagerly, with the prompt rows and their copies) or not."""
    model = tiny_models("qwen3")
    llm = _llm(model, max_num_batched_tokens=8)
    try:
        plain = [o.token_ids for o in llm.generate(PROMPTS, None, STOP)]
        asking = llm.generate(PROMPTS, None, STOP, num_prompt_logprobs=2)
        assert all(o.prompt_logprobs is not None for o in asking)
        assert [o.token_ids for o in asking] == plain
    finally:
        llm.close()
