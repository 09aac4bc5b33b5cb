"""The bar through the real Shepherd Model Gateway with the real default model
(SmolLM2-135M-Instruct, fp32): a replica serves it, `smg launch` fronts it and takes its
tokenizer and chat template with GetTokenizer (its --model-path is not readable where it runs);
/v1/models lists it; a streamed chat asking for the capital of France names Paris; the answer's
tokens are transformers' and our own Generate's for the same messages; a streaming client that
leaves takes its request and blocks with it; `response_format` json_schema (the gateway sends it
as SamplingParams.json_schema) gives JSON that validates against the schema, streamed or not, and
is the text our Generate gives with the same constraint; a seeded n=3 completion keeps each
choice at its index, not streamed too, whichever choice ends first. logit_bias and the eos
token's logprob on both gRPC APIs; what the gateway drops of them, pinned as strict xfails.
Skipped, with the reason, when `smg` cannot run."""
from __future__ import annotations

import json
import os

import grpc
import jsonschema
import pytest

from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.gateway import Gateway, Replica, SseStream, http_json, require_smg
from tests.support.grpc_harness import (REPO, Processes, collect, generation_stub, pb,
                                        server_status, wait_for)
from tests.support.real_model import FRANCE, FRANCE_ANSWER, FRANCE_ANSWER_IDS

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    smg = require_smg()
    log_dir = tmp_path_factory.mktemp("gateway-real")
    procs = Processes(log_dir)
    gateway = None
    try:
        replica = Replica(procs, os.path.relpath(default_model, REPO), "--kv-cache-gib", "0.05")
        gateway = Gateway(smg, [replica.url], MODEL, log_dir)
        gateway.wait_healthy(1, timeout=300, procs=procs.procs)
        yield replica, gateway
    finally:
        if gateway is not None:
            gateway.close()
        procs.close()


def test_the_gateway_lists_the_model(served):
    _, gateway = served
    status, models = http_json(gateway.port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    assert "Fetching tokenizer from worker" in gateway.proc.log_tail(10**6)


def test_a_streamed_chat_names_paris(served):
    _, gateway = served
    events = list(SseStream(gateway.port, "/v1/chat/completions",
                            {"model": MODEL, "messages": FRANCE, "max_tokens": 64,
                             "temperature": 0, "stream": True}).events())
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert "Paris" in text
    assert text == FRANCE_ANSWER
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_answer_is_transformers_and_our_generate(served):
    replica, gateway = served
    status, reply = http_json(gateway.port, "POST", "/v1/chat/completions",
                              {"model": MODEL, "messages": FRANCE, "max_tokens": 64,
                               "temperature": 0})
    assert status == 200, reply
    req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=64))
    req.messages.extend(pb.ChatMessage(**m) for m in FRANCE)
    with grpc.insecure_channel(replica.target) as ch:
        ids, text, _ = collect(generation_stub(ch).Generate(req, timeout=120))
    assert ids == FRANCE_ANSWER_IDS                      # transformers' greedy tokens
    assert reply["choices"][0]["message"]["content"] == text == FRANCE_ANSWER
    assert reply["usage"]["completion_tokens"] == len(FRANCE_ANSWER_IDS)


def test_a_client_that_leaves_leaves_nothing_behind(served):
    replica, gateway = served
    stream = SseStream(gateway.port, "/v1/chat/completions",
                       {"model": MODEL, "messages": FRANCE, "max_tokens": 1000,
                        "ignore_eos": True, "stream": True}, timeout=120)
    events = stream.events()
    for _ in range(5):
        next(events)
    stream.disconnect()

    def idle() -> bool:
        s = server_status(replica.target)
        return (s.num_running, s.num_waiting, s.num_used_kv_blocks) == (0, 0, 0)
    wait_for(idle, 60, "no running request and no used block", [gateway.proc])


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "Spanish"]},
                  "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "languages"]}
