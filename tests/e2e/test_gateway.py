"""The real Shepherd Model Gateway (`smg launch`, PyPI smg 1.13.0) in front of real DeltaServe
processes speaking vllm.grpc.engine on the scheduler's port, with the tiny model given a ChatML
template (the gateway applies chat templates and detokenizes itself):

  * /v1/models lists the model; /v1/chat/completions (streamed and not) and /v1/completions
    answer greedily exactly what our own Generate answers for the same messages (or text);
  * stop strings cut the answer and say which stop matched; logprobs are ours; our request
    limits hold through the gateway (its HTTP 400 names our field and flag);
  * a streaming client that disconnects leaves no running request and no used KV block: its
    request ends as aborted, not by running to its length;
  * a worker that dies turns the replica unhealthy at the gateway, and healthy again when it is back;
  * two replicas behind one gateway: requests sharing a long prefix land on the replica that holds
    it (each request attributed through each replica's own GetServerInfo), routed by our KV
    events (the gateway's event_hit counter); with one replica killed the other serves them all.

Skipped, with the reason, when the `smg` binary cannot run here.
"""
from __future__ import annotations

import http.client
import json
import os

import grpc
import pytest

from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.gateway import (Gateway, Replica, SseStream, chat_model_dir, http_json,
                                   require_smg)
from tests.support.grpc_harness import (REPO, Processes, collect, generation_stub, pb,
                                        server_status, wait_for)
from tests.support.metrics_scrape import scrape

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Once upon a time there was a little model."}]


@pytest.fixture(scope="module")
def smg():
    return require_smg()


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    return chat_model_dir(tiny_models("qwen3"), tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def single(smg, chat_model, tmp_path_factory):
    """One replica behind one gateway. The replica gets the model as a path relative to its
    working directory, which the gateway (running elsewhere) cannot read: the gateway takes the
    tokenizer and chat template from GetTokenizer."""
    log_dir = tmp_path_factory.mktemp("gateway-single")
    procs = Processes(log_dir)
    gateway = None
    try:
        replica = Replica(procs, os.path.relpath(chat_model, REPO))
        gateway = Gateway(smg, [replica.url], "tiny-chat", log_dir)
        gateway.wait_healthy(1, procs=procs.procs)
        yield replica, gateway
    finally:
        if gateway is not None:
            gateway.close()
        procs.close()


def ours(replica: Replica, messages=None, text=None, max_tokens=12, logprobs=0):
    """Our own greedy Generate of chat `messages` (or `text`): (token ids, text, finish reason
    name, messages)."""
    req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=max_tokens),
                             logprobs=logprobs)
    if text is not None:
        req.text = text
    else:
        req.messages.extend(pb.ChatMessage(**m) for m in messages)
    with grpc.insecure_channel(replica.target) as ch:
        ids, out_text, msgs = collect(generation_stub(ch).Generate(req, timeout=60))
    return ids, out_text, pb.FinishReason.Name(msgs[-1].finish_reason), msgs


def prompt_ids(replica: Replica, messages=None, text: str = "") -> list[int]:
    """Our Tokenize of chat `messages` (or `text`)."""
    req = pb.TokenizeRequest(text=text)
    req.messages.extend(pb.ChatMessage(**m) for m in messages or ())
    with grpc.insecure_channel(replica.target) as ch:
        return list(generation_stub(ch).Tokenize(req).token_ids)


def same_text(theirs: str, ours_text: str) -> bool:
    """Equal, even where the stream ends inside a character: neither the gateway's
    detokenizer nor ours (as vLLM's) sends the bytes of an unfinished character."""
    return theirs == ours_text


