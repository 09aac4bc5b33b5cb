"""`deltaserve serve --model org/name`: the tiny model laid out in a Hugging Face hub cache
(built here, no network) is served by its id, under that name; an id that is not cached, with
HF_HUB_OFFLINE set, stops `serve` in one line naming the download command."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.support.grpc_harness import (REPO, SMALL_KV_GIB, child_env, free_port,
                                        generation_stub, pb, wait_for)
from tests.support.hub_cache import build_hub_cache

pytestmark = pytest.mark.slow
REPO_ID = "deltaserve-tests/tiny-qwen3"


def _serve(env: dict, *flags: str) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--model", REPO_ID,
           "--worker-listen", f"127.0.0.1:{free_port()}", "--device", "cpu",
           "--kv-cache-gib", SMALL_KV_GIB, "--metrics-listen", "off", "--openai-listen", "off",
           *flags]
    return cmd, child_env({"HF_HUB_OFFLINE": "1", **env})


def test_a_hub_id_in_the_local_cache_is_served_under_its_id(tiny_models, tmp_path):
    build_hub_cache(tmp_path / "hub", REPO_ID, model_dir=Path(tiny_models("qwen3")))
    port = free_port()
    cmd, env = _serve({"HF_HUB_CACHE": str(tmp_path / "hub")}, "--listen", f"127.0.0.1:{port}")
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        def ready():
            assert proc.poll() is None, log.read_text(errors="replace")
            return "DeltaServe ready on" in log.read_text(errors="replace")
        wait_for(ready, 180, "the ready line")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = generation_stub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.model_name == REPO_ID
    finally:
        proc.kill()
        proc.wait()


def test_a_missing_hub_id_offline_names_the_download_command(tmp_path):
    cmd, env = _serve({"HF_HUB_CACHE": str(tmp_path / "empty")}, "--listen",
                      f"127.0.0.1:{free_port()}")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"`hf download {REPO_ID}`" in done.stderr and "HF_HUB_OFFLINE" in done.stderr
