"""What one VllmEngine Generate call's engine outputs become (vllm_servicer.py): the messages of
each choice, a non-streamed choice's accumulated output, when building them moves off the event
loop, and the merge of an n > 1 call's streams in arrival order."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine_common.wire.protos import vllm_engine_pb2 as pb
from scheduler_service.api.convert import OFF_LOOP_TOKENS
from scheduler_service.api.front_door import ValidatedRequest
from scheduler_service.api.vllm_convert import (chunk_to_proto, complete_to_proto,
                                                input_logprobs_to_proto)
from scheduler_service.engine.output_processor import RequestOutput, TokenLogprob


class Choice:
    """What one choice of a non-streamed request produced so far."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs = None       # its prompt logprobs, once they came


def messages(inp: ValidatedRequest, index: int, out: RequestOutput, choice: Choice,
              eos_token_id: int | None, prompt_ids: list[int]) -> list[pb.GenerateResponse]:
    """The messages one engine output of choice `index` turns into (`eos_token_id`: see
    complete_to_proto). Prompt logprobs, as vLLM's servicer sends them: streaming, on the
    first chunk (and on the complete of an output that carries them); not, on the complete."""
    k = inp.num_prompt_logprobs or 0
    if inp.stream:
        msgs = [chunk_to_proto(out, index, inp.num_logprobs, prompt_ids, k)
                ] if out.new_token_ids else []
        if out.finished:
            msgs.append(complete_to_proto(out, index, inp.num_logprobs, out.new_token_ids,
                                          out.logprobs, eos_token_id,
                                          input_logprobs(out.prompt_logprobs, prompt_ids, k)))
        return msgs
    choice.token_ids.extend(out.new_token_ids)
    choice.logprobs.extend(out.logprobs)
    choice.prompt_logprobs = choice.prompt_logprobs or out.prompt_logprobs
    if not out.finished:
        return []
    return [complete_to_proto(out, index, inp.num_logprobs, choice.token_ids, choice.logprobs,
                              eos_token_id, input_logprobs(choice.prompt_logprobs, prompt_ids,
                                                            k))]


def choice_builds_off_loop(inp: ValidatedRequest, out: RequestOutput, choice: Choice) -> bool:
    """Prompt logprobs, the tokens of many steps (a lagging consumer), or a non-streamed
    choice's whole output at its finish (20,000 tokens at 20 logprobs: ~0.15 s of CPU): the
    tokens before this output (messages() adds its own only as it builds) and its own."""
    return (inp.num_prompt_logprobs is not None or len(out.new_token_ids) > OFF_LOOP_TOKENS
            or (out.finished and not inp.stream
                and len(choice.token_ids) + len(out.new_token_ids) > OFF_LOOP_TOKENS))


def input_logprobs(entries, prompt_ids: list[int], k: int):
    return None if not entries else input_logprobs_to_proto(entries, prompt_ids, k)


async def merge(streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output) in arrival order. The first
    failure ends the merge; leaving it early (cancellation) closes every stream, which aborts
    their requests."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:   # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

