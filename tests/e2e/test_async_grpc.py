"""--async-scheduling over real processes: cancellations, Abort calls and stop strings while a
step is in flight, and a worker that stops answering mid-pipeline.

A cancelled or aborted stream must free its blocks and leave every other stream's tokens equal
to the same request alone; a stop string must cut the text without the token already computed
by the step in flight reaching the client (usage counts what was sent). When a step times out
with the next one already submitted, the open streams fail UNAVAILABLE and the engine's next
epoch starts clean: the same request gives the same tokens as before the fault.
"""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from engine_common.configuration.config import SchedulerConfig
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer, streamed_text
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.errors import EngineUnavailable
from scheduler_service.core.request import Request
from scheduler_service.api.server import WorkerCoreFactory
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.engine_streams import run_started, stream_ids
from tests.support.init_specs import init_spec
from tests.support.grpc_harness import (collect, free_port, generation_stub, greedy_request, pb,
                                        Processes, scheduler_and_worker, server_status, wait_for)


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    """A scheduler with two steps in flight that runs 4 requests at once in a small cache."""
    with scheduler_and_worker(tiny_models("qwen3"), tmp_path_factory.mktemp("async_grpc"),
                              ["--async-scheduling", "--max-model-len", "256",
                               "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                               "--kv-cache-gib", "0.0002"]) as (target, _):
        yield target


def _idle(target: str) -> bool:
    s = server_status(target)
    return s.num_used_kv_blocks == 0 and s.num_running == 0 and s.num_waiting == 0


async def _mixed_streams(target: str, reqs: list[pb.GenerateRequest]) -> list:
    """Stream i: a multiple of 3 is cancelled after 2 messages, one more is aborted by id after
    its first message, the rest run to the end. Returns (ids, messages, status code) each."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_stub(channel)

        async def one(i: int, req):
            ids, msgs = [], []
            call = stub.Generate(req, timeout=120)
            try:
                async for msg in call:
                    ids.extend(msg.token_ids)
                    msgs.append(msg)
                    if i % 3 == 0 and len(msgs) == 2:
                        call.cancel()
                    if i % 3 == 1 and len(msgs) == 1:
                        await stub.Abort(pb.AbortRequest(request_ids=[req.request_id]))
            except asyncio.CancelledError:
                return ids, msgs, grpc.StatusCode.CANCELLED
            return ids, msgs, grpc.StatusCode.OK

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))


def test_cancel_and_abort_mid_flight(target):
    reqs = [greedy_request([3 + i, 40 + 7 * i, 9, 11 + i], 12 + i % 5, f"c{i}")
            for i in range(9)]
    results = asyncio.run(_mixed_streams(target, reqs))
    wait_for(lambda: _idle(target), 5, "blocks to be freed")
    with grpc.insecure_channel(target) as ch:
        stub = generation_stub(ch)
        for i, (req, (ids, msgs, code)) in enumerate(zip(reqs, results)):
            alone, _, _ = collect(stub.Generate(req, timeout=60))
            if i % 3 == 0:
                assert code == grpc.StatusCode.CANCELLED and ids == alone[:len(ids)], i
                continue
            assert code == grpc.StatusCode.OK
            assert msgs[-1].usage.completion_tokens == len(ids)
            if i % 3 == 1:
                assert msgs[-1].finish_reason == pb.ABORT and ids == alone[:len(ids)], i
            else:
                assert msgs[-1].finish_reason == pb.LENGTH and ids == alone, i
    wait_for(lambda: _idle(target), 5, "blocks to be freed")


def test_stop_string_cuts_without_the_in_flight_token(target, tiny_models):
    prompt = [5, 17, 301, 44, 9]
    tok = Tokenizer.from_dir(tiny_models("qwen3"))
    with grpc.insecure_channel(target) as ch:
        stub = generation_stub(ch)
        full_ids, full_text, msgs = collect(stub.Generate(greedy_request(prompt, 24), timeout=60))
        # Text after k tokens (a message may carry several tokens when the reader lags).
        prefixes = [tok.decode(full_ids[:k]) for k in range(len(full_ids) + 1)]
        # The whole text less a character the last tokens leave unfinished (vLLM's rule)
        assert prefixes[-1].startswith(full_text)
        assert full_text == streamed_text(tok, full_ids, skip_special_tokens=True)
        stop = full_text[10:12]
        want_tokens = next(k for k, t in enumerate(prefixes) if stop in t)
        req = greedy_request(prompt, 24)
        req.stopping.stop.append(stop)
        ids, text, msgs = collect(stub.Generate(req, timeout=60))
    assert msgs[-1].finish_reason == pb.STOP_STRING and msgs[-1].stop_string == stop
    assert text == full_text[:full_text.find(stop)]
    assert ids == full_ids[:want_tokens] and msgs[-1].usage.completion_tokens == want_tokens


# ---- a worker that stops answering with two steps in flight -------------------------------

def test_step_timeout_mid_pipeline_then_a_clean_epoch(tiny_models, tmp_path):
    model = tiny_models("qwen3")
    procs = Processes(tmp_path)
    port = free_port()
    worker = procs.worker(port)
    # Short, as in test_worker_liveness.py: a step slow on a loaded machine is not failed by it
    # (the worker still answers Health and gets another period); the stopped worker does not.
    client = WorkerClient([f"127.0.0.1:{port}"], connect_timeout_s=2.0, step_timeout_s=3.0)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=1024,
                             block_size=16, async_scheduling=True)
    spec = init_spec(model, max_model_len=1024, block_size=16, max_num_seqs=4,
                    max_num_batched_tokens=32, kv_cache_bytes=1 << 20)
    engine = AsyncEngine(WorkerCoreFactory(client, spec, config),
                         lambda: OutputProcessor(Tokenizer.from_dir(model)))
    eos = ModelInfo.from_dir(model).eos_token_ids

    def request(rid: str, max_tokens: int) -> Request:
        return Request(rid, [3, 14, 15, 92, 65], SamplingParams(),
                       StoppingParams(max_tokens=max_tokens, ignore_eos=True), eos)

    async def scenario():
        assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
        before, error = await stream_ids(engine, request("before", 8))
        assert error is None and len(before) == 8
        started = [asyncio.Event() for _ in range(3)]
        long = [asyncio.ensure_future(stream_ids(engine, request(f"long{i}", 500), started[i]))
                for i in range(3)]
        for event in started:
            await event.wait()
        os.kill(worker.pid, signal.SIGSTOP)           # decoding, two steps in flight
        try:
            results = await asyncio.wait_for(asyncio.gather(*long), 45)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert all(isinstance(e, EngineUnavailable) and 0 < len(ids) < 500
                   for ids, e in results), results
        assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
        after, error = await stream_ids(engine, request("after", 8))
        assert error is None and after == before
        # The stats snapshot may follow the final output by a turn: a flush's answer comes at
        # the end of a turn, after that turn's snapshot.
        await asyncio.wrap_future(engine.flush_prefix_cache(0))
        assert not (engine.stats.num_used_blocks or engine.stats.num_running), engine.stats

    run_started(engine, scenario, 120, client, procs)
