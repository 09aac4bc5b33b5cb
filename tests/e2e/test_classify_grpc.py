"""Classification models over gRPC, scheduler and worker as separate processes: a tiny
BertForSequenceClassification with 3 labels and one with 1 label (a cross-encoder):

  - deltaserve.v1 Classify returns transformers' softmax (and, with activation false, its
    logits) with id2label's labels; VllmEngine Embed returns the raw logits (what smg's
    /v1/classify reads); GetModelInfo says num_labels and the labels;
  - Score: 1-to-N and N-to-N pairs tokenized as transformers' pair encoding (token type 1 for
    the second text) score sigmoid(transformers' logit);
  - bad input is INVALID_ARGUMENT naming the field; Score on a 3-label model, Classify on an
    embedding server and on a generating one are FAILED_PRECONDITION; nothing is held after.
"""
from __future__ import annotations

import grpc
import pytest
import torch
import transformers as tf

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.classifier_models import (make_classifier_model, reference_logits,
                                             reference_pairs)
from tests.support.encoder_models import make_encoder_model
from tests.support.grpc_harness import generation_stub, scheduler_and_worker

FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--runner", "pooling"]
TEXTS = ["Hello world, how are you today?", "KV cache", "the quick brown fox"]
QUERY = "what is a KV cache?"
DOCS = ["a store of keys and values for attention.", "the lazy dog", "the sky is blue"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, channel) of a 3-label server, (model dir, channel) of a 1-label one."""
    root = tmp_path_factory.mktemp("classify_grpc")
    three = str(make_classifier_model(root / "three", "bert", 3))
    one = str(make_classifier_model(root / "one", "bert", 1, seed=1))
    with scheduler_and_worker(three, tmp_path_factory.mktemp("s3"), FLAGS) as (t3, _), \
            scheduler_and_worker(one, tmp_path_factory.mktemp("s1"), FLAGS) as (t1, _):
        with grpc.insecure_channel(t3) as ch3, grpc.insecure_channel(t1) as ch1:
            yield (three, ch3), (one, ch1)


def tok_ids(model, text) -> list[int]:
    return tf.AutoTokenizer.from_pretrained(model)(text)["input_ids"]


def _close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(list(got)), want, rtol=0, atol=1e-5)


def test_classify_as_transformers(served):
    (model, ch), _ = served
    stub = generation_stub(ch)
    got = stub.Classify(gpb.ClassifyRequest(request_id="c", input=TEXTS), timeout=60)
    refs = reference_logits(model, [tok_ids(model, t) for t in TEXTS])
    assert got.request_id == "c" and [d.index for d in got.data] == [0, 1, 2]
    for item, ref in zip(got.data, refs):
        _close(item.probs, torch.softmax(ref, -1))
        assert item.label == f"class-{int(ref.argmax())}" and item.num_classes == 3
    assert got.num_prompt_tokens == sum(len(tok_ids(model, t)) for t in TEXTS)
    raw = stub.Classify(gpb.ClassifyRequest(input=TEXTS[:1], activation=False), timeout=60)
    _close(raw.data[0].probs, refs[0])
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch).Embed(vpb.EmbedRequest(
        request_id="e", tokenized=vpb.TokenizedInput(original_text=TEXTS[0])), timeout=60)
    _close(vllm.embedding, refs[0])                       # the logits: smg softmaxes them
    info = stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
    assert (info.num_labels, list(info.labels)) == (3, ["class-0", "class-1", "class-2"])


def test_score_pairs_as_transformers(served):
    _, (model, ch) = served
    stub = generation_stub(ch)
    got = stub.Score(gpb.ScoreRequest(text_1=[QUERY], text_2=DOCS), timeout=60)
    ids, types = reference_pairs(model, [(QUERY, d) for d in DOCS])
    for item, ref in zip(got.data, reference_logits(model, ids, types)):
        assert abs(item.score - torch.sigmoid(ref)[0].item()) < 1e-5
    assert got.num_prompt_tokens == sum(map(len, ids))
    zipped = stub.Score(gpb.ScoreRequest(text_1=DOCS[:2], text_2=[QUERY, QUERY],
                                         activation=False), timeout=60)
    ids, types = reference_pairs(model, [(DOCS[0], QUERY), (DOCS[1], QUERY)])
    for item, ref in zip(zipped.data, reference_logits(model, ids, types)):
        assert abs(item.score - ref[0].item()) < 1e-5


@pytest.mark.parametrize("call, request_, code, says", [
    ("Classify", gpb.ClassifyRequest(), "INVALID_ARGUMENT", "input='0 texts'"),
    ("Classify", gpb.ClassifyRequest(input=["a", ""]), "INVALID_ARGUMENT",
     "input[1]='an empty text'"),
    ("Classify", gpb.ClassifyRequest(input=["word " * 200]), "INVALID_ARGUMENT",
     "input[0]="),
    ("Score", gpb.ScoreRequest(text_1=["a", "b"], text_2=["c"]), "INVALID_ARGUMENT",
     "text_2='1 texts'"),
    ("Score", gpb.ScoreRequest(text_1=["a"]), "INVALID_ARGUMENT", "text_2='no text'"),
    ("Score", gpb.ScoreRequest(text_1=["word " * 40], text_2=["word " * 40]),
     "INVALID_ARGUMENT", "pair[0]="),
])
def test_bad_input_names_the_field(served, call, request_, code, says):
    _, (_, ch) = served
    with pytest.raises(grpc.RpcError) as err:
        getattr(generation_stub(ch), call)(request_, timeout=60)
    assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
    assert says in err.value.details(), err.value.details()


def test_wrong_servers_refuse_and_nothing_is_held(served, tmp_path):
    (_, ch3), (_, ch1) = served
    with pytest.raises(grpc.RpcError) as err:
        generation_stub(ch3).Score(gpb.ScoreRequest(text_1=["a"], text_2=["b"]), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "num_labels=3" in err.value.details()
    embedder = str(make_encoder_model(tmp_path / "enc", "bert"))
    (tmp_path / "logs").mkdir()
    with scheduler_and_worker(embedder, tmp_path / "logs", FLAGS) as (target, _), \
            grpc.insecure_channel(target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            generation_stub(ch).Classify(gpb.ClassifyRequest(input=["a"]), timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model embeds; Classify needs a sequence classification" in \
            err.value.details()
    for ch in (ch1, ch3):
        status = generation_stub(ch).GetServerStatus(gpb.GetServerStatusRequest(), timeout=30)
        assert status.num_running == status.num_waiting == status.num_used_kv_blocks == 0
