"""deltaserve.embedded: the ready line's commands for a --runner pooling server name the RPCs and
the OpenAI route that server answers (a classifier's Classify, Score and /v1/classify; an
embedder's Embed and /v1/embeddings), with TLS and keys when the ports have them."""
from __future__ import annotations

from types import SimpleNamespace

from deltaserve.embedded import _pooling_examples

PLAIN = SimpleNamespace(tls_cert=None, api_key_file=None)


def test_a_classifier_server_suggests_classify_score_and_its_route():
    text = _pooling_examples("127.0.0.1:5", PLAIN, "rr", "http://h:8/v1", False, True)
    assert "deltaserve.v1.Generation/Classify" in text and "Generation/Score" in text
    assert "http://h:8/v1/classify" in text and '"model": "rr"' in text
    assert "Generate" not in text and "Embed" not in text


def test_an_embedding_server_suggests_embed_with_its_keys_and_tls():
    api = SimpleNamespace(tls_cert="c.pem", api_key_file="k")
    text = _pooling_examples("h:5", api, "e", "https://h:8/v1", True, False)
    assert "-cacert CA.pem -H 'authorization: Bearer KEY'" in text
    assert "Generation/Embed" in text and "curl -k https://h:8/v1/embeddings" in text
    assert "Classify" not in text and text.count("Bearer KEY") == 2
    assert "/v1/" not in _pooling_examples("h:5", PLAIN, "e", None, False, False)
