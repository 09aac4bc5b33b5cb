"""Three steps in flight (workers that pipeline their steps): a request preempted while its
in-flight tokens already reach its max_tokens is done, not waiting: it must not be resumed (a
prefill of its whole sequence, blocks taken, for tokens it will never sample) before those
tokens arrive and end it. With two in flight this cannot happen: the step after a preemption
is scheduled after the victim's one pending token came back. The real scheduler and SimWorker,
each step run as it is scheduled and collected three steps later."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from scheduler_service.core.request import RequestStatus
from tests.support.kv_invariants import check_kv_invariants
from tests.support.scheduler_sim import assert_no_leak, default_sample, make, make_request


def _alone(request) -> list[int]:
    """The tokens SimWorker samples for the request run alone (default_sample: no eos)."""
    tokens = list(request.prompt_token_ids)
    for _ in range(request.stopping.max_tokens):
        tokens.append(default_sample(SimpleNamespace(seed=request.sampling.seed,
                                                     tokens=tokens)))
    return tokens[len(request.prompt_token_ids):]


class ThreeInFlight:
    def __init__(self, **cfg):
        self.sched, self.worker = make(async_scheduling=True, **cfg)
        self.in_flight: deque = deque()
        self.outs = []
        self.finished = {}

    def step(self) -> None:
        """Schedule one step; collect the oldest once three are in flight (engine_core.py)."""
        out = self.sched.schedule()
        self.outs.append(out)
        self.in_flight.append((out, self.worker.execute(out)))
        if len(self.in_flight) >= 3:
            self.collect()

    def collect(self) -> None:
        out, result = self.in_flight.popleft()
        for update in self.sched.update_from_output(out, result):
            if update.finished:
                self.finished[update.request.request_id] = update.request
        check_kv_invariants(self.sched)


def test_a_victim_whose_tokens_in_flight_end_it_is_not_resumed():
    run = ThreeInFlight(num_blocks=16, max_num_seqs=1)
    a = make_request("a", range(10, 17), max_tokens=3, priority=1)
    run.sched.add_request(a)
    for _ in range(3):      # its prefill and two decodes; the prefill's token is collected
        run.step()
    assert a.num_output_tokens == 1 and a.num_pending_tokens == 2   # its last is in flight
    # A more urgent request takes the one seat: `a` is preempted with its two tokens in flight.
    run.sched.add_request(make_request("b", range(20, 25), max_tokens=8, priority=0))
    run.step()
    assert run.outs[-1].preempted_handles == [a.handle]
    assert a.status == RequestStatus.PREEMPTED and a.num_pending_tokens == 1
    run.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)    # the seat is free again
    while run.sched.has_unfinished_requests():
        run.step()
    while run.in_flight:
        run.collect()
    # `a` ended on the tokens in flight: never resumed, never prefilled twice.
    assert all(res.handle != a.handle for out in run.outs for res in out.resumed_requests)
    assert run.finished["a"].status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == _alone(a)
    assert_no_leak(run.sched)