ASK_PERSON = [{"role": "user", "content": "Give me a person as JSON"}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(served, stream):
    _, gateway = served
    body = {"model": MODEL, "messages": ASK_PERSON, "max_tokens": 96, "stream": stream,
            "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": PERSON}}}
    if stream:
        events = list(SseStream(gateway.port, "/v1/chat/completions", body,
                                timeout=300).events())
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"]
                  if c.get("finish_reason")]
    else:
        status, reply = http_json(gateway.port, "POST", "/v1/chat/completions", body,
                                  timeout=300)
        assert status == 200, reply
        text = reply["choices"][0]["message"]["content"]
        finish = [reply["choices"][0]["finish_reason"]]
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == ["stop"]



def test_the_constrained_answer_is_our_generates(served):
    replica, gateway = served
    status, reply = http_json(gateway.port, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK_PERSON, "max_tokens": 96, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": PERSON}}}, timeout=300)
    assert status == 200, reply
    req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=96),
                             constraint=pb.Constraint(json_schema=json.dumps(PERSON)))
    req.messages.extend(pb.ChatMessage(**m) for m in ASK_PERSON)
    with grpc.insecure_channel(replica.target) as ch:
        _, text, _ = collect(generation_stub(ch).Generate(req, timeout=300))
    assert reply["choices"][0]["message"]["content"] == text    # both greedy, same grammar


def _prompt(replica) -> list[int]:
    req = pb.TokenizeRequest()
    req.messages.extend(pb.ChatMessage(**m) for m in FRANCE)
    with grpc.insecure_channel(replica.target) as ch:
        return list(generation_stub(ch).Tokenize(req, timeout=60).token_ids)


def _vllm_complete(replica, **sampling) -> vpb.GenerateComplete:
    """Our VllmEngine Generate (the gateway's protocol) of FRANCE, greedy, not streamed."""
    req = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=_prompt(replica)),
        sampling_params=vpb.SamplingParams(**{"temperature": 0, "max_tokens": 64, **sampling}))
    with grpc.insecure_channel(replica.target) as ch:
        (reply,) = list(vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(req, timeout=120))
    return reply.complete


def _generate(replica, logprobs: int = 0, max_tokens: int = 64, **sampling
              ) -> tuple[list[int], list]:
    req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=max_tokens),
                             logprobs=logprobs,
                             sampling=pb.SamplingParams(**sampling))
    req.messages.extend(pb.ChatMessage(**m) for m in FRANCE)
    with grpc.insecure_channel(replica.target) as ch:
        ids, _, msgs = collect(generation_stub(ch).Generate(req, timeout=120))
    return ids, [lp for m in msgs for lp in m.logprobs]


def test_logit_bias_against_the_first_greedy_token_changes_the_answer_on_both_grpc_apis(served):
    replica, _ = served
    first = FRANCE_ANSWER_IDS[0]
    # Only the first token is checked: 4 tokens, not the 64 a changed answer would run to.
    ids, _ = _generate(replica, logit_bias={first: -100.0}, max_tokens=4)
    assert ids[0] != first
    complete = _vllm_complete(replica, logit_bias={first: -100.0}, max_tokens=4)
    assert list(complete.output_ids)[0] != first
    assert list(_vllm_complete(replica).output_ids) == FRANCE_ANSWER_IDS
    forced = _vllm_complete(replica, logit_bias={first: -100.0, 42: 100.0}, max_tokens=3)
    assert list(forced.output_ids) == [42, 42, 42]


def test_every_completion_token_has_its_logprob_eos_included(served):
    replica, _ = served
    ids, logprobs = _generate(replica, logprobs=1)
    assert ids == FRANCE_ANSWER_IDS and ids[-1] == 2      # eos is the last output token
    assert [lp.token_id for lp in logprobs] == ids
    complete = _vllm_complete(replica, logprobs=1)
    assert list(complete.output_ids) == FRANCE_ANSWER_IDS
    assert complete.completion_tokens == len(FRANCE_ANSWER_IDS)
    assert len(complete.output_logprobs.token_logprobs) == len(FRANCE_ANSWER_IDS)
    assert len(complete.output_logprobs.top_logprobs) == len(FRANCE_ANSWER_IDS)


