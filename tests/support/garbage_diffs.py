"""Garbage step payloads an attacker (or a buggy scheduler) could send a worker, one per kind.

Each case is a few valid payloads that build some state (steps 0, 1, ...) and then the garbage
one, which the worker must refuse with StepError BAD_PAYLOAD (status INVALID_ARGUMENT or
FAILED_PRECONDITION): never INTERNAL, never UNKNOWN, never a crash. The cases are built for the
runner's limits (`Limits`), so "one past the end" is exact.

Valid state used by the preambles: handle 0 with a 6-token prompt and 4 blocks (block_size 4),
prefilled at step 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import msgpack

from engine_common.wire.codec import encode_scheduler_output
from engine_common.constraints.constraint import Constraint
from engine_common.request.diff_limits import max_cached_requests, max_diff_bytes
from engine_common.wire.diff import NewRequestData, ResumedRequestData, SchedulerOutput
from engine_common.request.params import SamplingParams, WorkerSamplingParams
from engine_common.wire.protos import generation_pb2
from tests.support.deep_constraints import json_items_chain, lark_chain


@dataclass(frozen=True)
class Limits:
    num_kv_blocks: int
    vocab_size: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def max_blocks(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class Case:
    name: str
    payloads: list[bytes]        # all but the last are valid; the last is the garbage

    @property
    def garbage(self) -> bytes:
        return self.payloads[-1]


GREEDY = WorkerSamplingParams(SamplingParams(), seed=0)
PROMPT = [3, 14, 15, 92, 65, 35]


def new(handle: int = 0, prompt=PROMPT, blocks=(0, 1, 2, 3), computed: int = 0,
        sampling: WorkerSamplingParams = GREEDY, logprobs: int = 0,
        constraint: Constraint | None = None) -> NewRequestData:
    return NewRequestData(handle, list(prompt), sampling, list(blocks), computed, logprobs,
                          constraint)


def enc(diff: SchedulerOutput) -> bytes:
    return encode_scheduler_output(diff)


def raw(step, new_reqs=(), resumed=(), new_blocks=None, counts=None, finished=(),
        preempted=()) -> bytes:
    """A payload in the codec's layout with any values at all (no encoder checks)."""
    return msgpack.packb([step, new_reqs, resumed, new_blocks,
                          {} if counts is None else counts, finished, preempted],
                         use_bin_type=True)


def raw_new(handle=0, prompt=b"".join(i.to_bytes(4, "little") for i in PROMPT),
            sampling=([b"", 0, 0, []]), blocks=(0, 1), computed=0, logprobs=0,
            constraint=None) -> list:
    return [handle, prompt, sampling, list(blocks), computed, logprobs, constraint]


PREFILL = enc(SchedulerOutput(0, new_requests=[new()], num_scheduled_tokens={0: len(PROMPT)}))


def _undecodable(lim: Limits) -> dict[str, bytes]:
    deep = b"\x91" * 5000 + b"\xc0"
    return {
        "empty payload": b"",
        "not msgpack": b"\xc1 not msgpack",
        "an integer instead of the diff": msgpack.packb(7),
        "six parts instead of seven": msgpack.packb([0, [], [], {}, {}, []]),
        "step as a string": raw("zero"),
        "step as a 70,000-character string": raw("x" * 70_000),   # quoted whole (issue 23)
        "negative step": raw(-1),
        "new_requests as a map": raw(0, new_reqs={}),
        "new request of five fields": raw(0, [raw_new()[:5]]),
        "constraint of an unknown kind": raw(0, [raw_new(constraint=["python", "exec()"])]),
        "regex constraint not a string": raw(0, [raw_new(constraint=["regex", 5])]),
        "constraint not a [kind, value] pair": raw(0, [raw_new(constraint="junk")]),
        "prompt ids as a list": raw(0, [raw_new(prompt=list(PROMPT))]),
        "prompt bytes not a multiple of 4": raw(0, [raw_new(prompt=b"\x01\x02\x03")]),
        "sampling as a string": raw(0, [raw_new(sampling="greedy")]),
        "sampling as a map": raw(0, [raw_new(sampling=[{"temperature": 1.0}, 0, 0, []])]),
        "sampling not a message": raw(0, [raw_new(sampling=[b"\xff\xff", 0, 0, []])]),
        "unknown sampling field": raw(0, [raw_new(sampling=[b"\xf8\x06\x01", 0, 0, []])]),
        "temperature out of range": raw(0, [raw_new(sampling=[
            generation_pb2.SamplingParams(temperature=-1.0).SerializeToString(), 0, 0, []])]),
        "top_k below -1": raw(0, [raw_new(sampling=[
            generation_pb2.SamplingParams(top_k=-5).SerializeToString(), 0, 0, []])]),
        "block id as a string": raw(0, [raw_new(blocks=("0",))]),
        "new_block_ids as a list": raw(0, new_blocks=[1, 2]),
        "new_block_ids varints truncated": raw(0, new_blocks=b"\x01\x80"),
        "new_block_ids claiming 2**40 blocks": raw(0, new_blocks=b"\x01\x01\x80\x80\x80\x80"
                                                               b"\x80\x20\x00"),
        "negative token count": raw(0, counts={0: -5}),
        "finished handle as a bool": raw(0, finished=[True]),
        "arrays nested 5000 deep": deep,
    }


