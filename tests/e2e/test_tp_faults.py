"""Tensor-parallel faults: a dead rank fails the step fast and the worker turns unready; symmetry
verification stays silent on a healthy mixed workload and reports a deliberately corrupted rank,
within a node (the worker compares its ranks) and across nodes (the client compares nodes).

Real worker services with spawned rank processes on loopback, gloo on CPU.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.security.stream_key import stream_key_metadata
from engine_common.wire.protos import WORKER_SERVICE, worker_pb2, worker_pb2_grpc
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.errors import WorkerFailure
from scheduler_service.core.request import Request
from scheduler_service.api.server import WorkerCoreFactory
from scheduler_service.api.status import status_for
from scheduler_service.workers.worker_client import SymmetryError
from tests.support.grpc_harness import health_status
from tests.support.tp_harness import Cluster, make_core, reference, run_requests, scheduler_config
from worker_service.ranks.rank_process import CORRUPT_RANK_ENV


def mixed_workload(n: int = 64, seed: int = 11):
    """n requests: shared and unique prefixes, greedy and several sampling settings (logit_bias
    among them), varied lengths and stop rules; every request names its seed."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    prompts, samplings, stoppings = [], [], []
    for i in range(n):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 24))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
        kind = i % 4
        samplings.append(
            SamplingParams(seed=i) if kind == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, seed=i) if kind == 1 else
            SamplingParams(temperature=1.2, top_k=20, min_p=0.05, repetition_penalty=1.2,
                           seed=i) if kind == 2 else
            SamplingParams(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.3, seed=i,
                           logit_bias={3 + i * 7 % 497: -100.0, 3 + i * 13 % 497: 5.0}))
        stoppings.append(StoppingParams(max_tokens=rng.randrange(1, 13), ignore_eos=i % 2 == 0,
                                        stop_token_ids=(rng.randrange(3, 500),)))
    return prompts, samplings, stoppings


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return tiny_models("qwen3")


def test_verify_symmetry_is_silent_on_a_mixed_workload(tp2, model_dir):
    work = mixed_workload()
    client = tp2.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        client.init(tp2.spec(model_dir, verify_symmetry=True))
        tokens = run_requests(make_core(model_dir, client), model_dir, *work)
        # Reset (a new epoch) reaches every rank: it drops the requests they hold. (The first
        # may find the last finished one: finished handles ride on the next diff.)
        client.reset()
        core = make_core(model_dir, client)
        for i in range(3):
            core.add_request(Request(f"x{i}", work[0][i], work[1][i], StoppingParams()))
        core.step()
        assert client.reset() == 3
    finally:
        client.close()
    assert tokens == reference(model_dir, *work)[0]
    assert sum(map(len, tokens)) > 64


def test_killed_rank_fails_the_step_fast_and_worker_turns_unready(tp2, model_dir):
    prompts, samplings, stoppings = mixed_workload(8)
    client = tp2.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        client.init(tp2.spec(model_dir))
        # Same model, new epoch: both ranks kept their weights (one load each in all).
        assert tp2.nodes[0].err_path.read_text().count("loaded model ") == 2
        core = make_core(model_dir, client)
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"r{i}", prompt, samplings[i],
                                     StoppingParams(max_tokens=50, ignore_eos=True)))
        core.step()
        core.step()
        victim = tp2.nodes[0].rank_pids()[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerFailure) as failure:
            for _ in range(20):
                core.step()
        # Fast: the rank's death failed the step, not the 60 s step timeout ("no reply to step
        # N in time", kind step_timeout).
        assert failure.value.kind == "rank_failed", failure.value
        message = str(failure.value)
        assert "RANK_FAILED" in message and f"pid {victim}" in message, message
        assert "SIGKILL" in message
        # The stream itself ends with UNAVAILABLE, naming the rank, for anyone who steps on.
        # (Anyone: with the epoch's stream key, which only the scheduler holds.)
        code, status, details = _raw_step(tp2.addresses[0], client.epoch, step=3,
                                          key=client._stream_keys[0])
        assert code == worker_pb2.StepError.RANK_FAILED
        assert status == grpc.StatusCode.UNAVAILABLE and f"pid {victim}" in details

        (health,) = client.health()
        assert not health.ready and f"pid {victim}" in health.reason
        assert health_status(tp2.addresses[0], WORKER_SERVICE) == "NOT_SERVING"
        # The other rank was stopped too; a new Init spawns a fresh pair that serves again.
        assert tp2.nodes[0].rank_pids() == []
        client.init(tp2.spec(model_dir))
        assert len(tp2.nodes[0].rank_pids()) == 2
        assert health_status(tp2.addresses[0], WORKER_SERVICE) == "SERVING"
        tokens = run_requests(make_core(model_dir, client), model_dir, prompts, samplings,
                              stoppings)
    finally:
        client.close()
    assert tokens == reference(model_dir, prompts, samplings, stoppings)[0]


