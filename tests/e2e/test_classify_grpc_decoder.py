"""Score on a decoder cross-encoder (a one-label Qwen3ForSequenceClassification, whose pairs
use the KV cache) over gRPC, scheduler and worker as separate processes, with two API keys:

  - a Score cancelled by its client while its pairs run gives every KV block back and leaves
    nothing running or waiting;
  - two tenants scoring at once with the same request_id each get their own scores (the
    pairs' ids are scoped by key), equal to transformers'.
"""
from __future__ import annotations

import threading

import grpc
import pytest
import torch

from engine_common.wire.protos import generation_pb2 as gpb
from tests.support.classifier_models import make_classifier_model, reference_logits, \
    reference_pairs
from tests.support.grpc_harness import bearer, generation_stub, scheduler_and_worker, wait_for

KEYS = ("alice-key-0123456789abcdef", "bob-key-0123456789abcdef")
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--runner", "pooling"]
QUERY = "what is a KV cache?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("dec")
    model = str(make_classifier_model(root / "qwen3", "qwen3", 1))
    keys = root / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    flags = FLAGS + ["--api-key-file", str(keys)]
    with scheduler_and_worker(model, root, flags) as (target, _), \
            grpc.insecure_channel(target) as ch:
        yield model, generation_stub(ch)


def _status(stub) -> gpb.GetServerStatusResponse:
    return stub.GetServerStatus(gpb.GetServerStatusRequest(), metadata=bearer(KEYS[0]),
                                timeout=30)


def test_a_cancelled_score_gives_back_every_block(served):
    _, stub = served
    docs = [f"document {i}: " + "keys and values " * 6 for i in range(512)]
    call = stub.Score.future(gpb.ScoreRequest(text_1=[QUERY], text_2=docs),
                             metadata=bearer(KEYS[0]), timeout=300)
    wait_for(lambda: _status(stub).num_used_kv_blocks > 0 or call.done(), 60,
             "the Score's pairs holding KV blocks")
    assert not call.done(), "the Score ended before it could be cancelled"
    call.cancel()
    wait_for(lambda: (lambda s: s.num_used_kv_blocks == s.num_running == s.num_waiting == 0)(
        _status(stub)), 60, "every block back after the cancel")
    assert call.cancelled()


def test_tenants_with_the_same_request_id_get_their_own_scores(served):
    model, stub = served
    docs = {KEYS[0]: ["the sky is blue", "a fox"], KEYS[1]: ["keys and values", "cache"]}
    got, errors = {}, []

    def score(key: str) -> None:
        try:
            got[key] = stub.Score(gpb.ScoreRequest(request_id="same", text_1=[QUERY],
                                                   text_2=docs[key]),
                                  metadata=bearer(key), timeout=120)
        except grpc.RpcError as e:          # reported below, with the key
            errors.append((key, e.code(), e.details()))

    threads = [threading.Thread(target=score, args=(k,)) for k in KEYS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for key in KEYS:
        ids, _ = reference_pairs(model, [(QUERY, d) for d in docs[key]])
        want = [torch.sigmoid(r)[0].item() for r in reference_logits(model, ids)]
        torch.testing.assert_close(torch.tensor([d.score for d in got[key].data]),
                                   torch.tensor(want), rtol=0, atol=1e-5)
