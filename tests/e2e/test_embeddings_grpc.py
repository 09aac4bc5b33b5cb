"""Embeddings over gRPC with the scheduler and a worker as separate processes (`deltaserve
scheduler --runner pooling`, `deltaserve worker`): the vLLM engine protocol's Embed returns
transformers' vectors for token ids and for text, chunked (a budget of 16 tokens) and with
prefix-cache hits; bad input is INVALID_ARGUMENT naming the field, Generate on a pooling server
and Embed on a generating one FAILED_PRECONDITION naming the runner; nothing is held after."""
from __future__ import annotations

import grpc
import pytest
import torch

from engine_common.text.tokenizer import Tokenizer
from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.integration.test_embeddings import expected_vectors
from tests.support.grpc_harness import generation_stub, greedy_request, scheduler_and_worker

FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    model = tiny_models("qwen3")
    with scheduler_and_worker(model, tmp_path_factory.mktemp("embed_grpc"),
                              [*FLAGS, "--runner", "pooling"]) as (target, _):
        with grpc.insecure_channel(target) as ch:
            yield model, ch


def _embed(ch, **tokenized) -> vpb.EmbedResponse:
    return vllm_engine_pb2_grpc.VllmEngineStub(ch).Embed(
        vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(**tokenized)), timeout=60)


def test_embed_matches_transformers(served):
    model, ch = served
    prompts = [list(range(3, 40)), [11, 12, 13], [42]]
    expected = expected_vectors(model, prompts)
    for _ in range(2):             # the second time from the prefix cache (LAST pooling)
        for ids, want in zip(prompts, expected):
            got = _embed(ch, input_ids=ids)
            assert (got.prompt_tokens, got.embedding_dim) == (len(ids), want.shape[0])
            torch.testing.assert_close(torch.tensor(list(got.embedding)), want, rtol=0,
                                       atol=1e-5)
    text = "hello embeddings"
    ids = Tokenizer.from_dir(model).encode(text)
    got = _embed(ch, original_text=text)
    assert got.prompt_tokens == len(ids)
    torch.testing.assert_close(torch.tensor(list(got.embedding)),
                               expected_vectors(model, [ids])[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokenized, field", [
    ({}, "tokenized"),
    ({"input_ids": [3, 10**6]}, "tokenized.input_ids"),
    ({"input_ids": list(range(3, 132))}, "tokenized"),    # 129 tokens: max_model_len 128
])
def test_bad_input_is_invalid_argument(served, tokenized, field):
    _, ch = served
    with pytest.raises(grpc.RpcError) as err:
        _embed(ch, **tokenized)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_generate_on_a_pooling_server_is_refused(served):
    _, ch = served
    with pytest.raises(grpc.RpcError) as err:
        list(generation_stub(ch).Generate(greedy_request([5, 6, 7], 4), timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--runner pooling; Generate needs --runner generate" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(vpb.GenerateRequest(
            request_id="g", tokenized=vpb.TokenizedInput(input_ids=[5, 6]),
            sampling_params=vpb.SamplingParams(max_tokens=2)), timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # still serving embeddings after the refusals, with nothing held
    assert _embed(ch, input_ids=[5, 6, 7]).embedding_dim > 0
    status = generation_stub(ch).GetServerStatus(gpb.GetServerStatusRequest(), timeout=30)
    assert status.num_running == status.num_waiting == status.num_used_kv_blocks == 0


def test_deltaserve_v1_embed(served):
    """Our own API's Embed: the same vectors; the runner in GetModelInfo; bad input named."""
    model, ch = served
    stub = generation_stub(ch)
    info = stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
    assert (info.runner, info.pooling_type, info.pooling_normalize) == ("pooling", "LAST", True)
    ids = [5, 9, 200, 31, 7]
    got = stub.Embed(gpb.EmbedRequest(request_id="mine", token_ids=ids), timeout=60)
    assert (got.request_id, got.num_prompt_tokens) == ("mine", len(ids))
    torch.testing.assert_close(torch.tensor(list(got.embedding)),
                               expected_vectors(model, [ids])[0], rtol=0, atol=1e-5)
    text = stub.Embed(gpb.EmbedRequest(text="hello embeddings"), timeout=60)
    assert len(text.request_id) == 32 and text.num_prompt_tokens > 0
    for req, field in ((gpb.EmbedRequest(), "prompt"),
                       (gpb.EmbedRequest(text="a", token_ids=[5]), "prompt"),
                       (gpb.EmbedRequest(token_ids=[5, 10**6]), "token_ids"),
                       (gpb.EmbedRequest(text="x" * 10**6), "text")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
