"""Classify and Score calls within a server's limits (a scheduler and a CPU worker process,
a one-label BERT cross-encoder):

  - a call of more texts or pairs than `--max-requests-per-key` or `--max-waiting` allow at once
    is served, not RESOURCE_EXHAUSTED: a call keeps at most one running batch of its requests
    (min(max_num_seqs, the key's bound)) in flight and sends the next as one finishes, so it
    never fills the waiting queue that other callers share (before: all at once, refused);
  - each text or pair is counted in the request counters as an Embed is
    (docs/metrics.md: received = rejected + success + in flight; before: never received, so
    success outgrew received); a refused call counts one rejection.
"""
from __future__ import annotations

import grpc
import pytest
import torch

from engine_common.wire.protos import generation_pb2 as gpb
from tests.support.classifier_models import make_classifier_model, reference_logits, \
    reference_pairs
from tests.support.grpc_harness import generation_stub, scheduler_and_worker, wait_for
from tests.support.metrics_scrape import scrape
from tests.support.ports import free_port

FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--runner", "pooling",
         "--max-waiting", "4", "--max-requests-per-key", "3"]
QUERY = "what is a KV cache?"
DOCS = [f"document number {i} says {'kv ' * (i % 3)}cache" for i in range(10)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, channel, metrics port) of a one-label server with tight limits."""
    model = str(make_classifier_model(tmp_path_factory.mktemp("clf") / "one", "bert", 1))
    metrics = free_port()
    flags = FLAGS + ["--metrics-listen", f"127.0.0.1:{metrics}"]
    with scheduler_and_worker(model, tmp_path_factory.mktemp("logs"), flags) as (target, _), \
            grpc.insecure_channel(target) as ch:
        yield model, ch, metrics


def _counts(port: int) -> tuple[float, float, float]:
    s = scrape(port)
    return (s.total("deltaserve:requests_received_total"),
            s.total("deltaserve:requests_rejected_total"),
            s.total("deltaserve:request_success_total"))


def test_a_call_larger_than_the_limits_is_served(served):
    model, ch, _ = served
    stub = generation_stub(ch)
    got = stub.Score(gpb.ScoreRequest(text_1=[QUERY], text_2=DOCS), timeout=120)
    ids, types = reference_pairs(model, [(QUERY, d) for d in DOCS])
    refs = reference_logits(model, ids, types)
    assert [d.index for d in got.data] == list(range(len(DOCS)))
    for item, ref in zip(got.data, refs):
        assert abs(item.score - torch.sigmoid(ref)[0].item()) < 1e-5
    classes = stub.Classify(gpb.ClassifyRequest(input=DOCS), timeout=120)
    assert len(classes.data) == len(DOCS)
    status = stub.GetServerStatus(gpb.GetServerStatusRequest(), timeout=30)
    assert status.num_running == status.num_waiting == status.num_used_kv_blocks == 0


def test_texts_and_pairs_are_counted(served):
    _, ch, port = served
    stub = generation_stub(ch)
    received, rejected, success = _counts(port)
    stub.Classify(gpb.ClassifyRequest(input=DOCS[:3]), timeout=120)
    stub.Score(gpb.ScoreRequest(text_1=[QUERY], text_2=DOCS[:2]), timeout=120)
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(gpb.ScoreRequest(text_1=["a", "b"], text_2=["c"]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_for(lambda: _counts(port)[2] - success == 5, 30, "five successes counted")
    after = _counts(port)
    assert after[0] - received == 3 + 2 + 1
    assert after[1] - rejected == 1
    assert after[0] == after[1] + after[2]           # nothing in flight
