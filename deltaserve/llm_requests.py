"""One offline call's prompts as scheduler requests (LLM._generate), made one at a time as they
are queued: a call of 100k prompts checks each up front (a refused one fails the call before
anything runs, named by its index) but holds only the requests in the scheduler, not 100k
Request objects with their prompt bytes (before, every request was built, and checked, first).
"""
from __future__ import annotations

from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.request.pooling import NO_POOLING
from deltaserve.llm_inputs import (capped_to_model, check_constraints, check_for_runner,
                                   lora_ids_per_prompt, per_prompt, prompt_ids)
from scheduler_service.core.admission import RequestRejected, check_admission
from scheduler_service.core.request import Request

# A pooling call's requests in the scheduler at once, in running batches (max_num_seqs): one
# batch running and the next waiting, so async scheduling still has a step to overlap (the
# servers' Classify and Score keep one batch: scheduler_service/api/scoring.py call_window).
POOLING_WINDOW_BATCHES = 2


class OfflineRequests:
    """A call's prompts, each checked as generate() takes it; `request(i)` builds the i-th
    request (id `request_ids[i]`) when it is queued."""

    def __init__(self, llm, prompts, sampling, stopping, num_logprobs, constraint,
                 num_prompt_logprobs=None, lora_request=None,
                 pooling: int | list[int] = NO_POOLING):
        self.prompt_ids = prompt_ids(prompts, llm.tokenizer)
        n = len(self.prompt_ids)
        self._samplings = per_prompt("sampling", sampling, n, SamplingParams, SamplingParams())
        stoppings = per_prompt("stopping", stopping, n, StoppingParams, StoppingParams())
        self._constraints = per_prompt("constraint", constraint, n, Constraint, None)
        self._adapters = lora_ids_per_prompt(lora_request, n, llm._lora.registry)
        self._poolings = pooling if isinstance(pooling, list) else [pooling] * n
        check_constraints(self._constraints)
        check_for_runner(self.prompt_ids, self._samplings, stoppings, num_logprobs,
                         llm.model_info.vocab_size, num_prompt_logprobs)
        self._stoppings = capped_to_model(self.prompt_ids, stoppings,
                                          llm.model_info.max_model_len)
        self._eos = llm.model_info.eos_token_ids
        self._num_logprobs, self._num_prompt_logprobs = num_logprobs, num_prompt_logprobs
        self.request_ids = [f"offline-{next(llm._ids)}" for _ in range(n)]

    def __len__(self) -> int:
        return len(self.request_ids)

    def request(self, i: int) -> Request:
        """The i-th prompt's request, new (its arrival time is now)."""
        lora_id, lora_generation = self._adapters[i]
        return Request(self.request_ids[i], self.prompt_ids[i], self._samplings[i],
                       self._stoppings[i], self._eos, num_logprobs=self._num_logprobs,
                       constraint=self._constraints[i],
                       num_prompt_logprobs=self._num_prompt_logprobs, lora_id=lora_id,
                       lora_generation=lora_generation, pooling=self._poolings[i])

    def check_admission(self, scheduler) -> None:
        """Each request as the scheduler will admit it, before any is queued: a refused prompt
        fails the call before anything runs, named by its index (past max_waiting, the prompts
        before it had run first, and the error named an internal request id). Each is built,
        checked and dropped: none is held."""
        config = scheduler.config
        for i in range(len(self)):
            try:
                check_admission(self.request(i), max_model_len=config.max_model_len,
                                max_step_tokens=config.max_num_batched_tokens,
                                block_size=config.block_size,
                                num_blocks=scheduler.max_prompt_blocks, num_waiting=0,
                                max_waiting=1, known=False)
            except RequestRejected as e:
                raise RequestRejected(f"prompts[{i}]", e.field, e.value, e.allowed) from None


def pooling_window(scheduler) -> int:
    """Requests of a pooling call (embed, classify, score) in the scheduler at once."""
    return POOLING_WINDOW_BATCHES * scheduler.config.max_num_seqs
