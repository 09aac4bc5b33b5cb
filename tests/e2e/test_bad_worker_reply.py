"""A worker's bad step reply, through the real scheduler side (WorkerClient, EngineCore,
AsyncEngine) from a real worker process behind a deliberately faulty Worker service
(tests/support/faulty_worker.py) that rewrites one reply.

Before, the scheduler believed the reply: a handle sent twice appended a second token to its
request, an id outside the vocabulary went to the client and the detokenizer. Now the step
fails as a worker fault does: every open stream ends UNAVAILABLE naming what was wrong, no bad
token reaches a stream, and the next epoch serves the same request with the same tokens."""
from __future__ import annotations

import asyncio
import re

import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.errors import EngineUnavailable
from tests.support.engine_streams import run_started, small_engine, stream_ids
from tests.support.faulty_worker import FaultyWorker
from tests.support.grpc_harness import Processes, free_port


def _twice(out):
    out.handles.append(out.handles[0])
    out.sampled_token_ids.append(out.sampled_token_ids[0])
    if out.logprobs:
        out.logprobs.append(0.0)
    return out


def _out_of_vocab(vocab_size: int):
    def corrupt(out):
        out.sampled_token_ids[-1] = vocab_size + 5
        return out
    return corrupt


@pytest.mark.parametrize("fault", ["twice", "out_of_vocab"])
def test_a_bad_reply_fails_the_step_and_the_next_epoch_serves(tiny_models, tmp_path, fault):
    model = tiny_models("qwen3")
    info = ModelInfo.from_dir(model)
    procs = Processes(tmp_path)
    port = free_port()
    procs.worker(port)
    proxy = FaultyWorker(f"127.0.0.1:{port}")
    engine, client = small_engine(model, proxy.address, info.vocab_size)
    corrupt = _twice if fault == "twice" else _out_of_vocab(info.vocab_size)
    want = {"twice": r"handles\[2\]=\d+ must be a handle not sent before",
            "out_of_vocab": rf"sampled_token_ids\[1\]={info.vocab_size + 5} must be a token "
                            rf"id in \[0, {info.vocab_size - 1}\] \(vocab_size\)"}[fault]

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, SamplingParams(),
                       StoppingParams(max_tokens=64, ignore_eos=True), info.eos_token_ids)

    prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81]]

    async def scenario():
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.last_error
        alone = [(await stream_ids(engine, request(f"alone{i}", p)))[0]
                 for i, p in enumerate(prompts)]
        started = [asyncio.Event() for _ in prompts]
        runs = [asyncio.ensure_future(stream_ids(engine, request(f"r{i}", p), started[i]))
                for i, p in enumerate(prompts)]
        for event in started:
            await event.wait()
        proxy.arm(corrupt)                  # both decoding: the next reply names both
        results = await asyncio.wait_for(asyncio.gather(*runs), 120)
        assert proxy.corrupted.is_set()
        for (ids, error), whole in zip(results, alone):
            assert isinstance(error, EngineUnavailable), (ids, error)
            assert re.search(want, str(error)), str(error)
            assert 0 < len(ids) < 64 and ids == whole[:len(ids)]   # no bad token reached it
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.last_error
        again, error = await stream_ids(engine, request("again", prompts[0]))
        assert error is None and again == alone[0]
        await asyncio.wrap_future(engine.flush_prefix_cache(0))
        assert not (engine.stats.num_used_blocks or engine.stats.num_running), engine.stats

    run_started(engine, scenario, 300, client, proxy, procs)
