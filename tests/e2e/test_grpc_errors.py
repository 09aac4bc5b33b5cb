"""Bad input, overload, cancellation, deadlines, Abort and a missing worker, over real processes.

Every error must carry its gRPC code and a message naming the field; the server must keep serving
afterwards; a cancelled or timed-out stream must free its KV blocks at once.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.grpc_harness import (collect, free_port, generation_stub, greedy_request,
                                        health_status, pb, Processes, scheduler_and_worker,
                                        server_status, wait_for)

MAX_MODEL_LEN = 2048
VOCAB = 512


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    """A server that runs 2 requests at once and queues at most 2 more."""
    with scheduler_and_worker(tiny_models("qwen3"), tmp_path_factory.mktemp("errors"),
                              ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
                               "--max-waiting", "2"]) as (target, _):
        yield target


@pytest.fixture
def stub(target):
    with grpc.insecure_channel(target) as channel:
        yield generation_stub(channel)


def _req(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    stopping = kw.pop("stopping", {})
    kw.setdefault("token_ids", [] if "text" in kw else [5, 6, 7])
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling),
                              stopping=pb.StoppingCriteria(**stopping), **kw)


BAD_REQUESTS = [
    ("prompt", _req(token_ids=[])),
    ("prompt", _req(text="hi", token_ids=[1])),
    ("text", _req(text="")),
    ("token_ids[1]", _req(token_ids=[3, VOCAB])),
    ("sampling.temperature", _req(sampling={"temperature": -0.5})),
    ("sampling.top_p", _req(sampling={"top_p": 0.0})),
    ("sampling.top_k", _req(sampling={"top_k": -2})),
    ("sampling.min_p", _req(sampling={"min_p": 1.5})),
    ("sampling.repetition_penalty", _req(sampling={"repetition_penalty": 0.0})),
    ("sampling.presence_penalty", _req(sampling={"presence_penalty": 2.5})),
    ("sampling.frequency_penalty", _req(sampling={"frequency_penalty": -3.0})),
    ("sampling.seed", _req(sampling={"seed": 2**63})),
    ("stopping.max_tokens", _req(stopping={"max_tokens": 0})),
    ("stopping.min_tokens", _req(stopping={"max_tokens": 4, "min_tokens": 5})),
    ("stopping.stop", _req(stopping={"stop": ["ok", ""]})),
    ("stopping.stop_token_ids[0]", _req(stopping={"stop_token_ids": [VOCAB + 1]})),
    ("logprobs", _req(logprobs=21)),
    ("stopping.max_tokens", _req(token_ids=[5] * 100, stopping={"max_tokens": 1949})),
    ("prompt", _req(token_ids=[5] * MAX_MODEL_LEN, stopping={"max_tokens": 1})),
    ("prompt", _req(text="hi", messages=[pb.ChatMessage(role="user", content="hi")])),
    ("messages[0].role", _req(token_ids=[], messages=[pb.ChatMessage(content="hi")])),
    ("messages", _req(token_ids=[], messages=[pb.ChatMessage(role="user", content="hi")])),
]


@pytest.mark.parametrize("field,request_msg", BAD_REQUESTS,
                         ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_field_is_invalid_argument_naming_the_field(stub, field, request_msg):
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(request_msg, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith(f"{field}="), details
    assert "must be" in details   # the allowed range follows


def test_chat_messages_to_a_model_without_a_template_name_the_missing_template(stub):
    """The tiny model has no chat template: Generate and Tokenize say so."""
    chat = [pb.ChatMessage(role="user", content="hi")]
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(_req(token_ids=[], messages=chat), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has none (no chat_template.jinja, no chat_template in tokenizer_config.json" \
        in err.value.details()
    for bad in (pb.TokenizeRequest(messages=chat),
                pb.TokenizeRequest(text="hi", messages=chat)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(bad, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).has_chat_template


def test_still_serves_after_errors(stub):
    for _, bad in BAD_REQUESTS[:3]:
        with pytest.raises(grpc.RpcError):
            collect(stub.Generate(bad, timeout=10))
    ids, _, msgs = collect(stub.Generate(greedy_request([5, 6, 7], 4), timeout=30))
    assert len(ids) == 4 and msgs[-1].finish_reason == pb.LENGTH


def test_burst_over_max_waiting_is_resource_exhausted(target):
    async def burst():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_stub(channel)

            async def one(i):
                try:  # long generations keep both seats busy while the burst arrives, even
                    # when a loaded machine spreads the 12 calls out
                    ids = [t async for m in stub.Generate(greedy_request([9, i + 3], 150),
                                                          timeout=60) for t in m.token_ids]
                    return len(ids)
                except grpc.aio.AioRpcError as e:
                    return e
            return await asyncio.gather(*(one(i) for i in range(12)))

    results = asyncio.run(burst())
    rejected = [r for r in results if not isinstance(r, int)]
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in rejected), rejected
    assert "max_waiting (2)" in rejected[0].details()
    assert all(r == 150 for r in results if isinstance(r, int))
    # At least max_waiting are admitted: exactly that many when every call reaches the engine
    # in one turn, before it schedules any (a loaded machine can deliver the burst so).
    assert 2 <= len(results) - len(rejected) <= 10 and len(rejected) >= 2
    wait_for(lambda: server_status(target).num_used_kv_blocks == 0, 5, "blocks to be freed")


def _blocks_freed(target: str) -> None:
    wait_for(lambda: (lambda s: s.num_used_kv_blocks == 0 and s.num_running == 0
                      and s.num_waiting == 0)(server_status(target)), 5, "blocks to be freed")


def test_cancel_mid_stream_frees_blocks(stub, target):
    stream = stub.Generate(greedy_request(list(range(3, 40)), 2000), timeout=60)
    for _, _msg in zip(range(3), stream):
        pass
    mid = server_status(target)
    assert mid.num_running == 1 and mid.num_used_kv_blocks >= 3
    stream.cancel()
    _blocks_freed(target)


def test_deadline_aborts_and_frees_blocks(stub, target):
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(greedy_request(list(range(3, 40)), 2000), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _blocks_freed(target)


def test_abort_rpc_ends_the_stream_with_abort(stub, target):
    stream = stub.Generate(greedy_request([3, 4, 5], 2000, request_id="abort-me"), timeout=60)
    first = next(stream)
    assert first.request_id == "abort-me"
    reply = stub.Abort(pb.AbortRequest(request_ids=["abort-me", "no-such-id"]), timeout=5)
    assert reply.num_aborted == 1
    _, _, msgs = collect(stream)
    assert msgs[-1].finish_reason == pb.ABORT
    _blocks_freed(target)


def test_no_worker_is_unavailable(tiny_models, tmp_path):
    procs = Processes(tmp_path)
    try:
        s_port = free_port()
        sched = procs.scheduler(tiny_models("qwen3"), [free_port()], s_port)
        target = f"127.0.0.1:{s_port}"
        wait_for(lambda: health_status(target, "") == "SERVING", 30, "liveness", [sched])
        assert health_status(target, "deltaserve.v1.Generation") == "NOT_SERVING"
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            for _ in range(2):   # and it keeps answering
                with pytest.raises(grpc.RpcError) as err:
                    collect(stub.Generate(greedy_request([3, 4], 4), timeout=10))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no worker is ready" in err.value.details()
            status = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
            assert status.num_workers == 1 and status.num_workers_ready == 0
            assert status.max_steps_in_flight == 0        # no engine yet
    finally:
        procs.close()
