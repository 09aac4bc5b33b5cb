"""VllmEngine Generate is counted in the Prometheus request counters as deltaserve.v1's Generate
is: docs/metrics.md's `requests_received = requests_rejected + request_success + (in flight)`
holds for the calls the Shepherd Model Gateway (the OpenAI API of `deltaserve serve`) makes.
Before, only deltaserve.v1 Generate calls were received or rejected, so behind the gateway
`requests_received_total` stayed 0 while `request_success_total` grew, and a refused OpenAI
request was counted nowhere. A call with n choices stands for n requests (each finishes on its
own in `request_success_total`)."""
from __future__ import annotations

import grpc
import pytest

from tests.support.vllm_sim import generate, rpc_code, wait_until


# `server` and `stub`: conftest.py (a fresh SimServer per test)


def _balance(server) -> tuple[int, int, int]:
    s = server.engine.counters.snapshot()
    return s.received, sum(s.rejected.values()), sum(s.finished.values())


def test_served_refused_and_n_choice_calls_keep_the_documented_balance(server, stub):
    before = server.engine.counters.snapshot()
    (one,) = stub.Generate(generate(request_id="one", max_tokens=3), timeout=10)
    assert one.complete.completion_tokens == 3
    streamed = list(stub.Generate(generate(request_id="many", stream=True, n=3, max_tokens=2,
                                           ignore_eos=True), timeout=10))
    assert sorted(m.complete.index for m in streamed if m.HasField("complete")) == [0, 1, 2]
    code, _ = rpc_code(lambda: stub.Generate(generate(request_id="bad", top_p=7.0), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    wait_until(lambda: _balance(server)[2] - sum(before.finished.values()) == 4,
               "the four finished requests counted")
    after = server.engine.counters.snapshot()
    assert after.received - before.received == 1 + 3 + 1
    assert after.rejected.get("INVALID_ARGUMENT", 0) - before.rejected.get(
        "INVALID_ARGUMENT", 0) == 1
    received, rejected, finished = _balance(server)
    assert received == rejected + finished          # nothing in flight
