"""PipelineTicket, RunnerPipeline's hand-off between the engine thread and the runner thread:
waits pass once (and every time after) the runner thread lets go; an error reaches result()."""
from __future__ import annotations

import threading

import pytest

from deltaserve.llm_executor import PipelineTicket

WAIT_S = 60.0       # only a hang hits this


def _waiter(call):
    """Run `call` on another thread; returns (thread, list that gets "passed" once it returns)."""
    passed: list[str] = []
    thread = threading.Thread(target=lambda: (call(), passed.append("passed")))
    thread.start()
    return thread, passed


def test_waits_block_until_let_go_then_always_pass():
    ticket = PipelineTicket(b"diff")
    assert not ticket.done()
    launched, launched_log = _waiter(ticket.wait_launched)
    result, result_log = _waiter(ticket.result)
    ticket.set_launched()
    launched.join(WAIT_S)
    assert launched_log == ["passed"] and result_log == [] and not ticket.done()
    ticket.set_result(b"reply")
    result.join(WAIT_S)
    assert result_log == ["passed"] and ticket.done()
    ticket.wait_launched()                       # again: a let-go lock stays passable
    assert ticket.result() == b"reply" and ticket.result() == b"reply"


def test_an_error_is_raised_by_result_every_time():
    ticket = PipelineTicket(b"diff")
    ticket.set_result(None, RuntimeError("step 3 failed"))
    ticket.set_launched()
    ticket.wait_launched()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="step 3 failed"):
            ticket.result()
