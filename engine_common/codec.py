"""msgpack codec for the step payloads. No pickle: every field is a plain msgpack value.

Layouts (positional arrays keep steady-state messages tiny):

    SchedulerOutput = [step, [new...], [resumed...], {handle: [block ids]}, {handle: n},
                       [finished handles], [preempted handles]]
    new     = [handle, prompt ids (uint32 bytes), sampling (WorkerSamplingParams wire form),
               block ids, num_computed_tokens, num_logprobs]
    resumed = [handle, block ids, num_computed_tokens]

    RunnerOutput = [step, handles (uint32 bytes), sampled ids (uint32 bytes),
                    logprobs (float32 bytes), {handle: [ids bytes, logprobs bytes]}, digest]
"""
from __future__ import annotations

from array import array

import msgpack

from engine_common.diff import (NewRequestData, ResumedRequestData, RunnerOutput,
                                SchedulerOutput)
from engine_common.params import WorkerSamplingParams


class CodecError(ValueError):
    """A payload that does not decode to the expected layout."""


def _u32(values) -> bytes:
    return array("I", values).tobytes()


def _from_u32(data: bytes) -> list[int]:
    return array("I", data).tolist()


def _f32(values) -> bytes:
    return array("f", values).tobytes()


def _from_f32(data: bytes) -> list[float]:
    return array("f", data).tolist()


def encode_scheduler_output(out: SchedulerOutput) -> bytes:
    new = [[r.handle, _u32(r.prompt_token_ids), r.sampling.to_wire(), r.block_ids,
            r.num_computed_tokens, r.num_logprobs] for r in out.new_requests]
    resumed = [[r.handle, r.block_ids, r.num_computed_tokens] for r in out.resumed_requests]
    return msgpack.packb([out.step, new, resumed, out.new_block_ids, out.num_scheduled_tokens,
                          out.finished_handles, out.preempted_handles], use_bin_type=True)


def decode_scheduler_output(data: bytes) -> SchedulerOutput:
    try:
        step, new, resumed, new_blocks, num_sched, finished, preempted = msgpack.unpackb(
            data, raw=False, strict_map_key=False)
        return SchedulerOutput(
            step=step,
            new_requests=[NewRequestData(h, _from_u32(p), WorkerSamplingParams.from_wire(s), b, n, k)
                          for h, p, s, b, n, k in new],
            resumed_requests=[ResumedRequestData(h, b, n) for h, b, n in resumed],
            new_block_ids=new_blocks,
            num_scheduled_tokens=num_sched,
            finished_handles=finished,
            preempted_handles=preempted,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"malformed SchedulerOutput payload: {e}") from e


def encode_runner_output(out: RunnerOutput) -> bytes:
    top = {h: [_u32(ids), _f32(lps)] for h, (ids, lps) in out.top_logprobs.items()}
    return msgpack.packb([out.step, _u32(out.handles), _u32(out.sampled_token_ids),
                          _f32(out.logprobs), top, out.digest], use_bin_type=True)


def decode_runner_output(data: bytes) -> RunnerOutput:
    try:
        step, handles, ids, lps, top, digest = msgpack.unpackb(data, raw=False,
                                                               strict_map_key=False)
        return RunnerOutput(step, _from_u32(handles), _from_u32(ids), _from_f32(lps),
                            {h: (_from_u32(i), _from_f32(l)) for h, (i, l) in top.items()},
                            digest)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"malformed RunnerOutput payload: {e}") from e
