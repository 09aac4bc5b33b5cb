"""The helpers of the VllmEngine servicer tests (tests/unit/scheduler_service/api/
test_vllm_servicer*.py): the prompt they share, a request builder, the waits and a call's
status."""
from __future__ import annotations

import logging
import threading
import time

import grpc

from engine_common.wire.protos import vllm_engine_pb2 as pb

PROMPT = list(range(10, 23))     # 13 tokens: 3 full blocks of 4


class Recorded:
    """What another thread of the test records (a stream's messages, calls that reached the
    engine, log lines), with a wait that wakes on each record instead of polling."""

    def __init__(self):
        self.items: list = []
        self._changed = threading.Condition()

    def append(self, item) -> None:
        with self._changed:
            self.items.append(item)
            self._changed.notify_all()

    def __iter__(self):
        with self._changed:
            return iter(list(self.items))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def wait_for(self, predicate, what: str, timeout: float = 10.0) -> None:
        """Until predicate(the items so far) holds; AssertionError naming `what` if it never
        does within `timeout` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(list(self.items)), timeout):
                raise AssertionError(f"timed out waiting for {what}")


class LogLines(logging.Handler):
    """The messages a logger emits while attached (`with LogLines(name) as lines:`), Recorded."""

    def __init__(self, logger_name: str):
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(logger_name)
        self.lines = Recorded()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Recorded:
        self.logger.addHandler(self)
        return self.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    """Polled, every 10 ms, for the server's state that has no event to wait on (the engine's
    counts while a step is held, a hub's queues, health); what the test's own
    threads record is waited on with Recorded."""
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