def chat(gateway: Gateway, **body) -> dict:
    body = {"model": "tiny-chat", "messages": QUESTION, "max_tokens": 12, **body}
    status, reply = http_json(gateway.port, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
    return reply


def test_models_lists_the_served_model(single):
    _, gateway = single
    status, models = http_json(gateway.port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-chat"]
    (worker,) = gateway.workers()
    assert worker["runtime_type"] == "vllm" and worker["connection_mode"] == "grpc"
    log = gateway.proc.log_tail(10**6)
    assert "Fetching tokenizer from worker" in log and "Successfully loaded tokenizer" in log


def test_the_manifests_probe_paths_answer(single):
    """deploy/k8s/gateway probes these paths of the real gateway."""
    yaml = pytest.importorskip("yaml")
    _, gateway = single
    text = (REPO / "deploy" / "k8s" / "gateway" / "gateway-deployment.yaml").read_text()
    [ctr] = yaml.safe_load(text)["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        path = ctr[probe]["httpGet"]["path"]
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
        conn.request("GET", path)
        reply = conn.getresponse()
        assert reply.status == 200, (path, reply.read())
        conn.close()


def test_chat_answers_equal_our_generate(single):
    replica, gateway = single
    prompt = prompt_ids(replica, QUESTION)
    ids, text, finish, _ = ours(replica, QUESTION)
    extra = {"temperature": 0}
    reply = chat(gateway, **extra)
    (choice,) = reply["choices"]
    assert same_text(choice["message"]["content"], text)
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["usage"]["completion_tokens"] == len(ids)
    assert choice["finish_reason"] == {"LENGTH": "length"}.get(finish, "stop")

    stream = SseStream(gateway.port, "/v1/chat/completions",
                       {"model": "tiny-chat", "messages": QUESTION, "max_tokens": 12,
                        "stream": True, "stream_options": {"include_usage": True}, **extra})
    events = list(stream.events())
    deltas = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert same_text(deltas, text)
    assert events[-1]["usage"]["completion_tokens"] == len(ids)


def test_an_unset_temperature_samples_and_zero_is_greedy(single):
    """As vLLM (and OpenAI): the model's generation_config.json sets the defaults, and a
    temperature it does not set is 1; the gateway fills unset fields with what GetModelInfo
    publishes."""
    replica, gateway = single
    with grpc.insecure_channel(replica.target) as ch:
        info = vllm_engine_pb2_grpc.VllmEngineStub(ch).GetModelInfo(
            vpb.GetModelInfoRequest(), timeout=10)
    assert json.loads(info.default_sampling_params_json)["temperature"] == 1.0
    _, greedy_text, _, _ = ours(replica, QUESTION, max_tokens=16)
    unset = [chat(gateway, max_tokens=16)["choices"][0]["message"]["content"] for _ in range(2)]
    assert unset[0] != unset[1]          # random weights: near-uniform at temperature 1
    zero = [chat(gateway, max_tokens=16, temperature=0)["choices"][0]["message"]["content"]
            for _ in range(2)]
    assert zero[0] == zero[1] and same_text(zero[0], greedy_text)


def test_completions_equal_our_generate(single):
    replica, gateway = single
    prompt = "The quick brown fox"
    _, text, _, _ = ours(replica, text=prompt, max_tokens=10)
    status, reply = http_json(gateway.port, "POST", "/v1/completions",
                              {"model": "tiny-chat", "prompt": prompt, "max_tokens": 10,
                               "temperature": 0})
    assert status == 200, reply
    assert same_text(reply["choices"][0]["text"], text)


def test_stop_strings(single):
    replica, gateway = single
    _, text, _, _ = ours(replica, QUESTION, max_tokens=12)
    visible = text.strip()
    assert len(visible) >= 4, text
    stop = visible[len(visible) // 2:len(visible) // 2 + 2]
    cut = text[:text.index(stop)]
    reply = chat(gateway, temperature=0, stop=[stop])
    (choice,) = reply["choices"]
    assert choice["message"]["content"] == cut
    assert choice["finish_reason"] == "stop"
    events = list(SseStream(gateway.port, "/v1/chat/completions",
                            {"model": "tiny-chat", "messages": QUESTION, "max_tokens": 12,
                             "temperature": 0, "stop": [stop], "stream": True}).events())
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == cut


def test_our_request_limits_hold_through_the_gateway(single):
    """The gateway passes the replica's refusal on (HTTP 400 naming our field and flag): smg
    itself allows at most 4 stop strings, but not their length, which our --max-stop-chars
    (4096 by default) bounds."""
    _, gateway = single
    stops = ["x" * 2000 + str(i) for i in range(4)]             # 8004 characters in all
    status, body = http_json(gateway.port, "POST", "/v1/completions",
                             {"model": "tiny-chat", "prompt": "Once upon a time",
                              "max_tokens": 4, "stop": stops})
    assert status == 400, body
    assert ("sampling_params.stop='8004 characters in all' is invalid: must be at most 4096 "
            "characters (--max-stop-chars)") in body["error"]["message"]
    status, body = http_json(gateway.port, "POST", "/v1/completions",
                             {"model": "tiny-chat", "prompt": "Once upon a time",
                              "max_tokens": 4, "stop": stops[:1]})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def test_logprobs_are_ours(single):
    """Each entry the gateway reports is one of our tokens' logprobs with its alternatives, in
    order. (The gateway merges tokens that only together make a whole character, as the tiny
    random model's often do, so entries and tokens need not pair one to one.)"""
    replica, gateway = single
    _, _, _, msgs = ours(replica, QUESTION, max_tokens=6, logprobs=3)
    expected = [lp for m in msgs for lp in m.logprobs]
    reply = chat(gateway, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) <= len(expected) == 6
    pos = 0
    for got in content:
        while pos < len(expected) and abs(expected[pos].logprob - got["logprob"]) > 1e-4:
            pos += 1
        assert pos < len(expected), (got, expected)
        assert [t["logprob"] for t in got["top_logprobs"]] == pytest.approx(
            [t.logprob for t in expected[pos].top_logprobs], abs=1e-4)
        pos += 1


def _finished(replica: Replica, reason: str) -> float:
    """The scheduler's count of requests that ended with `reason` (length, stop, abort)."""
    got = scrape(replica.metrics_port)
    assert "deltaserve:request_success_total" in got.names, sorted(got.names)
    samples = got.samples
    return sum(v for (name, labels), v in samples.items()
               if name == "deltaserve:request_success_total"
               and dict(labels).get("finished_reason") == reason)


def test_client_disconnect_frees_the_request(single):
    replica, gateway = single
    ran_out = _finished(replica, "length")
    stream = SseStream(gateway.port, "/v1/chat/completions",
                       {"model": "tiny-chat", "messages": QUESTION, "max_tokens": 1500,
                        "ignore_eos": True, "stream": True})
    events = stream.events()
    for _ in range(3):
        next(events)
    wait_for(lambda: server_status(replica.target).num_running == 1, 30, "the request to run")
    stream.disconnect()
    wait_for(lambda: (lambda s: (s.num_running, s.num_waiting, s.num_used_kv_blocks) == (0, 0, 0))(
        server_status(replica.target)), 30, "the request to be freed")
    # Freed by the disconnect (an abort), not by running to its 1500 tokens.
    assert _finished(replica, "length") == ran_out


def test_a_worker_turning_unhealthy_and_back(single):
    """On the module's replica: it ends as it began, healthy behind the gateway, so the tests
    that share it do not depend on running before this one."""
    replica, gateway = single
    procs = [gateway.proc, replica.worker, replica.scheduler]
    gateway.wait_healthy(1, procs=procs)
    replica.worker.kill()
    wait_for(lambda: not any(w.get("is_healthy") for w in gateway.workers()), 60,
             "the gateway to mark the replica unhealthy", procs)
    status, _ = http_json(gateway.port, "POST", "/v1/chat/completions",
                          {"model": "tiny-chat", "messages": QUESTION, "max_tokens": 4})
    assert status >= 500
    replica.restart_worker()
    gateway.wait_healthy(1, procs=[gateway.proc, replica.worker, replica.scheduler])
    assert chat(gateway, max_tokens=4)["choices"][0]["finish_reason"] in ("length", "stop")


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(smg, chat_model, tmp_path):
    procs = Processes(tmp_path)
    gateway = None
    try:
        replicas = [Replica(procs, chat_model), Replica(procs, chat_model)]
        gateway = Gateway(smg, [r.url for r in replicas], chat_model, tmp_path)
        gateway.wait_healthy(2, procs=procs.procs)
        families = {
            "P": "The quick brown fox jumps over the lazy dog. " * 12,
            "Q": "Paged attention keeps the key and value cache in fixed-size blocks. " * 10,
        }
        served: dict[str, list[int]] = {name: [] for name in families}
        cached: dict[str, list[int]] = {name: [] for name in families}
        for k in range(4):
            for name, prefix in families.items():
                before = [r.last_receive() for r in replicas]
                status, reply = http_json(gateway.port, "POST", "/v1/completions", {
                    "model": "tiny-chat", "prompt": f"{prefix}Question {k}:", "max_tokens": 2,
                    "temperature": 0})
                assert status == 200, reply
                after = [r.last_receive() for r in replicas]
                (index,) = [i for i in range(2) if after[i] != before[i]]
                served[name].append(index)
                cached[name].append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        for name, prefix in families.items():
            full_blocks = len(prompt_ids(replicas[0], text=prefix)) // 16
            assert len(set(served[name])) == 1, served     # every request of a family: one replica
            assert min(cached[name][1:]) >= 16 * (full_blocks - 1), cached   # ... holding it
        # Routed by our KV events: the gateway counts a selection that found the prefix in them.
        assert gateway.metric("smg_cache_aware_policy_branch_total", branch="event_hit") >= 6

        # One replica killed (scheduler and worker): the other serves every family.
        dead = replicas[served["P"][0]]
        dead.scheduler.kill()
        dead.worker.kill()
        wait_for(lambda: sum(bool(w.get("is_healthy")) for w in gateway.workers()) == 1, 60,
                 "the gateway to drop the dead replica", [gateway.proc])
        for name, prefix in families.items():
            status, reply = http_json(gateway.port, "POST", "/v1/completions", {
                "model": "tiny-chat", "prompt": f"{prefix}Question 9:", "max_tokens": 2,
                "temperature": 0})
            assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply
    finally:
        if gateway is not None:
            gateway.close()
        procs.close()
