"""OpenAI /v1/classify of a classification model (a tiny BertForSequenceClassification, 3
labels) through the real Shepherd Model Gateway (PyPI smg 1.13.0) in front of a `--runner
pooling` replica: smg tokenizes the text, calls Embed (our reply: the logits) and applies the
softmax itself; the probabilities are transformers'. smg 1.13.0 labels classes LABEL_i (the
vLLM protocol's GetModelInfo carries no id2label), serves no /v1/score or /v2/rerank (404)
and answers /v1/rerank and /rerank with 501 "Rerank not implemented" for a gRPC worker: each
pinned here, so a gateway that routes them turns this red (docs/scoring.md). Skipped, with the
reason, when `smg` cannot run."""
from __future__ import annotations

import http.client
import json
import os

import pytest
import torch
import transformers as tf

from tests.support.classifier_models import make_classifier_model, reference_logits
from tests.support.gateway import http_json, pooling_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    model = str(make_classifier_model(tmp_path_factory.mktemp("clf") / "clf", "bert", 3))
    with pooling_gateway(model, tmp_path_factory.mktemp("gateway-classify")) as gw:
        yield gw, model


def test_classify_matches_transformers(gateway):
    gw, model = gateway
    text = "Hello world, how are you today?"
    status, reply = http_json(gw.port, "POST", "/v1/classify",
                              {"model": os.path.basename(model), "input": text})
    assert status == 200, reply
    (item,) = reply["data"]
    ids = tf.AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    (ref,) = reference_logits(model, [ids])
    assert reply["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(item["probs"]), torch.softmax(ref, -1), rtol=0,
                               atol=1e-5)
    assert item["label"] == f"LABEL_{int(ref.argmax())}" and item["num_classes"] == 3


@pytest.mark.parametrize("path, status, says", [
    ("/v1/score", 404, b"Invalid URL"), ("/v2/rerank", 404, b"Invalid URL"),
    ("/v1/rerank", 501, b"Rerank not implemented"), ("/rerank", 501, b"Rerank not implemented"),
])
def test_smg_routes_no_score_or_rerank_to_a_grpc_worker(gateway, path, status, says):
    gw, model = gateway
    body = {"model": os.path.basename(model), "query": "a", "documents": ["b", "c"],
            "text_1": "a", "text_2": ["b", "c"]}
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert (resp.status, says in resp.read()) == (status, True)
    finally:
        conn.close()
