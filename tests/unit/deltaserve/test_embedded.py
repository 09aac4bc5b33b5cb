"""deltaserve.embedded: the ready line's commands for a --runner pooling server name the RPCs and
the OpenAI route that server answers (a classifier's Classify, Score and /v1/classify; an
embedder's Embed and /v1/embeddings), with TLS and keys when the ports have them."""
from __future__ import annotations

import socket
import sys
from types import SimpleNamespace

import pytest

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


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is 3.11's")
def test_the_worker_ignores_modules_left_in_the_working_directory(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: a json.py or argparse.py that
    another local user left in serve's working directory (/tmp) ran inside the worker."""
    from deltaserve.embedded import start_worker, stop_worker
    from engine_common.configuration.config import WorkerServiceOptions
    from tests.support.grpc_harness import free_port, wait_for

    planted, ran = tmp_path / "cwd", tmp_path / "planted-ran"
    planted.mkdir()
    for name in ("json.py", "argparse.py"):
        (planted / name).write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit(9)\n")
    monkeypatch.chdir(planted)
    port = free_port()
    proc = start_worker(f"127.0.0.1:{port}", WorkerServiceOptions(device="cpu"), "t" * 32)
    def listening_or_gone() -> bool:               # listening: past every import
        if proc.poll() is not None:
            return True
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    try:
        wait_for(listening_or_gone, 300, "the worker to listen or exit")
        assert proc.poll() is None and not ran.exists(), proc.returncode
    finally:
        stop_worker(proc)
