"""Score calls against a key's bound and a call's token limit (a scheduler and a CPU worker
process, a one-label BERT cross-encoder, --max-requests-per-key 3):

  - two Score calls of one caller at once: each takes the places the key has left when it
    starts (its window), so the one that finds none is RESOURCE_EXHAUSTED at once, naming the
    bound, as a Generate of the key would be (session 46: before, its requests waited for
    places while the key's Generates were refused); a refused call made again once the other
    ended is served, and every score equals transformers' (before session 45, each call sized
    its window to the whole bound, and the second's requests failed mid-call);
  - calls of one caller with the same request_id run side by side (no per-key bound): each
    call's engine ids are its own (before: all `x-<i>`, the second refused as a live id);
  - a call whose pairs pass --max-score-tokens together is INVALID_ARGUMENT naming text_2,
    the count and the limit.
"""
from __future__ import annotations

import threading

import grpc
import pytest
import torch

from engine_common.wire.protos import generation_pb2 as gpb
from tests.support.classifier_models import make_classifier_model, reference_logits, \
    reference_pairs
from tests.support.grpc_harness import generation_stub, scheduler_and_worker

MAX_SCORE_TOKENS = 2000
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--runner", "pooling",
         "--max-requests-per-key", "3", "--max-score-tokens", str(MAX_SCORE_TOKENS)]
QUERY = "what is a KV cache?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, stub) of a one-label server with a bound of 3 for the one caller."""
    model = str(make_classifier_model(tmp_path_factory.mktemp("clf") / "one", "bert", 1))
    with scheduler_and_worker(model, tmp_path_factory.mktemp("logs"), FLAGS) as (target, _), \
            grpc.insecure_channel(target) as ch:
        yield model, generation_stub(ch)


def test_two_calls_of_one_caller_take_or_are_refused_its_places(served):
    model, stub = served
    docs = {c: [f"call {c} document {i} says {'kv ' * (i % 3)}cache" for i in range(48)]
            for c in "ab"}
    got, refused = {}, []

    def score(call: str) -> None:
        try:
            got[call] = stub.Score(gpb.ScoreRequest(request_id="x", text_1=[QUERY],
                                                    text_2=docs[call]), timeout=300)
        except grpc.RpcError as e:          # checked below, with the call
            refused.append((call, e.code(), e.details()))

    threads = [threading.Thread(target=score, args=(c,)) for c in docs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) >= 1, refused
    for call, code, details in list(refused):
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "<= 3 (--max-requests-per-key)" in details
        score(call)                         # the other call has ended: served now
    assert sorted(got) == ["a", "b"], refused
    for call, texts in docs.items():
        ids, types = reference_pairs(model, [(QUERY, d) for d in texts])
        want = [torch.sigmoid(r)[0].item() for r in reference_logits(model, ids, types)]
        assert got[call].request_id == "x"
        torch.testing.assert_close(torch.tensor([d.score for d in got[call].data]),
                                   torch.tensor(want), rtol=0, atol=1e-5)
    status = stub.GetServerStatus(gpb.GetServerStatusRequest(), timeout=30)
    assert status.num_running == status.num_waiting == 0


def test_a_call_past_the_token_limit_is_refused(served):
    _, stub = served
    docs = [f"document number {i} is about the cache of keys and values" for i in range(200)]
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(gpb.ScoreRequest(text_1=[QUERY], text_2=docs), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith("text_2=") and "tokens in the first" in details
    assert f"at most {MAX_SCORE_TOKENS} tokens" in details and "--max-score-tokens" in details
    assert len(stub.Score(gpb.ScoreRequest(text_1=[QUERY], text_2=docs[:20]),
                          timeout=120).data) == 20


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
    """(model dir, stub) of the same model with no per-key bound: a call's window is a batch."""
    model = str(make_classifier_model(tmp_path_factory.mktemp("clf") / "one", "bert", 1))
    flags = FLAGS[:FLAGS.index("--max-requests-per-key")]
    with scheduler_and_worker(model, tmp_path_factory.mktemp("logs"), flags) as (target, _), \
            grpc.insecure_channel(target) as ch:
        yield model, generation_stub(ch)


def test_calls_with_one_request_id_run_side_by_side(unbounded):
    """Each call's first batch starts at once: with ids `x-<i>` the second's were the first's
    live ids (refused: already known); now each call's ids are its own."""
    model, stub = unbounded
    texts = [f"document {i} says {'kv ' * (i % 3)}cache" for i in range(16)]
    calls = [stub.Score.future(gpb.ScoreRequest(request_id="x", text_1=[QUERY], text_2=texts),
                               timeout=300) for _ in range(4)]
    ids, types = reference_pairs(model, [(QUERY, d) for d in texts])
    want = torch.tensor([torch.sigmoid(r)[0].item() for r in reference_logits(model, ids, types)])
    for call in calls:
        got = call.result()
        torch.testing.assert_close(torch.tensor([d.score for d in got.data]), want,
                                   rtol=0, atol=1e-5)