def _out_of_range(lim: Limits) -> dict[str, bytes]:
    top = lim.max_blocks
    seq = [new(h, blocks=range(4 * h, 4 * h + 4)) for h in range(lim.max_num_seqs + 1)]
    return {
        "handle beyond uint32": enc(SchedulerOutput(0, new_requests=[new(handle=2**40)])),
        "token id == vocab_size": enc(SchedulerOutput(0, new_requests=[
            new(prompt=[1, lim.vocab_size])])),
        "token id 2**32-1": enc(SchedulerOutput(0, new_requests=[new(prompt=[2**32 - 1])])),
        "block id == num_kv_blocks": enc(SchedulerOutput(0, new_requests=[
            new(blocks=[0, lim.num_kv_blocks])])),
        "block id 2**31 (int32 overflow)": enc(SchedulerOutput(0, new_requests=[
            new(blocks=[2**31])])),
        "more blocks than a request may hold": enc(SchedulerOutput(0, new_requests=[
            new(blocks=range(top + 1))])),
        "empty prompt": enc(SchedulerOutput(0, new_requests=[new(prompt=[])])),
        "prompt of max_model_len tokens": enc(SchedulerOutput(0, new_requests=[
            new(prompt=[5] * lim.max_model_len, blocks=range(top))])),
        "prefix hit beyond the prompt": enc(SchedulerOutput(0, new_requests=[
            new(computed=len(PROMPT) + 4)])),
        "a million logprobs": enc(SchedulerOutput(0, new_requests=[new(logprobs=10**6)])),
        "logprobs below NO_LOGPROBS": enc(SchedulerOutput(0, new_requests=[new(logprobs=-2)])),
        "seed beyond int64": enc(SchedulerOutput(0, new_requests=[
            new(sampling=WorkerSamplingParams(SamplingParams(), seed=2**64 - 1))])),
        "min_tokens beyond int32": enc(SchedulerOutput(0, new_requests=[
            new(sampling=WorkerSamplingParams(SamplingParams(), seed=0, min_tokens=2**40))])),
        "stop id beyond the vocabulary": enc(SchedulerOutput(0, new_requests=[
            new(sampling=WorkerSamplingParams(SamplingParams(), seed=0,
                                              stop_ids=(lim.vocab_size + 7,)))])),
        "token count 10**9": enc(SchedulerOutput(0, new_requests=[new()],
                                                 num_scheduled_tokens={0: 10**9})),
        "more tokens than max_num_batched_tokens": enc(SchedulerOutput(
            0, new_requests=[new(h, prompt=[7] * (lim.max_model_len - 1),
                                 blocks=range(top * h, top * (h + 1))) for h in range(2)],
            num_scheduled_tokens={0: lim.max_model_len - 1, 1: lim.max_model_len - 1})),
        "more requests than max_num_seqs": enc(SchedulerOutput(0, new_requests=seq)),
        # Compiling these overflowed llguidance's stack (SIGSEGV): refused by depth first.
        "grammar rules chained 3000 deep": enc(SchedulerOutput(0, new_requests=[
            new(constraint=Constraint("grammar", lark_chain(3000)))])),
        "json schema $refs chained 1200 deep": enc(SchedulerOutput(0, new_requests=[
            new(constraint=Constraint("json_schema", json_items_chain(1200)))])),
        # Counted before any handle is looked at (a handle check would say FAILED_PRECONDITION).
        "more preempted handles than max_num_seqs": raw(0, preempted=[0] * (lim.max_num_seqs + 1)),
        "more finished handles than any cache holds": raw(0, finished=[0] * (
            max_cached_requests(lim.max_num_seqs) + 1)),
        "payload beyond the largest legal diff": raw(0, finished=b"\0" * (1 + max_diff_bytes(
            lim.max_num_seqs, lim.max_num_batched_tokens, lim.max_model_len, lim.block_size))),
    }


