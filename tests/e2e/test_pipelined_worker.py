"""A worker whose steps are pipelined (step t+1 launched before step t is finished:
service/step_pipeline.py), over real processes: a worker on the simulated device (its launches
are asynchronous, as on CUDA) behind a scheduler with and without async scheduling.

The simulated device's token at position p is (7 p + 3) mod the vocabulary, so every stream's
ids say whether each step's reply reached the right request in the right order. Cancelled
streams must leave the others whole and free their blocks.
"""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (free_port, generation_stub, greedy_request,
                                        scheduler_and_worker, server_status, wait_for,
                                        wait_stopped)
from tests.support.metrics_scrape import scrape


@pytest.fixture(scope="module", params=["async", "sync"])
def served(request, tiny_models, tmp_path_factory):
    model = tiny_models("qwen3")
    flags = ["--async-scheduling"] if request.param == "async" else []
    metrics = free_port()
    # --step-timeout: a worker stopped on purpose (SIGSTOP, below) is not declared stuck
    with scheduler_and_worker(model, tmp_path_factory.mktemp(f"pipelined_{request.param}"),
                              [*flags, "--max-model-len", "256", "--max-num-seqs", "4",
                               "--max-num-batched-tokens", "32", "--kv-cache-gib", "0.0002",
                               "--metrics-listen", f"127.0.0.1:{metrics}",
                               "--step-timeout", "120"],
                              ["--simulated-device-ms", "1"]) as (target, (worker, sched)):
        yield target, ModelInfo.from_dir(model).vocab_size, metrics, request.param, worker
        assert "pipelined" in worker.log_tail(20000), worker.log_tail()
        # Async scheduling to a worker that pipelines: three steps in flight (engine_core.py).
        assert ("they pipeline their steps (3 in flight)" in sched.log_tail(20000)) == (
            request.param == "async"), sched.log_tail()


def _expected(prompt_len: int, max_tokens: int, vocab: int) -> list[int]:
    return [(7 * p + 3) % vocab for p in range(prompt_len, prompt_len + max_tokens)]


async def _streams(target: str, reqs, cancel_after: dict[int, int]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_stub(channel)

        async def one(i: int, req) -> list[int]:
            ids, call = [], stub.Generate(req, timeout=120)
            try:
                async for msg in call:
                    ids.extend(msg.token_ids)
                    if len(ids) >= cancel_after.get(i, 1 << 30):
                        call.cancel()
            except asyncio.CancelledError:
                pass
            return ids
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))


def _idle(target: str) -> bool:
    s = server_status(target)
    return s.num_used_kv_blocks == 0 and s.num_running == 0 and s.num_waiting == 0


def test_server_status_says_how_many_steps_may_be_in_flight(served):
    """GetServerStatus over gRPC: the engine's depth, 3 to workers that pipeline their steps
    with async scheduling (1 without it: each step is collected before the next), and the
    steps in flight now (none once idle)."""
    target, _, _, mode, _ = served
    status = server_status(target)
    assert status.max_steps_in_flight == (3 if mode == "async" else 1), status
    wait_for(lambda: server_status(target).num_steps_in_flight == 0, 30, "no step in flight")


def test_status_counts_the_steps_in_flight_to_a_stopped_worker(served):
    """Decoding one request, the worker stopped (SIGSTOP): the engine blocks collecting the
    oldest step, and the last snapshot it published, after a turn that sent the next one,
    holds them all: GetServerStatus and the gauge say 3 with async scheduling (0 without:
    each step is collected before the next is sent). Sampling while it ran depended on how
    the machine's cores were shared. The stream then ends whole."""
    target, vocab, metrics, mode, worker = served
    want = 3 if mode == "async" else 0
    with grpc.insecure_channel(target) as channel:
        stream = generation_stub(channel).Generate(greedy_request([9] * 6, 150), timeout=120)
        ids = []
        while len(ids) < 8:
            ids.extend(next(stream).token_ids)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            wait_stopped(worker.pid)
            wait_for(lambda: (server_status(target).num_steps_in_flight,
                              scrape(metrics).total("deltaserve:steps_in_flight"))
                     == (want, want), 60, f"{want} steps in flight")
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        for msg in stream:
            ids.extend(msg.token_ids)
    assert ids == _expected(6, 150, vocab)
    wait_for(lambda: _idle(target), 30, "the blocks back in the pool")


