"""OpenAI /v1/embeddings for an encoder model (a tiny BertModel, MEAN + Normalize) through the
real Shepherd Model Gateway (PyPI smg 1.13.0) in front of a `--runner pooling` replica: smg
tokenizes the text with the model's tokenizer.json ([CLS] ... [SEP]) and calls Embed; the
vector is transformers'. Skipped, with the reason, when `smg` cannot run."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.encoder_models import make_encoder_model, reference_ids, reference_vectors
from tests.support.gateway import Gateway, Replica, http_json, require_smg
from tests.support.grpc_harness import REPO, Processes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    smg = require_smg()
    model = str(make_encoder_model(tmp_path_factory.mktemp("bert") / "bert", "bert", "MEAN"))
    log_dir = tmp_path_factory.mktemp("gateway-encoder")
    procs = Processes(log_dir)
    gw = None
    try:
        replica = Replica(procs, os.path.relpath(model, REPO), "--runner", "pooling")
        gw = Gateway(smg, [replica.url], os.path.basename(model), log_dir)
        gw.wait_healthy(1, procs=procs.procs)
        yield gw, model
    finally:
        if gw is not None:
            gw.close()
        procs.close()


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
