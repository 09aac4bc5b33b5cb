"""VllmEngineServicer's Generate over a real gRPC channel, on the real engine with a simulated
worker (fixtures: conftest.py): streamed and unstreamed answers agree with each other and with
deltaserve.v1.Generate, n > 1 is fanned out with indices, Abort finds requests by the caller's
id, a cancelled call frees its blocks, stops end it, refusals name the field, a request id in use
is refused, and a prompt that cannot fit is refused before it is tokenized. Structured output:
test_vllm_servicer_constraints.py; the other calls (health, info, tokenizer, KV events, flush):
test_vllm_servicer_admin.py; the public port's guards: test_vllm_servicer_keys.py."""
from __future__ import annotations

import logging

import grpc
import pytest

from engine_common.request.diff_limits import MAX_CONSTRAINT_DEPTH
from engine_common.wire.diff import NO_LOGPROBS
from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from scheduler_service.api import vllm_servicer
from tests.support.deep_constraints import lark_chain
from tests.support.vllm_sim import PROMPT, LogLines, generate, rpc_code, wait_until


def test_streamed_and_unstreamed_answers_agree_with_generate(server, stub):
    streamed = list(stub.Generate(generate(stream=True, max_tokens=6, logprobs=2), timeout=10))
    chunks = [m.chunk for m in streamed[:-1]]
    assert all(m.WhichOneof("response") == "chunk" for m in streamed[:-1])
    complete = streamed[-1].complete
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 6 and sum(c.completion_tokens for c in chunks) == 6
    assert all(c.prompt_tokens == 13 and c.index == 0 for c in chunks)
    assert [t for c in chunks for t in c.output_logprobs.token_ids] == ids
    assert all(len(top.token_ids) == 2 for c in chunks for top in c.output_logprobs.top_logprobs)
    assert complete.finish_reason == "length" and list(complete.output_ids) == list(
        chunks[-1].token_ids)                            # vLLM's shape: the last step again

    (whole,) = list(stub.Generate(generate(request_id="u", max_tokens=6, logprobs=2), timeout=10))
    done = whole.complete
    assert list(done.output_ids) == ids and done.completion_tokens == 6
    assert list(done.output_logprobs.token_ids) == ids
    with grpc.insecure_channel(server.target) as ch:
        ours = list(generation_pb2_grpc.GenerationStub(ch).Generate(gpb.GenerateRequest(
            token_ids=PROMPT, stopping=gpb.StoppingCriteria(max_tokens=6)), timeout=10))
    assert [t for m in ours for t in m.token_ids] == ids
    assert done.cached_tokens == 12                      # the second run hit the prefix cache


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_only_when_asked_and_generate_keeps_its_own(server, stub, stream):
    # vLLM's convention: logprobs unset = none at all, 0 = each token's own. Run together, so
    # a step holds rows that want them and rows that do not.
    ask = {"none": {}, "own": {"logprobs": 0}}
    calls = {name: stub.Generate(generate(request_id=f"{name}{stream}", stream=stream,
                                          max_tokens=5, ignore_eos=True, **extra), timeout=10)
             for name, extra in ask.items()}
    with grpc.insecure_channel(server.target) as ch:    # deltaserve.v1: always every logprob
        ours = list(generation_pb2_grpc.GenerationStub(ch).Generate(gpb.GenerateRequest(
            token_ids=PROMPT, stopping=gpb.StoppingCriteria(max_tokens=5, ignore_eos=True)),
            timeout=10))
    got = {name: list(call) for name, call in calls.items()}
    # the workers are told: none at all (NO_LOGPROBS) for the request that asked none
    sent = [new.num_logprobs for diff in server.workers[-1].diffs for new in diff.new_requests]
    assert sorted(sent) == [NO_LOGPROBS, 0, 0]
    ids = [t for m in ours for t in m.token_ids]
    assert [lp.token_id for m in ours for lp in m.logprobs] == ids and len(ids) == 5
    for name, msgs in got.items():
        parts = [m.chunk for m in msgs[:-1]] + [msgs[-1].complete]
        # streamed: the chunks carry the tokens (the complete repeats the last step's)
        tokens = ([t for m in msgs[:-1] for t in m.chunk.token_ids] if stream
                  else list(msgs[-1].complete.output_ids))
        assert len(tokens) == 5, name
        with_lps = [p for p in parts if p.HasField("output_logprobs")]
        if name == "none":
            assert with_lps == [], name
        else:
            assert with_lps and all(len(p.output_logprobs.token_ids) == len(
                p.output_logprobs.token_logprobs) > 0 for p in with_lps)
            assert all(not p.output_logprobs.top_logprobs for p in with_lps)


def test_text_prompt_is_tokenized_by_our_tokenizer(server, stub):
    text = "Hello world"
    (by_text,) = stub.Generate(pb.GenerateRequest(request_id="t", text=text,
                                                  sampling_params=pb.SamplingParams(max_tokens=3)))
    ids = server.tokenizer.encode(text)
    (by_ids,) = stub.Generate(generate(ids, request_id="i", max_tokens=3))
    assert by_text.complete.prompt_tokens == len(ids)
    assert list(by_text.complete.output_ids) == list(by_ids.complete.output_ids)


