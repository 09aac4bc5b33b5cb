"""An encoder embedding model (a tiny BertModel with MEAN pooling and Normalize in its
sentence-transformers files) over gRPC, scheduler and worker as separate processes: both
protocols' Embed return transformers' vectors, by ids and by text (tokenized as transformers'
tokenizer: [CLS] ... [SEP]); a prompt of max_model_len tokens is served, longer ones and ones
past the step's token budget are INVALID_ARGUMENT naming the limit; Generate is
FAILED_PRECONDITION; `--runner generate` is refused at start; nothing is held after."""
from __future__ import annotations

import grpc
import pytest
import torch

from deltaserve import cli
from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.encoder_models import (MAX_POSITIONS, make_encoder_model, reference_ids,
                                          reference_vectors)
from tests.support.grpc_harness import generation_stub, greedy_request, scheduler_and_worker

BUDGET = 48
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", str(BUDGET), "--runner", "pooling"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(make_encoder_model(tmp_path_factory.mktemp("bert") / "m", "bert", "MEAN"))


@pytest.fixture(scope="module")
def served(bert, tmp_path_factory):
    with scheduler_and_worker(bert, tmp_path_factory.mktemp("encoder_grpc"), FLAGS) as (t, _):
        with grpc.insecure_channel(t) as ch:
            yield bert, ch


def _vllm_embed(ch, **tokenized) -> vpb.EmbedResponse:
    return vllm_engine_pb2_grpc.VllmEngineStub(ch).Embed(
        vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(**tokenized)), timeout=60)


def _close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(list(got)), want, rtol=0, atol=1e-5)


def test_both_protocols_embed_as_transformers(served):
    model, ch = served
    texts = ["Hello world, how are you today?", "KV cache"]
    ids = reference_ids(model, texts)
    prompts = ids + [[7] * BUDGET]
    want = reference_vectors(model, prompts, "MEAN", True)
    for p, w in zip(prompts, want):
        got = _vllm_embed(ch, input_ids=p)
        assert (got.prompt_tokens, got.embedding_dim) == (len(p), 64)
        _close(got.embedding, w)
        mine = generation_stub(ch).Embed(gpb.EmbedRequest(token_ids=p), timeout=60)
        _close(mine.embedding, w)
    for text, p, w in zip(texts, ids, want):
        got = _vllm_embed(ch, original_text=text)
        assert got.prompt_tokens == len(p)             # [CLS] ... [SEP], as transformers
        _close(got.embedding, w)
        mine = generation_stub(ch).Embed(gpb.EmbedRequest(text=text), timeout=60)
        assert mine.num_prompt_tokens == len(p)
        _close(mine.embedding, w)
    info = generation_stub(ch).GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
    assert (info.runner, info.pooling_type, info.pooling_normalize) == ("pooling", "MEAN", True)


@pytest.mark.parametrize("ids, says", [
    ([5] * (MAX_POSITIONS + 1), f"at most {MAX_POSITIONS} tokens (max_model_len"),
    ([5] * (BUDGET + 1), f"at most {BUDGET} tokens (max_num_batched_tokens {BUDGET}"),
])
def test_prompts_past_a_limit_are_refused_naming_it(served, ids, says):
    _, ch = served
    with pytest.raises(grpc.RpcError) as err:
        _vllm_embed(ch, input_ids=ids)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"tokenized={len(ids)} tokens") or \
        f"{len(ids)} tokens" in err.value.details(), err.value.details()
    assert says in err.value.details(), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generation_stub(ch).Embed(gpb.EmbedRequest(token_ids=ids), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()


def test_generate_is_refused_and_nothing_is_held(served):
    _, ch = served
    with pytest.raises(grpc.RpcError) as err:
        list(generation_stub(ch).Generate(greedy_request([5, 6, 7], 4), timeout=60))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _vllm_embed(ch, input_ids=[2, 5, 3]).embedding_dim == 64
    status = generation_stub(ch).GetServerStatus(gpb.GetServerStatusRequest(), timeout=30)
    assert status.num_running == status.num_waiting == status.num_used_kv_blocks == 0


def test_runner_generate_is_refused_at_start(bert, capsys):
    argv = ["scheduler", "--model", bert, "--workers", "127.0.0.1:1", "--listen", "127.0.0.1:0"]
    assert cli.main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--runner='generate'" in line and "BertModel is an encoder" in line, line
