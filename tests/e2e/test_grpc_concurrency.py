"""32 concurrent streaming clients with mixed prompt and output lengths, through real processes.

The server is kept small (8 running at once, a KV cache of a few dozen blocks) so the burst queues,
chunks and preempts. Every stream must complete, and each greedy answer must equal the answer the
same request gets alone.
"""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.support.grpc_harness import (collect, generation_stub, greedy_request, pb,
                                        scheduler_and_worker, server_status, wait_for)

NUM_CLIENTS = 32


@pytest.fixture(scope="module", params=["sync", "async"])
def target(tiny_models, tmp_path_factory, request):
    """The scheduler one step at a time, and with --async-scheduling (two steps in flight)."""
    extra = ["--async-scheduling"] if request.param == "async" else []
    with scheduler_and_worker(tiny_models("qwen3"), tmp_path_factory.mktemp("concurrency"),
                              ["--max-model-len", "256", "--max-num-seqs", "8",
                               "--max-num-batched-tokens", "64", "--kv-cache-gib", "0.0002",
                               *extra]) as (target, _):
        yield target


def _requests() -> list[pb.GenerateRequest]:
    rng = random.Random(7)
    reqs = []
    for i in range(NUM_CLIENTS):
        prompt = [rng.randrange(3, 512) for _ in range(rng.choice((1, 5, 17, 40, 90)))]
        reqs.append(greedy_request(prompt, rng.choice((1, 3, 8, 20, 33)), f"client-{i}"))
    return reqs


async def _stream_all(target: str, reqs: list[pb.GenerateRequest]) -> list[tuple]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_stub(channel)

        async def one(req):
            ids, msgs = [], []
            async for msg in stub.Generate(req, timeout=120):
                ids.extend(msg.token_ids)
                msgs.append(msg)
            return ids, msgs

        return await asyncio.gather(*(one(r) for r in reqs))


def test_32_concurrent_streams_equal_each_request_alone(target):
    reqs = _requests()
    info_blocks = server_status(target).num_kv_blocks
    together = asyncio.run(_stream_all(target, reqs))
    for req, (ids, msgs) in zip(reqs, together):
        assert len(ids) == req.stopping.max_tokens, req.request_id
        assert msgs[-1].finish_reason == pb.LENGTH
        assert all(m.request_id == req.request_id for m in msgs)
        assert msgs[-1].usage.completion_tokens == len(ids)
    with grpc.insecure_channel(target) as ch:
        stub = generation_stub(ch)
        for req, (ids, _) in zip(reqs, together):
            alone, _, _ = collect(stub.Generate(req, timeout=60))
            assert ids == alone, f"{req.request_id}: batched {ids} != alone {alone}"
    wait_for(lambda: server_status(target).num_used_kv_blocks == 0, 5, "blocks to be freed")
    assert info_blocks <= 32   # far too small for the whole burst at once: queueing, preemption