def test_n_choices_carry_their_index(server, stub):
    msgs = list(stub.Generate(generate(stream=True, n=3, temperature=1.0, seed=5, max_tokens=4),
                              timeout=10))
    completes = {m.complete.index: m.complete for m in msgs if m.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    outs = {i: [t for m in msgs if m.HasField("chunk") and m.chunk.index == i
                for t in m.chunk.token_ids] for i in range(3)}
    assert all(len(o) == 4 for o in outs.values())
    assert len({tuple(o) for o in outs.values()}) == 3       # seed + index: different samples
    unstreamed = list(stub.Generate(generate(request_id="u", n=3, temperature=1.0, seed=5,
                                             max_tokens=4), timeout=10))
    assert {m.complete.index: list(m.complete.output_ids) for m in unstreamed} == outs
    assert server.used_blocks() == 0


def test_abort_by_the_callers_id_ends_every_choice(server, stub, caplog):
    server.hold_steps(after=3)               # neither choice can finish before the abort
    stream = stub.Generate(generate(stream=True, n=2, max_tokens=200, ignore_eos=True,
                                    request_id="long"), timeout=30)
    first = next(stream)
    assert first.HasField("chunk")
    with caplog.at_level(logging.INFO, logger=vllm_servicer.__name__), \
            LogLines(vllm_servicer.__name__) as lines:
        aborted = stub.Abort.future(pb.AbortRequest(request_ids=["long", "unknown"]),
                                    timeout=10)
        lines.wait_for(lambda seen: any("Abort of 2 ids: 'long', 'unknown'" in line for line in seen),
                       "the Abort to arrive")
    server.release_steps()
    aborted.result()
    rest = list(stream)
    reasons = {m.complete.index: m.complete.finish_reason for m in rest if m.HasField("complete")}
    assert reasons == {0: "abort", 1: "abort"}
    wait_until(lambda: server.used_blocks() == 0, "blocks freed after the abort")


@pytest.mark.parametrize("n", [1, 3])
def test_cancelling_the_call_frees_every_choice(server, stub, n):
    server.hold_steps(after=3)               # no choice can finish before the cancel
    stream = stub.Generate(generate(stream=True, n=n, max_tokens=200, ignore_eos=True),
                           timeout=30)
    next(stream)
    wait_until(lambda: server.engine.stats.num_running == n, "the choices to run")
    stream.cancel()
    server.release_steps()
    wait_until(lambda: server.engine.stats.num_running == 0 and server.used_blocks() == 0,
               "the cancelled request to leave")


def test_stops(server, stub):
    (plain,) = stub.Generate(generate(max_tokens=6))
    stop_id = plain.complete.output_ids[2]
    (by_id,) = stub.Generate(generate(request_id="s", max_tokens=6, stop_token_ids=[stop_id]))
    assert by_id.complete.finish_reason == "stop"
    assert by_id.complete.matched_token_id == stop_id
    assert list(by_id.complete.output_ids) == list(plain.complete.output_ids[:3])
    text = server.tokenizer.decode(list(plain.complete.output_ids))
    stop = text[len(text) // 2:len(text) // 2 + 1]
    (by_str,) = stub.Generate(generate(request_id="t", max_tokens=6, stop=[stop]))
    assert by_str.complete.finish_reason == "stop"
    assert by_str.complete.matched_stop_str == stop


def test_refusals_name_the_field(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate(structural_tag='{"format": {}}')))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.structural_tag" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate(regex="([0-9]")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.regex" in err.value.details()
    assert "unclosed group" in err.value.details()       # the grammar engine's own message
    with pytest.raises(grpc.RpcError) as err:       # llguidance would overflow its stack
        list(stub.Generate(generate(grammar=lark_chain(3000))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("sampling_params.grammar='nested 3002 deep' is invalid: must be nested at most "
            f"{MAX_CONSTRAINT_DEPTH} deep") in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate(max_tokens=300)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.max_tokens" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION     # a generating server
    assert "--runner generate; Embed needs --runner pooling" in err.value.details()
    for timeout_s, shown in ((-1.0, "-1.0"), (float("nan"), "nan"), (1e9, "1000000000.0")):
        with pytest.raises(grpc.RpcError) as err:
            stub.FlushCache(cpb.FlushCacheRequest(timeout_s=timeout_s), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (f"timeout_s={shown} is invalid: must be >= 0 and "
                                       f"<= 3600 seconds")


def test_a_request_id_in_use_is_refused(server, stub):
    server.hold_steps(after=3)               # "dup" stays live
    stream = stub.Generate(generate(stream=True, max_tokens=200, ignore_eos=True,
                                    request_id="dup"), timeout=30)
    next(stream)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate(request_id="dup", max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in \
            err.value.details()
    finally:
        server.release_steps()
        stream.cancel()


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server, stub):
    """Issue 23: 4-million-character prompts were tokenized for a minute, then refused for
    length. max_model_len 256 x the tiny vocabulary's longest token bounds what can fit."""
    limit = server.model.prompt_chars_fit
    assert limit == 256 * server.tokenizer.max_token_bytes()
    calls = 0
    real_encode = server.tokenizer.encode

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real_encode(*args, **kwargs)
    server.tokenizer.encode = counting
    text = "x" * (limit + 1)
    fragment = f"='{limit + 1} characters' is invalid: must be at most {limit} characters"
    code, details = rpc_code(lambda: stub.Generate(pb.GenerateRequest(request_id="big", text=text),
                                                timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
    with grpc.insecure_channel(server.target) as channel:
        generation = generation_pb2_grpc.GenerationStub(channel)
        for call in (lambda: generation.Tokenize(gpb.TokenizeRequest(text=text), timeout=10),
                     lambda: generation.Generate(gpb.GenerateRequest(text=text), timeout=10)):
            code, details = rpc_code(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
        assert calls == 0
        reply = generation.Tokenize(gpb.TokenizeRequest(text="x" * limit), timeout=30)
    assert calls == 1 and reply.num_tokens > 0
