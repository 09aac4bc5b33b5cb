"""VllmEngine's calls besides Generate over a real gRPC channel, on the real engine with a
simulated worker (fixtures: conftest.py): health follows the engine, model and server info and
loads, the tokenizer zip with its sha256, KV events describing a cached prompt, and FlushCache,
which empties the prefix cache only once no request runs, or gives up at its timeout."""
from __future__ import annotations

import hashlib
import io
import threading
import zipfile
from pathlib import Path

import grpc
import pytest

from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from scheduler_service.api import vllm_servicer
from scheduler_service.api.vllm_convert import block_hash_to_int64
from scheduler_service.core.block_hashes import hash_block
from tests.support.vllm_sim import PROMPT, Recorded, generate, stored_blocks, wait_until


def test_health_follows_the_engine(server, stub):
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    server.workers_up = False
    wait_until(lambda: not stub.HealthCheck(pb.HealthCheckRequest()).healthy, "unhealthy")
    reply = stub.HealthCheck(pb.HealthCheckRequest())
    assert "simulated" in reply.message
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate(max_tokens=2)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    server.workers_up = True
    wait_until(lambda: stub.HealthCheck(pb.HealthCheckRequest()).healthy, "healthy again")
    assert list(stub.Generate(generate(max_tokens=2)))[0].complete.finish_reason == "length"


def test_model_info_loads_and_server_info(server, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.served_model_name, info.vocab_size, info.max_context_length) == (
        server.info.name, 320, 256)
    assert list(info.eos_token_ids) == [1] and info.architectures == ["Qwen3ForCausalLM"]
    loads = stub.GetLoads(pb.GetLoadsRequest())
    (load,) = loads.loads
    assert (loads.dp_rank_count, load.max_running_requests) == (1, 8)
    assert load.max_total_num_tokens == server.num_blocks * 4
    assert stub.GetLoads(pb.GetLoadsRequest(dp_rank=1)).loads == []
    assert stub.GetServerInfo(pb.GetServerInfoRequest()).block_size == 4


def test_tokenizer_zip_and_sha256(server, stub, monkeypatch):
    monkeypatch.setattr(vllm_servicer, "TOKENIZER_CHUNK_BYTES", 1000)
    pieces = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=10))
    assert len(pieces) > 1 and all(p.sha256 == "" for p in pieces[:-1])
    data = b"".join(p.data for p in pieces)
    assert pieces[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == ["config.json", "tokenizer.json",
                                         "tokenizer_config.json"]
        assert zf.read("tokenizer.json") == (Path(server.info.path) / "tokenizer.json"
                                             ).read_bytes()


def test_kv_events_describe_the_cached_prompt(server, stub):
    batches = Recorded()
    events = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=30)

    def read():
        try:
            for batch in events:
                batches.append(batch)
        except grpc.RpcError as e:           # ended by the cancel below
            assert e.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert server.kv_events.wait_subscribers(1, 10), "the subscription"
    list(stub.Generate(generate(max_tokens=3), timeout=10))
    batches.wait_for(lambda seen: len(stored_blocks(seen)) >= 3, "stored events for the prompt")
    stored = stored_blocks(batches)
    h, expected = None, []
    for j in range(3):
        h = hash_block(h, PROMPT[4 * j:4 * j + 4])
        expected.append((block_hash_to_int64(h), PROMPT[4 * j:4 * j + 4]))
    assert stored[:3] == expected
    assert [b.sequence_number for b in batches] == list(range(1, len(batches) + 1))
    assert stub.FlushCache(cpb.FlushCacheRequest(), timeout=10).success
    batches.wait_for(lambda seen: any(e.HasField("cleared") for batch in seen
                                      for e in batch.events), "the flush's cleared event")
    events.cancel()
    reader.join(10)
    assert server.kv_events.wait_subscribers(0, 10), "the subscription to end"


def _step_until_answered(server, call):
    """The engine answers commands between steps: let the held worker run one step at a time,
    each 0.1 s later on the engine's clock, until the call is answered (a few steps: the
    answer's way back over gRPC; the requests held here have some 200 steps to go)."""
    for _ in range(600):
        if call.done():
            return call.result()
        server.clock.advance(0.1)
        server.step_once()
    raise AssertionError("the call was never answered")


def test_flush_cache_empties_the_prefix_cache_once_idle(server, stub):
    list(stub.Generate(generate(max_tokens=3), timeout=10))
    (again,) = stub.Generate(generate(max_tokens=3, request_id="again"), timeout=10)
    assert again.complete.cached_tokens == 12
    flushed = stub.FlushCache(cpb.FlushCacheRequest(), timeout=10)
    assert (flushed.success, flushed.message) == (True, "prefix cache flushed")
    (cold,) = stub.Generate(generate(max_tokens=3, request_id="cold"), timeout=10)
    assert cold.complete.cached_tokens == 0
    assert list(cold.complete.output_ids) == list(again.complete.output_ids)

    # A running request holds its blocks: timeout 0 refuses, a timeout waits for it to end.
    server.hold_steps(after=1)
    stream = stub.Generate(generate(stream=True, max_tokens=200, ignore_eos=True,
                                    request_id="busy"), timeout=60)
    wait_until(lambda: server.engine.stats.num_running == 1, "the request to run")
    refused = _step_until_answered(
        server, stub.FlushCache.future(cpb.FlushCacheRequest(timeout_s=0), timeout=60))
    assert not refused.success
    assert refused.message == "not flushed after 0 s: requests still running or waiting (1)"
    waiting = stub.FlushCache.future(cpb.FlushCacheRequest(timeout_s=60), timeout=90)
    # A flush sent after it is refused at a later turn, while the request still runs: the
    # waiting one is not answered meanwhile.
    probe = _step_until_answered(
        server, stub.FlushCache.future(cpb.FlushCacheRequest(timeout_s=0), timeout=60))
    assert not probe.success and not waiting.done()
    server.release_steps()
    assert list(stream)[-1].complete.finish_reason == "length"
    done = waiting.result()
    assert (done.success, done.message) == (True, "prefix cache flushed")
    (after,) = stub.Generate(generate(max_tokens=3, request_id="after"), timeout=10)
    assert after.complete.cached_tokens == 0
    wait_until(lambda: server.used_blocks() == 0, "the blocks to be free")


def test_flush_cache_gives_up_at_its_timeout(server, stub):
    server.hold_steps(after=1)
    stream = stub.Generate(generate(stream=True, max_tokens=200, ignore_eos=True), timeout=60)
    wait_until(lambda: server.engine.stats.num_running == 1, "the request to run")
    late = _step_until_answered(
        server, stub.FlushCache.future(cpb.FlushCacheRequest(timeout_s=0.2), timeout=60))
    assert not late.success
    assert late.message == "not flushed after 0.2 s: requests still running or waiting (1)"
    server.release_steps()
    list(stream)
    wait_until(lambda: server.used_blocks() == 0, "the request to end")
