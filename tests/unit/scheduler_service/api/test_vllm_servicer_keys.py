"""The public port's guards on VllmEngineServicer, as on Generation, over a real gRPC channel
with a simulated worker: API keys on every RPC, the request limits, safe decoding, Abort only by
the key that made the request, caches, KV events and request ids per key."""
from __future__ import annotations

import re
import threading

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.vllm_convert import block_hash_to_int64
from scheduler_service.core.block_hashes import hash_block
from tests.support.sim_server import SimServer
from tests.support.vllm_sim import (PROMPT, Recorded, generate, rpc_code, stored_blocks,
                                    wait_until)


KEY_A, KEY_B, KEY_C = "vllm-key-a-0123456789", "vllm-key-b-0123456789", "vllm-key-c-0123456789"
BEARER_A, BEARER_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
BEARER_C = (("authorization", f"Bearer {KEY_C}"),)


@pytest.fixture
def guarded(model_dir, tmp_path):
    """A port with three API keys and small limits: A is the operator's (admin) and shares its
    cache salt with C; B is a tenant of its own; C may ask for priorities -5..5."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} admin salt=team\n{KEY_B}\n{KEY_C} salt=team priority=-5..5\n")
    api = ApiOptions(api_key_file=str(keys), max_stop_strings=4, max_stop_chars=20,
                     max_stop_token_ids=2, max_prompt_chars=50, max_logprobs=3)
    srv = SimServer(model_dir, api=api)
    with grpc.insecure_channel(srv.target) as channel:
        yield srv, vllm_engine_pb2_grpc.VllmEngineStub(channel), channel
    srv.close()


def test_every_vllm_rpc_needs_an_api_key(guarded):
    server, stub, channel = guarded
    calls = {
        "Generate": lambda md: stub.Generate(generate(max_tokens=2), timeout=10, metadata=md),
        "HealthCheck": lambda md: stub.HealthCheck(pb.HealthCheckRequest(), timeout=10,
                                                   metadata=md),
        "GetModelInfo": lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                                     metadata=md),
        "GetTokenizer": lambda md: stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30,
                                                     metadata=md),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=10,
                                       metadata=md),
        "FlushCache": lambda md: stub.FlushCache(cpb.FlushCacheRequest(), timeout=10,
                                                 metadata=md),
    }
    for name, call in calls.items():
        for metadata in ((), (("authorization", "Bearer not-a-key-0123456789"),)):
            code, details = rpc_code(lambda: call(metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
            assert "--api-key-file" in details
        assert rpc_code(lambda: call(BEARER_A)) == (grpc.StatusCode.OK, ""), name
    subscription = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=10)
    assert rpc_code(lambda: next(subscription))[0] == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("sampling,text,message", [
    ({"stop": [f"s{i}" for i in range(200_000)]}, None,
     r"sampling_params.stop='200000 strings' is invalid: must be at most 4 strings "
     r"\(--max-stop-strings\)"),
    ({"stop": ["0123456789", "0123456789a"]}, None,
     r"sampling_params.stop='21 characters in all' is invalid: must be at most 20 characters"),
    ({"stop_token_ids": [5, 6, 7]}, None,
     r"sampling_params.stop_token_ids='3 ids' is invalid: must be at most 2 ids"),
    ({"logprobs": 4}, None,
     r"sampling_params.logprobs=4 is invalid: must be in \[0, 3\] \(--max-logprobs\)"),
    ({}, "x" * 51, r"text='51 characters' is invalid: must be at most 50 characters "
     r"\(--max-prompt-chars\)"),
])
def test_vllm_requests_obey_the_public_limits(guarded, sampling, text, message):
    server, stub, _ = guarded
    req = generate(max_tokens=2, **sampling)
    if text is not None:
        req.text = text
    code, details = rpc_code(lambda: stub.Generate(req, timeout=30, metadata=BEARER_A))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, details), details
    assert server.engine.stats.num_running == 0 and server.engine.stats.num_waiting == 0


def test_vllm_undecodable_requests_are_invalid_argument(guarded):
    _, _, channel = guarded
    call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
    code, details = rpc_code(lambda: call(b"\xff\xff\xff\xff", timeout=10, metadata=BEARER_A))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request to vllm.grpc.engine.VllmEngine/Generate could not be decoded" in details


def test_vllm_abort_ends_only_the_callers_requests(guarded, monkeypatch):
    server, stub, _ = guarded
    aborts = Recorded()
    real_abort = server.engine.abort

    def recording_abort(ids):
        future = real_abort(ids)
        aborts.append((sorted(ids), future))
        return future
    monkeypatch.setattr(server.engine, "abort", recording_abort)
    server.hold_steps(after=3)               # the request stays live until both Aborts arrive
    stream = stub.Generate(generate(stream=True, n=2, max_tokens=200, ignore_eos=True,
                                    request_id="mine"), timeout=30, metadata=BEARER_A)
    assert next(stream).HasField("chunk")
    other = stub.Abort.future(pb.AbortRequest(request_ids=["mine"]), timeout=30,
                              metadata=BEARER_B)
    aborts.wait_for(lambda seen: len(seen) == 1, "the other key's Abort to reach the engine", 60)
    own = stub.Abort.future(pb.AbortRequest(request_ids=["mine"]), timeout=30, metadata=BEARER_A)
    aborts.wait_for(lambda seen: len(seen) == 2, "the own key's Abort to reach the engine", 60)
    server.release_steps()
    other.result()
    own.result()
    assert [[i.split("/")[-1] for i in ids] for ids, _ in aborts] == [[], ["mine-0", "mine-1"]]
    assert aborts[0][1].result() == 0 and aborts[1][1].result() == 2
    reasons = {m.complete.index: m.complete.finish_reason for m in stream
               if m.HasField("complete")}
    assert reasons == {0: "abort", 1: "abort"}


# ---- tenants: the prefix cache, KV events and FlushCache (issue 23) -----------------------------

def _cached(stub, metadata, request_id: str) -> int:
    (done,) = stub.Generate(generate(max_tokens=2, request_id=request_id), timeout=10,
                            metadata=metadata)
    return done.complete.cached_tokens


def test_a_cache_hit_never_crosses_keys(guarded):
    server, stub, channel = guarded
    assert _cached(stub, BEARER_A, "a1") == 0
    assert _cached(stub, BEARER_B, "b1") == 0        # A's prompt is cached, but not for B
    assert _cached(stub, BEARER_B, "b2") == 12       # B's own
    assert _cached(stub, BEARER_C, "c1") == 12       # C shares A's salt (salt=team)
    generation = generation_pb2_grpc.GenerationStub(channel)
    other = gpb.GenerateRequest(request_id="g1", token_ids=list(range(40, 53)),
                                stopping=gpb.StoppingCriteria(max_tokens=2, ignore_eos=True))
    for metadata, expected in ((BEARER_A, 0), (BEARER_B, 0), (BEARER_B, 12), (BEARER_C, 12)):
        *_, last = generation.Generate(other, timeout=10, metadata=metadata)
        assert last.usage.cached_prompt_tokens == expected, metadata


def test_kv_events_and_flush_cache_are_the_operators(guarded):
    server, stub, _ = guarded
    events = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=10, metadata=BEARER_B)
    code, details = rpc_code(lambda: next(events))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details, details
    code, details = rpc_code(lambda: stub.FlushCache(cpb.FlushCacheRequest(), timeout=10,
                                                  metadata=BEARER_B))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details, details
    assert _cached(stub, BEARER_B, "b1") == 0
    assert _cached(stub, BEARER_B, "b2") == 12       # B's cache was not flushed by B's call
    batches = Recorded()
    admin = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=30,
                                   metadata=BEARER_A)
    reader = threading.Thread(target=lambda: _read_into(admin, batches), daemon=True)
    reader.start()
    assert server.kv_events.wait_subscribers(1, 10), "the admin's subscription"
    assert _cached(stub, BEARER_A, "a1") == 0
    batches.wait_for(lambda seen: len(stored_blocks(seen)) >= 3, "stored events for A's prompt")
    first_hash, first_tokens = stored_blocks(batches)[0]
    assert first_tokens == PROMPT[:4]
    assert first_hash != block_hash_to_int64(hash_block(None, PROMPT[:4]))   # salted
    assert stub.FlushCache(cpb.FlushCacheRequest(), timeout=10, metadata=BEARER_A).success
    assert _cached(stub, BEARER_B, "b3") == 0
    admin.cancel()
    reader.join(10)


def _read_into(events, batches: Recorded) -> None:
    try:
        for batch in events:
            batches.append(batch)
    except grpc.RpcError as e:           # ended by the cancel
        assert e.code() == grpc.StatusCode.CANCELLED


def test_the_key_file_bounds_priority(guarded):
    """Issue 23: any caller could send priority -2**31 and go ahead of everyone."""
    _, _, channel = guarded
    generation = generation_pb2_grpc.GenerationStub(channel)

    def status(priority: int, metadata) -> tuple[grpc.StatusCode, str]:
        req = gpb.GenerateRequest(token_ids=[5, 6, 7], priority=priority,
                                  stopping=gpb.StoppingCriteria(max_tokens=1, ignore_eos=True))
        return rpc_code(lambda: generation.Generate(req, timeout=10, metadata=metadata))

    code, details = status(-2**31, BEARER_B)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority=-2147483648 is invalid: must be in [0, 2147483647]" in details
    assert status(0, BEARER_B)[0] == status(7, BEARER_B)[0] == grpc.StatusCode.OK
    assert status(-5, BEARER_C)[0] == grpc.StatusCode.OK
    assert "must be in [-5, 5]" in status(-6, BEARER_C)[1]


def test_request_ids_are_per_key(guarded):
    """Issue 23: the uniqueness error told one key which ids another key had live."""
    server, stub, channel = guarded
    generation = generation_pb2_grpc.GenerationStub(channel)
    server.hold_steps(after=3)               # A's requests stay live: 3 steps at a time
    a_gen = generation.Generate(gpb.GenerateRequest(
        request_id="g-dup", token_ids=[5, 6, 7],
        stopping=gpb.StoppingCriteria(max_tokens=200, ignore_eos=True)), timeout=30,
        metadata=BEARER_A)
    assert next(a_gen).request_id == "g-dup"
    a_vllm = stub.Generate(generate(stream=True, max_tokens=200, ignore_eos=True,
                                    request_id="dup"), timeout=30, metadata=BEARER_A)
    wait_until(lambda: sum(len(hub._boxes) for hub in server.engine._hubs.values()) == 2,
               "A's second request to be open")
    try:
        for call in (lambda: list(stub.Generate(generate(request_id="dup", max_tokens=2),
                                                timeout=10, metadata=BEARER_A)),
                     lambda: list(generation.Generate(gpb.GenerateRequest(
                         request_id="g-dup", token_ids=[5]), timeout=10, metadata=BEARER_A))):
            code, details = rpc_code(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in details
        # B's "dup" and "g-dup" are B's own: opened while A's are, neither refused nor told
        # of A's.
        b_vllm = stub.Generate(generate(request_id="dup", max_tokens=2), timeout=30,
                               metadata=BEARER_B)
        b_gen = generation.Generate(gpb.GenerateRequest(
            request_id="g-dup", token_ids=[5, 6, 7],
            stopping=gpb.StoppingCriteria(max_tokens=2, ignore_eos=True)), timeout=30,
            metadata=BEARER_B)
        wait_until(lambda: sum(len(hub._boxes) for hub in server.engine._hubs.values()) == 4,
                   "B's requests to be open beside A's")
        server.release_steps()
        (done,) = b_vllm
        assert done.complete.finish_reason == "length"
        *_, last = b_gen
        assert last.request_id == "g-dup" and last.usage.completion_tokens == 2
    finally:
        server.release_steps()
        a_vllm.cancel()
        a_gen.cancel()
