"""The helpers of the VllmEngine servicer tests (tests/unit/scheduler_service/api/
test_vllm_servicer*.py): the prompt they share, a request builder, a wait and a call's status."""
from __future__ import annotations

import time

import grpc

from engine_common.wire.protos import vllm_engine_pb2 as pb

PROMPT = list(range(10, 23))     # 13 tokens: 3 full blocks of 4


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    """Polled, every 10 ms: the conditions are the server's loop-side state (a log line, a
    subscription, a hub's queues) or the engine's while a step is held, with no event to wait
    on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def generate(prompt=PROMPT, stream=False, request_id="r", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=pb.SamplingParams(**sampling), stream=stream)


def stored_blocks(batches) -> list[tuple[int, list[int]]]:
    return [(b.block_hash, list(b.token_ids)) for batch in list(batches) for e in batch.events
            if e.HasField("stored") for b in e.stored.blocks]


def rpc_code(call) -> tuple[grpc.StatusCode, str]:
    """(status code, details) of the call, OK when it succeeds (a stream read to its end)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""
