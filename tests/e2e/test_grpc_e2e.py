"""End to end through real processes: grpcurl (reflection, health, a JSON Generate stream) and the
`deltaserve generate` CLI, with greedy tokens equal to transformers' on the same tiny model;
allowed_token_ids through both APIs (deltaserve.v1.Generation and vLLM's VllmEngine)."""
from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from engine_common.text.tokenizer import Tokenizer
from tests.support.grpc_harness import (generation_stub, grpcurl, json_stream, pb, REPO,
                                        scheduler_and_worker)
from tests.support.hf_reference import hf_greedy, hf_greedy_allowed
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    """(target, model_dir): one worker and one scheduler started through the CLI."""
    model_dir = tiny_models("qwen3")
    with scheduler_and_worker(model_dir, tmp_path_factory.mktemp("e2e"),
                              ["--max-model-len", str(MAX_MODEL_LEN)]) as (target, _):
        yield target, model_dir


def test_grpcurl_lists_services(server):
    target, _ = server
    out = grpcurl(target, "list")
    assert out.returncode == 0, out.stderr
    services = out.stdout.split()
    for name in ("deltaserve.v1.Generation", "grpc.health.v1.Health",
                 "grpc.reflection.v1alpha.ServerReflection"):
        assert name in services


def test_grpcurl_describe_shows_doc_comments(server):
    target, _ = server
    out = grpcurl(target, "describe", "deltaserve.v1.Generation")
    assert out.returncode == 0, out.stderr
    assert "rpc Generate ( .deltaserve.v1.GenerateRequest ) returns " \
           "( stream .deltaserve.v1.GenerateResponse );" in out.stdout
    assert "// Generates one completion. One stream is one request" in out.stdout
    msg = grpcurl(target, "describe", "deltaserve.v1.StoppingCriteria")
    assert "// Most tokens to generate, >= 1." in msg.stdout


def test_grpcurl_health_check(server):
    target, _ = server
    for service in ("", "deltaserve.v1.Generation"):
        out = grpcurl(target, "grpc.health.v1.Health/Check", data={"service": service})
        assert out.returncode == 0, out.stderr
        assert json_stream(out.stdout) == [{"status": "SERVING"}]


@pytest.mark.parametrize("prompt", ["Once upon a time", [5, 17, 300, 42, 9, 77, 128]])
def test_grpcurl_generate_equals_transformers_greedy(server, prompt):
    target, model_dir = server
    max_tokens = 12
    body = {"stopping": {"max_tokens": max_tokens, "ignore_eos": True}}
    if isinstance(prompt, str):
        body["text"] = prompt
        prompt_ids = Tokenizer.from_dir(model_dir).encode(prompt)
    else:
        body["token_ids"] = prompt
        prompt_ids = prompt
    out = grpcurl(target, "deltaserve.v1.Generation/Generate", data=body)
    assert out.returncode == 0, out.stderr
    messages = json_stream(out.stdout)
    tokens = [t for m in messages for t in m.get("tokenIds", [])]
    assert tokens == list(hf_greedy(model_dir, tuple(prompt_ids), max_tokens).token_ids)
    last = messages[-1]
    assert last["finishReason"] == "LENGTH"
    assert last["usage"]["completionTokens"] == max_tokens
    assert last["usage"]["promptTokens"] == len(prompt_ids)
    assert all("finishReason" not in m for m in messages[:-1])


def test_cli_generate_streams_text_and_finish_reason(server):
    target, model_dir = server
    prompt_ids = [11, 200, 33, 4]
    ref = hf_greedy(model_dir, tuple(prompt_ids), 10).token_ids
    out = subprocess.run(
        [sys.executable, "-m", "deltaserve.cli", "generate", "--target", target, "--token-ids",
         ",".join(map(str, prompt_ids)), "--max-tokens", "10", "--ignore-eos", "--timeout", "30"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == Tokenizer.from_dir(model_dir).decode(list(ref))
    assert "finish_reason=LENGTH" in out.stderr
    assert "completion_tokens=10" in out.stderr


def test_model_info_tokenize_and_status(server):
    target, model_dir = server
    tokenizer = Tokenizer.from_dir(model_dir)
    with grpc.insecure_channel(target) as ch:
        stub = generation_stub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert info.max_model_len == MAX_MODEL_LEN
        assert info.vocab_size == 512 and info.tp_size == 1
        assert list(info.eos_token_ids) == [tokenizer.eos_token_id]
        assert info.num_kv_blocks > 0 and info.kv_block_size == 16
        assert info.default_sampling.HasField("top_p") and info.default_sampling.temperature == 0
        tok = stub.Tokenize(pb.TokenizeRequest(text="héllo wörld"), timeout=5)
        assert list(tok.token_ids) == tokenizer.encode("héllo wörld")
        assert tok.num_tokens == len(tok.token_ids)
        status = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
        assert status.num_workers == status.num_workers_ready == 1
        assert status.num_kv_blocks == info.num_kv_blocks
        assert status.num_used_kv_blocks == 0 and status.num_running == 0


def test_allowed_token_ids_through_both_apis_and_refused_by_name(server):
    """Greedy restricted to the ids equals transformers' restricted greedy, through either API;
    an id outside the vocabulary is INVALID_ARGUMENT naming the field, the value and the range."""
    target, model_dir = server
    prompt = [11, 200, 33, 4]
    free = hf_greedy(model_dir, tuple(prompt), 6).token_ids
    allowed = tuple(t for t in (2, 50, 51, 130, 260, 400, 511) if t not in free)
    ref = hf_greedy_allowed(model_dir, tuple(prompt), 6, allowed)
    with grpc.insecure_channel(target) as ch:
        ours = generation_stub(ch).Generate(pb.GenerateRequest(
            token_ids=prompt, sampling=pb.SamplingParams(allowed_token_ids=allowed),
            stopping=pb.StoppingCriteria(max_tokens=6, ignore_eos=True)), timeout=30)
        assert tuple(t for m in ours for t in m.token_ids) == ref
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        (done,) = vllm.Generate(vpb.GenerateRequest(
            request_id="a", tokenized=vpb.TokenizedInput(input_ids=prompt),
            sampling_params=vpb.SamplingParams(allowed_token_ids=allowed, temperature=0.0,
                                               max_tokens=6, ignore_eos=True)), timeout=30)
        assert tuple(done.complete.output_ids) == ref
        with pytest.raises(grpc.RpcError) as err:
            list(generation_stub(ch).Generate(pb.GenerateRequest(
                token_ids=prompt, sampling=pb.SamplingParams(allowed_token_ids=[3, 512])),
                timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("sampling.allowed_token_ids[1]=512 is invalid: must be "
                                       "in [0, 511] (vocab_size)")
        with pytest.raises(grpc.RpcError) as err:
            list(vllm.Generate(vpb.GenerateRequest(
                request_id="b", tokenized=vpb.TokenizedInput(input_ids=prompt),
                sampling_params=vpb.SamplingParams(allowed_token_ids=[600])), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("sampling_params.allowed_token_ids[0]=600 is invalid: "
                                       "must be in [0, 511] (vocab_size)")