def _seeded_choices(gateway, stream: bool, **body) -> list[tuple[int, str, str]]:
    """(index, text, finish reason) of each choice of a seeded n=3 completion."""
    choices = _openai(gateway, "/v1/completions", {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "n": 3,
        "seed": 5, "temperature": 1.0, "ignore_eos": True, "stream": stream, **body})
    return [(i, "".join(c["text"] for c in choices if c["index"] == i),
             next(c["finish_reason"] for c in choices if c["index"] == i and c["finish_reason"]))
            for i in range(3)]


def test_unstreamed_choices_keep_their_index_when_a_later_one_ends_first(served):
    """The gateway numbers a non-streamed answer's choices by arrival: ours come in index
    order (choice 2, cut short by a stop string only it samples, used to come first)."""
    _, gateway = served
    streamed = _seeded_choices(gateway, True)        # choice i samples with seed 5 + i
    texts = [text for _, text, _ in streamed]
    words = [w for w in texts[2].split()[1:-1] if w not in texts[0] and w not in texts[1]]
    assert words, streamed
    cut = texts[2][:texts[2].index(words[0])]
    got = _seeded_choices(gateway, False, stop=[words[0]])
    assert got == [(0, texts[0], "length"), (1, texts[1], "length"), (2, cut, "stop")]


# What smg 1.13.0 drops on its way (we honour each field on our own gRPC APIs, tested above), traced
# to its source in docs/openai.md: it never puts logit_bias into the SamplingParams it sends us
# (grpc_client/src/vllm_engine.rs), builds every /v1/completions choice with `logprobs: None`
# (processor.rs, streaming.rs) though it sends `logprobs` to us, and keeps only the logprobs of a
# chat's content tokens, so not the eos token's. Strict xfails: a gateway that fixes one turns its
# test red, and docs/openai.md must change.
LOGIT_BIAS_GAP = "smg 1.13.0 leaves logit_bias out of SamplingParams (docs/openai.md)"
COMPLETIONS_LOGPROBS_GAP = "smg 1.13.0 answers /v1/completions with logprobs: None (docs/openai.md)"
EOS_LOGPROB_GAP = "smg 1.13.0 keeps only the content tokens' logprobs (docs/openai.md)"


def _openai(gateway, path: str, body: dict) -> list[dict]:
    """The choices of one OpenAI request, streamed or not: for a stream, each event's choices
    (the caller merges them), else the answer's choices."""
    if body.get("stream"):
        return [c for e in SseStream(gateway.port, path, body, timeout=120).events()
                for c in e["choices"]]
    status, reply = http_json(gateway.port, "POST", path, body)
    assert status == 200, reply
    return reply["choices"]


@pytest.mark.xfail(strict=True, reason=LOGIT_BIAS_GAP)
def test_the_gateway_passes_logit_bias_on(served):
    _, gateway = served
    status, reply = http_json(gateway.port, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": FRANCE, "max_tokens": 8, "temperature": 0,
        "logit_bias": {str(FRANCE_ANSWER_IDS[0]): -100}})
    assert status == 200, reply
    assert not reply["choices"][0]["message"]["content"].startswith("The")


@pytest.mark.xfail(strict=True, reason=COMPLETIONS_LOGPROBS_GAP)
@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_returns_completions_logprobs(served, stream):
    _, gateway = served
    choices = _openai(gateway, "/v1/completions", {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0, "logprobs": 2, "stream": stream})
    assert any(c.get("logprobs") for c in choices)


@pytest.mark.xfail(strict=True, reason=EOS_LOGPROB_GAP)
@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_keeps_the_eos_logprob(served, stream):
    _, gateway = served
    choices = _openai(gateway, "/v1/chat/completions", {
        "model": MODEL, "messages": FRANCE, "max_tokens": 64, "temperature": 0,
        "logprobs": True, "top_logprobs": 1, "stream": stream})
    entries = [lp for c in choices for lp in ((c.get("logprobs") or {}).get("content") or [])]
    assert "".join(lp["token"] for lp in entries) == FRANCE_ANSWER
    assert len(entries) == len(FRANCE_ANSWER_IDS)