def test_corrupted_rank_is_detected_within_a_node(tmp_path, model_dir):
    cluster = Cluster.start(tmp_path, nodes=1, local_ranks=2,
                            env_by_node={0: {CORRUPT_RANK_ENV: "1"}})
    client = cluster.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        client.init(cluster.spec(model_dir, verify_symmetry=True))
        pids = cluster.nodes[0].rank_pids()
        with pytest.raises(SymmetryError, match=r"SYMMETRY_DIVERGENCE.*rank 0: \w+, rank 1: \w+"):
            run_requests(make_core(model_dir, client), model_dir, *mixed_workload(4))
        (health,) = client.health()
        assert not health.ready and "out of step" in health.reason
        # The diverged ranks are not reused: the next Init spawns new ones.
        client.init(cluster.spec(model_dir, verify_symmetry=True))
        assert set(cluster.nodes[0].rank_pids()).isdisjoint(pids)
    finally:
        client.close()
        cluster.close()


def test_corrupted_node_is_detected_across_nodes_and_fails_requests(tmp_path, model_dir):
    """Node 1's only rank diverges; each node is self-consistent, so the client's comparison of
    the nodes' digests catches it. Through AsyncEngine every open request then fails with
    UNAVAILABLE naming the divergence, and the engine re-initializes (a new epoch). A request
    whose add reached the engine thread after that step began (the six are sent at once; under
    load some arrive a turn late) is refused UNAVAILABLE with the same reason (`no worker is
    ready: symmetry divergence ...`) while the engine re-initializes, or fails with the new
    epoch's divergence: either way UNAVAILABLE naming it, and none completes."""
    cluster = Cluster.start(tmp_path, nodes=2, local_ranks=1,
                            env_by_node={1: {CORRUPT_RANK_ENV: "1"}})
    client = cluster.client(init_timeout_s=120.0, step_timeout_s=60.0)
    spec = cluster.spec(model_dir, verify_symmetry=True)
    engine = AsyncEngine(WorkerCoreFactory(client, spec, scheduler_config()),
                         lambda: OutputProcessor(Tokenizer.from_dir(model_dir)))
    try:
        engine.start()
        errors = asyncio.run(_generate_all(engine, model_dir, *mixed_workload(6)))
        assert any(isinstance(e, SymmetryError) for e in errors), errors
        for error in errors:
            assert error is not None, errors          # no request completes on a diverged node
            code, message = status_for(error)
            assert code.name == "UNAVAILABLE", errors
            assert "symmetry divergence" in message and "nodes disagree" in message, message
    finally:
        engine.shutdown()
        client.close()
        cluster.close()


def _raw_step(address: str, epoch: int, step: int, key: bytes):
    """One StepRequest on a fresh stream with the epoch's `key`: (StepError code, stream
    status, status details)."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        responses = []
        try:
            for r in stub.Step(iter([worker_pb2.StepRequest(epoch=epoch, step=step)]),
                               timeout=10, metadata=stream_key_metadata(key)):
                responses.append(r)
        except grpc.RpcError as e:
            return responses[-1].error.code, e.code(), e.details()
    raise AssertionError(f"the stream ended without a status: {responses}")


async def _generate_all(engine: AsyncEngine, model_dir: str, prompts, samplings, stoppings):
    """Run every request through the engine at once; each one's exception (or None)."""
    from engine_common.model_files.model_dir import ModelInfo

    eos = ModelInfo.from_dir(model_dir).eos_token_ids
    assert await asyncio.to_thread(engine.wait_ready, 120), engine.last_error

    async def one(i: int):
        request = Request(f"a{i}", prompts[i], samplings[i], stoppings[i], eos)
        try:
            async for _ in engine.generate(request):
                pass
        except Exception as e:  # what the Generate servicer would turn into a status
            return e
        return None

    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), 120)