def _bad_state(lim: Limits) -> dict[str, list[bytes]]:
    top = lim.max_blocks
    return {
        "finished handle unknown": [raw(0, finished=[9])],
        "preempted handle unknown": [raw(0, preempted=[9])],
        "resumed handle unknown": [enc(SchedulerOutput(0, resumed_requests=[
            ResumedRequestData(9, [0], 0)]))],
        "new blocks for an unknown handle": [enc(SchedulerOutput(0, new_block_ids={9: [1]}))],
        "token count for an unknown handle": [enc(SchedulerOutput(
            0, num_scheduled_tokens={9: 1}))],
        "wrong step number in the payload": [enc(SchedulerOutput(5))],
        "a cached handle added again": [PREFILL, enc(SchedulerOutput(1, new_requests=[new()]))],
        "resume of a running request": [PREFILL, enc(SchedulerOutput(1, resumed_requests=[
            ResumedRequestData(0, [0, 1, 2, 3], 0)]))],
        "new block id == num_kv_blocks": [PREFILL, enc(SchedulerOutput(
            1, new_block_ids={0: [lim.num_kv_blocks]}))],
        "blocks beyond a request's share": [PREFILL, enc(SchedulerOutput(
            1, new_block_ids={0: list(range(4, top + 1))}))],
        "tokens beyond the known ones": [PREFILL, enc(SchedulerOutput(
            1, num_scheduled_tokens={0: 40}))],
        "the same handle finished twice": [PREFILL, raw(1, finished=[0, 0])],
        # The step samples the token at index max_model_len: past the batch row's end (an
        # IndexError as the token was written, INTERNAL).
        "a decode past max_model_len": [
            enc(SchedulerOutput(0, new_requests=[new(prompt=[7] * (lim.max_model_len - 1),
                                                     blocks=range(top))],
                                num_scheduled_tokens={0: lim.max_model_len - 1})),
            enc(SchedulerOutput(1))],
        # A preempted request holds no row: finishing it frees none (it was counted as one:
        # the batch overflowed when the diff was applied, INTERNAL).
        "a full batch, a preempted request finished and one more added": _full_batch(lim) + [
            enc(SchedulerOutput(3, finished_handles=[lim.max_num_seqs - 1], new_requests=[
                new(lim.max_num_seqs + 1, blocks=_two_blocks(lim.max_num_seqs + 1))]))],
    }


def _two_blocks(handle: int) -> list[int]:
    return [2 * handle, 2 * handle + 1]


def _full_batch(lim: Limits) -> list[bytes]:
    """Steps 0-2: max_num_seqs requests, the last one preempted, another one added."""
    last = lim.max_num_seqs - 1
    return [enc(SchedulerOutput(0, new_requests=[new(h, blocks=_two_blocks(h))
                                                 for h in range(last + 1)])),
            enc(SchedulerOutput(1, preempted_handles=[last])),
            enc(SchedulerOutput(2, new_requests=[new(last + 1, blocks=_two_blocks(last + 1))]))]


def garbage_cases(lim: Limits) -> list[Case]:
    """Every kind, in a fixed order (at least 35)."""
    cases = [Case(name, [payload]) for name, payload in _undecodable(lim).items()]
    cases += [Case(name, [payload]) for name, payload in _out_of_range(lim).items()]
    cases += [Case(name, payloads) for name, payloads in _bad_state(lim).items()]
    return cases


def clean_run() -> list[bytes]:
    """A valid epoch after the garbage: prefill handle 0, then two decodes."""
    return [PREFILL, enc(SchedulerOutput(1)), enc(SchedulerOutput(2))]


RunStep = Callable[[bytes], bytes]