def test_a_worker_that_does_not_pipeline_gets_two(tiny_models, tmp_path):
    """The same server with async scheduling in front of a plain CPU worker (its steps run one
    after another: its Init says it does not pipeline): GetServerStatus reports 2."""
    with scheduler_and_worker(tiny_models("qwen3"), tmp_path,
                              ["--async-scheduling", "--max-model-len", "256",
                               "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
                              ) as (target, (_, sched)):
        assert server_status(target).max_steps_in_flight == 2
        assert "workers initialized" in sched.log_tail(20000), sched.log_tail()
        assert "they pipeline their steps" not in sched.log_tail(20000), sched.log_tail()


def test_every_stream_gets_its_own_tokens_in_order(served):
    target, vocab, *_ = served
    shapes = [(3, 9), (17, 4), (40, 12), (5, 1), (23, 20), (8, 7)]   # more than max_num_seqs
    reqs = [greedy_request([5 + (i + j) % 90 for j in range(n)], m, f"p{i}")
            for i, (n, m) in enumerate(shapes)]
    got = asyncio.run(_streams(target, reqs, {}))
    assert got == [_expected(n, m, vocab) for n, m in shapes]
    wait_for(lambda: _idle(target), 30, "the blocks back in the pool")


def test_a_stop_token_ends_a_stream_with_steps_in_flight_past_it(served):
    """A stop token id met while the next steps are already scheduled (two of them with three
    in flight): the stream ends on it, the steps past it are dropped, and the others run on."""
    target, vocab, *_ = served
    prompt = [11 + j for j in range(10)]
    stop_at = _expected(len(prompt), 30, vocab)
    stopper = greedy_request(prompt, 30, "stopper")
    stopper.stopping.stop_token_ids.append(stop_at[5])
    others = [greedy_request([20 + i] * (4 + i), 12, f"o{i}") for i in range(3)]

    async def run():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_stub(channel)

            async def one(req):
                return [m async for m in stub.Generate(req, timeout=120)]
            return await asyncio.gather(*(one(r) for r in [stopper, *others]))
    msgs = asyncio.run(run())
    assert [t for m in msgs[0] for t in m.token_ids] == stop_at[:stop_at.index(stop_at[5]) + 1]
    assert msgs[0][-1].finish_reason == pb.STOP_TOKEN
    assert msgs[0][-1].stop_token_id == stop_at[5]
    for i, got in enumerate(msgs[1:]):
        assert [t for m in got for t in m.token_ids] == _expected(4 + i, 12, vocab)
    wait_for(lambda: _idle(target), 30, "the blocks back in the pool")


def test_cancelled_streams_leave_the_others_whole(served):
    target, vocab, *_ = served
    reqs = [greedy_request([9 + i] * (6 + i), 16, f"c{i}") for i in range(4)]
    got = asyncio.run(_streams(target, reqs, {0: 2, 2: 5}))
    for i in (1, 3):
        assert got[i] == _expected(6 + i, 16, vocab)
    assert len(got[0]) < 16 and len(got[2]) < 16
    wait_for(lambda: _idle(target), 30, "the cancelled streams' blocks back in the pool")


def test_preemption_with_steps_in_flight_keeps_every_stream_whole(served):
    """More than the KV cache holds, so requests are preempted while the steps in flight (two
    past the one collected, with three) still hold pending tokens for them: each resumes on the
    worker's tokens and every stream still reads (7p + 3) mod vocab; every block comes back.
    While they run, the steps_in_flight gauge and GetServerStatus never pass the depth (3
    async, 1 sync; that they reach 3: test_status_counts_the_steps_in_flight_to_a_stopped_worker)."""
    target, vocab, metrics, mode, _ = served
    blocks = server_status(target).num_kv_blocks
    before = scrape(metrics).total("deltaserve:num_preemptions_total")
    # Four requests (max_num_seqs) that each grow to more than half the cache (16-token blocks).
    length = min(250, blocks * 16 // 2 + 16)
    shapes = [(6 + 3 * i, length - 6 - 3 * i) for i in range(4)]
    reqs = [greedy_request([40 + (i + j) % 50 for j in range(n)], m, f"pre{i}")
            for i, (n, m) in enumerate(shapes)]
    depths, reported = [], []

    async def run():
        streams = asyncio.ensure_future(_streams(target, reqs, {}))
        while not streams.done():     # the gauge, and GetServerStatus, while they run
            depths.append(scrape(metrics).total("deltaserve:steps_in_flight"))
            reported.append(server_status(target).num_steps_in_flight)
            await asyncio.wait([streams], timeout=0.05)
        return streams.result()
    got = asyncio.run(run())
    assert got == [_expected(n, m, vocab) for n, m in shapes]
    assert scrape(metrics).total("deltaserve:num_preemptions_total") > before, (blocks, length)
    assert max(depths) <= (3 if mode == "async" else 1), depths
    assert max(reported) <= (3 if mode == "async" else 1), reported
    wait_for(lambda: _idle(target), 30, "the blocks back in the pool")


def test_abort_mid_stream_ends_that_stream_and_frees_its_blocks(served):
    """The Abort RPC while steps for the request are in flight: its stream ends ABORT with the
    tokens so far (a prefix of its own), the others run whole, and its blocks come back."""
    target, vocab, *_ = served
    victim = greedy_request([30 + j for j in range(12)], 200, "victim")
    others = [greedy_request([21 + i] * (5 + i), 24, f"a{i}") for i in range(2)]

    async def run():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_stub(channel)

            async def one(req, abort_after=None):
                msgs = []
                async for m in stub.Generate(req, timeout=120):
                    msgs.append(m)
                    if abort_after and sum(len(x.token_ids) for x in msgs) >= abort_after:
                        reply = await stub.Abort(pb.AbortRequest(request_ids=[req.request_id]))
                        assert reply.num_aborted == 1
                        abort_after = None
                return msgs
            return await asyncio.gather(one(victim, 6), *(one(r) for r in others))
    msgs = asyncio.run(run())
    ids = [t for m in msgs[0] for t in m.token_ids]
    assert 6 <= len(ids) < 200 and ids == _expected(12, len(ids), vocab)
    assert msgs[0][-1].finish_reason == pb.ABORT
    for i, got in enumerate(msgs[1:]):
        assert [t for m in got for t in m.token_ids] == _expected(5 + i, 24, vocab)
    wait_for(lambda: _idle(target), 30, "the aborted stream's blocks back in the pool")
