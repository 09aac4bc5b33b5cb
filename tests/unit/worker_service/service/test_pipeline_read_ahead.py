"""A pipelined Step stream reads at most MAX_READ_AHEAD requests ahead of the step it runs.

Its reader thread moved every request into the handler's queue as it arrived, which undid gRPC's
flow control: one stream (a token holder's, or a scheduler gone wrong) could park any number of
messages of up to --max-message-mib each in the worker's memory behind one running step. The
non-pipelined stream reads one request at a time. A fake node worker whose first step runs until
the test lets it finish."""
from __future__ import annotations

import threading

from engine_common.wire.protos import worker_pb2
from worker_service.service.step_pipeline import MAX_READ_AHEAD, pipelined_steps

NUM_REQUESTS = 64


class SlowFirstStep:
    """launch_step of step 0 waits for `go`; every step is finished at once (nothing held)."""

    def __init__(self):
        self.go = threading.Event()
        self.running = threading.Event()
        self.launched: list[int] = []

    def launch_step(self, stream_id, epoch, step, payload, digest):
        self.running.set()
        if step == 0:
            assert self.go.wait(60), "the test never let step 0 finish"
        self.launched.append(step)
        return []

    def held_step(self, stream_id):
        return None

    def flush(self, stream_id):
        return []


def test_the_reader_stays_a_few_requests_ahead_of_a_running_step():
    worker = SlowFirstStep()
    read_past_the_bound = threading.Event()

    def requests():
        for i in range(NUM_REQUESTS):
            # Step 0 is being launched and MAX_READ_AHEAD more may wait: index
            # MAX_READ_AHEAD + 1 is one too many while step 0 runs.
            if i > MAX_READ_AHEAD and not worker.go.is_set():
                read_past_the_bound.set()
            yield worker_pb2.StepRequest(epoch=1, step=i, payload=b"diff")

    def refuse(epoch, step, error):
        raise AssertionError(f"step {step} refused: {error}")
        yield

    handler = threading.Thread(target=lambda: list(pipelined_steps(worker, 1, requests(),
                                                                   refuse)), daemon=True)
    handler.start()
    assert worker.running.wait(60)
    # A bounded wait for what must not happen (the unbounded reader read all 64 in well
    # under a millisecond); it can only pass wrongly, never fail wrongly, on a slow machine.
    assert not read_past_the_bound.wait(2.0), "the reader ran ahead of the running step"
    worker.go.set()
    handler.join(60)
    assert not handler.is_alive()
    assert worker.launched == list(range(NUM_REQUESTS))
