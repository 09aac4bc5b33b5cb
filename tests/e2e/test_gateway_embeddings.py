"""OpenAI /v1/embeddings through the real Shepherd Model Gateway (PyPI smg 1.13.0) in front of a
`--runner pooling` replica: smg tokenizes the input and calls the vLLM engine protocol's Embed;
the vector is transformers' (last token, normalised). smg 1.13.0 sends a list of inputs as ONE
text, joined by spaces (pinned: the day it embeds each, the test says so), and refuses token-id
inputs itself. Skipped, with the reason, when `smg` cannot run."""
from __future__ import annotations

import os

import pytest
import torch

from engine_common.text.tokenizer import Tokenizer
from tests.integration.test_embeddings import expected_vectors
from tests.support.gateway import http_json, pooling_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tiny_models, tmp_path_factory):
    model = tiny_models("qwen3")
    with pooling_gateway(model, tmp_path_factory.mktemp("gateway-embeddings")) as gw:
        yield gw, model


def _embeddings(gw, model: str, given) -> tuple[int, dict]:
    return http_json(gw.port, "POST", "/v1/embeddings",
                     {"model": os.path.basename(model), "input": given})


def test_embeddings_match_transformers(gateway):
    gw, model = gateway
    status, reply = _embeddings(gw, model, "hello world")
    assert status == 200, reply
    (item,) = reply["data"]
    ids = Tokenizer.from_dir(model).encode("hello world")
    assert reply["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(item["embedding"]),
                               expected_vectors(model, [ids])[0], rtol=0, atol=1e-5)


def test_smg_joins_a_list_of_inputs_into_one_text(gateway):
    gw, model = gateway
    status, reply = _embeddings(gw, model, ["hello world", "abc"])
    assert status == 200, reply
    joined = Tokenizer.from_dir(model).encode("hello world abc")
    assert len(reply["data"]) == 1 and reply["usage"]["prompt_tokens"] == len(joined), reply
    torch.testing.assert_close(torch.tensor(reply["data"][0]["embedding"]),
                               expected_vectors(model, [joined])[0], rtol=0, atol=1e-5)
