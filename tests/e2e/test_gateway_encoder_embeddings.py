"""OpenAI /v1/embeddings for an encoder model (a tiny BertModel, MEAN + Normalize) through the
real Shepherd Model Gateway (PyPI smg 1.13.0) in front of a `--runner pooling` replica: smg
tokenizes the text with the model's tokenizer.json ([CLS] ... [SEP]) and calls Embed; the
vector is transformers'. Skipped, with the reason, when `smg` cannot run."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.encoder_models import make_encoder_model, reference_ids, reference_vectors
from tests.support.gateway import http_json, pooling_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    model = str(make_encoder_model(tmp_path_factory.mktemp("bert") / "bert", "bert", "MEAN"))
    with pooling_gateway(model, tmp_path_factory.mktemp("gateway-encoder")) as gw:
        yield gw, model


def test_embeddings_match_transformers(gateway):
    gw, model = gateway
    text = "Hello world, how are you today?"
    status, reply = http_json(gw.port, "POST", "/v1/embeddings",
                              {"model": os.path.basename(model), "input": text})
    assert status == 200, reply
    (item,) = reply["data"]
    ids = reference_ids(model, [text])
    assert reply["usage"]["prompt_tokens"] == len(ids[0])
    torch.testing.assert_close(torch.tensor(item["embedding"]),
                               reference_vectors(model, ids, "MEAN", True)[0], rtol=0, atol=1e-5)
