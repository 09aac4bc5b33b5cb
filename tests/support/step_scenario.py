"""A scripted run of diffs for model-runner tests (tests/test_step_buffers.py and
tests/test_gpu_no_host_sync.py): every kind of step, every sampling feature.

Runner limits it is written for (RUNNER_LIMITS): block size 4, max_model_len 32 (8 blocks per
request), max_num_seqs 4, max_num_batched_tokens 16, 48 KV blocks (8 per handle, never shared).

    step  what                                                        rows  tokens  sampling
    0     new h0 (10 tokens) + h1 (6): the largest step                2     16      both
    1     decode                                                      2     2       both
    2     new h2 (3) + h3 (2) with decodes: max_num_seqs rows          4     7       all
    3-5   pure decode                                                 4     4       all
    6     h0 finishes; h4's first 8 of 12 prompt tokens, others idle  1     8       none
    7     h4's last 4 prompt tokens with decodes                      4     7       all
    8-9   pure decode                                                 4     4       all
    10    h1 finishes; h5 (3-token prompt) prefills 1 token per step  4     4       not h5
    11    (a pure-decode batch in which a row does not sample)        4     4       not h5
    12    h5's last prompt token                                      4     4       all
    13    pure decode                                                 4     4       all
    14    h2 finishes: 3 rows (a decode graph pads them to 4)         3     3       all

Sampling: h0 greedy with 2 top logprobs; h1 top-k 5 + top-p 0.9; h2 min-p with repetition,
presence and frequency penalties; h3 greedy with min_tokens 3 and stop ids (masked while it
has fewer than 3 tokens); h4 top-k 3; h5 greedy.
"""
from __future__ import annotations

from engine_common.wire.diff import NewRequestData, SchedulerOutput
from engine_common.request.params import SamplingParams, WorkerSamplingParams

RUNNER_LIMITS = dict(block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16,
                     num_kv_blocks=48)
BLOCKS_PER_HANDLE = 8

SAMPLING = {
    0: WorkerSamplingParams(SamplingParams(), seed=0),
    1: WorkerSamplingParams(SamplingParams(temperature=0.8, top_k=5, top_p=0.9), seed=7),
    2: WorkerSamplingParams(SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2,
                                           presence_penalty=0.1, frequency_penalty=0.1), seed=3),
    3: WorkerSamplingParams(SamplingParams(), seed=0, min_tokens=3, stop_ids=(5, 9, 11)),
    4: WorkerSamplingParams(SamplingParams(temperature=0.7, top_k=3), seed=11),
    5: WorkerSamplingParams(SamplingParams(), seed=0),
}
PROMPT_LENS = {0: 10, 1: 6, 2: 3, 3: 2, 4: 12, 5: 3}


def _new(handle: int, num_logprobs: int = 0) -> NewRequestData:
    prompt = [(7 * handle + 3 * i + 1) % 97 + 2 for i in range(PROMPT_LENS[handle])]
    blocks = list(range(handle * BLOCKS_PER_HANDLE, (handle + 1) * BLOCKS_PER_HANDLE))
    return NewRequestData(handle, prompt, SAMPLING[handle], blocks, 0, num_logprobs)


def scenario_diffs() -> list[SchedulerOutput]:
    """The diffs of the table above, steps 0..14."""
    diffs = [
        SchedulerOutput(0, new_requests=[_new(0, num_logprobs=2), _new(1)],
                        num_scheduled_tokens={0: 10, 1: 6}),
        SchedulerOutput(1),
        SchedulerOutput(2, new_requests=[_new(2), _new(3)], num_scheduled_tokens={2: 3, 3: 2}),
        SchedulerOutput(3), SchedulerOutput(4), SchedulerOutput(5),
        SchedulerOutput(6, finished_handles=[0], new_requests=[_new(4)],
                        num_scheduled_tokens={4: 8, 1: 0, 2: 0, 3: 0}),
        SchedulerOutput(7, num_scheduled_tokens={4: 4}),
        SchedulerOutput(8), SchedulerOutput(9),
        SchedulerOutput(10, finished_handles=[1], new_requests=[_new(5)],
                        num_scheduled_tokens={5: 1}),
        SchedulerOutput(11), SchedulerOutput(12), SchedulerOutput(13),
        SchedulerOutput(14, finished_handles=[2]),
    ]
    return diffs


# Steps whose every scheduled row has one query token (what a decode CUDA graph may run).
PURE_DECODE_STEPS = (1, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14)
NUM_STEPS = 15
