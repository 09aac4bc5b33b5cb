"""VllmEngineServicer over a real gRPC channel, on the real engine with a simulated worker:
streamed and unstreamed answers agree with each other and with deltaserve.v1.Generate, n > 1 is
fanned out with indices, Abort finds requests by the caller's id, a cancelled call frees its
blocks, refusals name the field, structured-output constraints reach the (simulated) worker and
shape the answer, health follows the engine, and the tokenizer and the KV events arrive as the
protocol defines them. The public port's guards: test_vllm_servicer_keys.py."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import threading
import zipfile
from pathlib import Path

import grpc
import jsonschema
import pytest

from engine_common.request.diff_limits import MAX_CONSTRAINT_DEPTH
from engine_common.wire.diff import NO_LOGPROBS
from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from scheduler_service.api import vllm_servicer
from scheduler_service.api.vllm_convert import block_hash_to_int64
from scheduler_service.core.kv_cache_manager import hash_block
from tests.support.deep_constraints import lark_chain
from tests.support.sim_server import EOS, SimServer, make_sim_model_dir
from tests.support.vllm_sim import (PROMPT, LogLines, Recorded, generate, rpc_code, stored_blocks,
                                    wait_until)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_sim_model_dir(tmp_path_factory.mktemp("sim-model"))


@pytest.fixture
def server(model_dir):
    srv = SimServer(model_dir)
    yield srv
    srv.close()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


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
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    for timeout_s, shown in ((-1.0, "-1.0"), (float("nan"), "nan"), (1e9, "1000000000.0")):
        with pytest.raises(grpc.RpcError) as err:
            stub.FlushCache(cpb.FlushCacheRequest(timeout_s=timeout_s), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (f"timeout_s={shown} is invalid: must be >= 0 and "
                                       f"<= 3600 seconds")


def answer(server, msgs, index=0) -> tuple[str, pb.GenerateComplete]:
    """The text of choice `index` (streamed or not, eos left out) and its `complete`."""
    complete = next(m.complete for m in msgs if m.HasField("complete")
                    and m.complete.index == index)
    streamed = [t for m in msgs if m.HasField("chunk") and m.chunk.index == index
                for t in m.chunk.token_ids]
    ids = streamed or list(complete.output_ids)
    return server.tokenizer.decode([t for t in ids if t != EOS]), complete


def test_a_choice_constraint_answers_one_choice_and_stops_at_eos(server, stub):
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        msgs = list(stub.Generate(generate(
            request_id=f"c{seed}", max_tokens=30, temperature=1.0, seed=seed,
            choice=pb.ChoiceConstraint(choices=choices)), timeout=60))
        text, complete = answer(server, msgs)
        assert text in choices
        assert complete.finish_reason == "stop" and complete.output_ids[-1] == EOS
    assert server.used_blocks() == 0


def test_an_eos_finish_names_no_matched_token_as_vllm(server, stub):
    """vLLM's stop_reason is None at the tokenizer's eos, so its servicer sets no matched_stop
    (smg then reports none); a stop id the caller listed is named, eos too under ignore_eos."""
    choice = pb.ChoiceConstraint(choices=["yes", "no"])
    for stream in (False, True):
        msgs = list(stub.Generate(generate(request_id=f"e{stream}", max_tokens=30,
                                           stream=stream, choice=choice), timeout=60))
        _, complete = answer(server, msgs)
        assert complete.finish_reason == "stop" and complete.output_ids[-1] == EOS
        assert complete.WhichOneof("matched_stop") is None
    msgs = list(stub.Generate(generate(request_id="i", max_tokens=30, ignore_eos=True,
                                       stop_token_ids=[EOS], choice=choice), timeout=60))
    _, complete = answer(server, msgs)
    assert complete.finish_reason == "stop" and complete.matched_token_id == EOS


def test_a_regex_holds_for_every_streamed_choice(server, stub):
    pattern = "[0-9]{3}-[a-z]{2}"
    msgs = list(stub.Generate(generate(stream=True, n=3, temperature=1.0, seed=3, max_tokens=40,
                                       regex=pattern), timeout=60))
    texts = [answer(server, msgs, i)[0] for i in range(3)]
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_a_json_schema_answer_validates(server, stub):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
        "tags": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
        "required": ["ok", "size", "tags"]}
    for seed in range(3):
        msgs = list(stub.Generate(generate(request_id=f"j{seed}", max_tokens=120,
                                           temperature=1.0, seed=seed,
                                           json_schema=json.dumps(schema)), timeout=60))
        text, complete = answer(server, msgs)
        assert complete.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


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
