"""Two nodes, one rank each: node 1's rank is killed while node 0's rank cannot answer (it is
stopped, as a rank waits in an NCCL collective for a peer that died: until --dist-timeout).

Node 1's worker fails its Step stream at once, naming the killed rank; the step must fail then,
not once node 0's step times out. The client waited for node 0's reply first, and node 0's
service answered Health (only its rank is stuck), so the step counted as slow: up to 30 step
timeouts. Then a new Init interrupts node 0's stuck step, both nodes get fresh ranks and the
group serves again. Real worker services with spawned rank processes on loopback, gloo on CPU.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.errors import WorkerFailure
from tests.support.grpc_harness import wait_for
from tests.support.tp_harness import Cluster, make_core, reference, run_requests


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return tiny_models("qwen3")


def test_a_rank_killed_on_node_1_fails_the_step_while_node_0_is_stuck(tmp_path, model_dir):
    # Every timeout far beyond the test's waits: only node 1's news can end the step in time.
    cluster = Cluster.start(tmp_path, nodes=2, local_ranks=1, rank_step_timeout_s=600)
    client = cluster.client(init_timeout_s=120.0, step_timeout_s=600.0)
    stuck = None
    try:
        client.init(cluster.spec(model_dir))
        core = make_core(model_dir, client)
        core.add_request(Request("r0", [3, 14, 15, 92, 65], SamplingParams(seed=1),
                                 StoppingParams(max_tokens=40, ignore_eos=True)))
        core.step()
        (stuck,) = cluster.nodes[0].rank_pids()
        (victim,) = cluster.nodes[1].rank_pids()
        os.kill(stuck, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not client.health()[1].ready, 60, "node 1 to report its dead rank")

        outcome: list = []

        def step() -> None:
            try:
                core.step()
                outcome.append(None)
            except WorkerFailure as e:
                outcome.append(e)
        stepper = threading.Thread(target=step, daemon=True)
        stepper.start()
        stepper.join(120)
        assert outcome, f"the step still waits for node 0 although node 1 failed\n{cluster.logs()}"
        failure = outcome[0]
        assert isinstance(failure, WorkerFailure), failure
        message = str(failure)
        assert cluster.addresses[1] in message and "RANK_FAILED" in message, message
        assert f"pid {victim}" in message and "SIGKILL" in message, message

        # A new Init interrupts node 0's stuck step; both nodes get fresh ranks and serve.
        client.init(cluster.spec(model_dir))
        assert stuck not in cluster.nodes[0].rank_pids()
        assert all(h.ready for h in client.health())
        prompts = [[3, 14, 15, 92, 65], [7, 8, 9]]
        samplings = [SamplingParams(seed=5), SamplingParams(temperature=0.8, seed=6)]
        stoppings = [StoppingParams(max_tokens=6, ignore_eos=True)] * 2
        tokens = run_requests(make_core(model_dir, client), model_dir, prompts, samplings,
                              stoppings)
    finally:
        if stuck is not None:
            try:
                os.kill(stuck, signal.SIGCONT)
            except ProcessLookupError:
                pass
        client.close()
        cluster.close()
    assert tokens == reference(model_dir, prompts, samplings, stoppings)[0]
