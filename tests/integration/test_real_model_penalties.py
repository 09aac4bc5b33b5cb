"""Penalties on the real default model (SmolLM2-135M-Instruct, fp32 on CPU) against transformers
on the same weights: greedy with repetition_penalty equals generate() with its
RepetitionPenaltyLogitsProcessor (prompt and output ids, as vLLM); presence and frequency
penalties (output ids only, OpenAI's and vLLM's definition) equal a logits processor written from
that definition; the returned logprobs are log_softmax of the raw logits (vLLM's raw_logprobs)."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.hf_reference import hf_model

pytestmark = pytest.mark.slow
MAX_NEW = 16
PROMPTS = ["The cat sat on the mat. The cat sat on the", "List: apple, apple, apple, banana,"]


class _OpenAIPenalties(LogitsProcessor):
    """logit -= frequency * count + presence * (count > 0), counts over the output ids."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="float32", num_kv_blocks=64)


@pytest.mark.parametrize("penalty", [
    dict(repetition_penalty=1.3), dict(repetition_penalty=0.8),
    dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
    dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)])
def test_greedy_with_penalties_equals_transformers(llm, default_model, penalty):
    model = hf_model(default_model)
    for text in PROMPTS:
        prompt = llm.tokenizer.encode(text)
        out = llm.generate([prompt], SamplingParams(**penalty),
                           StoppingParams(max_tokens=MAX_NEW, ignore_eos=True), num_logprobs=0)[0]
        ids = torch.tensor([prompt])
        extra = _OpenAIPenalties(len(prompt), penalty.get("presence_penalty", 0.0),
                                 penalty.get("frequency_penalty", 0.0))
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, pad_token_id=0,
                                 repetition_penalty=penalty.get("repetition_penalty", 1.0),
                                 logits_processor=LogitsProcessorList([extra]),
                                 output_logits=True, return_dict_in_generate=True)
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist(), (text, penalty)
        raw = [float(step[0].float().log_softmax(-1)[t])
               for step, t in zip(ref.logits, out.token_ids)]
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(raw, abs=2e-4)
