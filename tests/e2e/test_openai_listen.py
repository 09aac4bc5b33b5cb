"""`deltaserve serve --host/--port`: the OpenAI-compatible API from one command, the real smg
gateway as a supervised child (skipped, with the reason, where its binary cannot run):

  * the ready line names both APIs and its curl command answers as printed (with the key);
  * vLLM's --tensor-parallel-size and --served-model-name: /v1/models lists the served name;
    a second name is served as an alias, answered under the first; a second --api-key admits;
  * the gateway's log lines are folded into ours with an `[smg] ` prefix;
  * VLLM_API_KEY without --api-key guards them as the key (a key starting with '-' too);
  * --api-key guards the generating endpoints (401 without it; smg 1.13.0 leaves /v1/models
    open);
  * Ctrl-C stops the gateway and the worker with the server (exit 0), the gateway before the
    scheduler drains; a gateway that dies stops the whole group (exit 1, saying why);
  * `deltaserve scheduler --host/--port` fronts itself the same way.
"""
from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.gateway import chat_model_dir, http_json, require_smg
from tests.support.grpc_harness import SMALL_KV_GIB, Processes, free_port, wait_for
from tests.support.serve_process import ServeProcess, children, gone

pytestmark = pytest.mark.slow

KEY = "openai-test-key-0123456789"
KEY2 = "openai-second-key"


def _chat_with_key(port: int, request: dict, key: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(request),
                     {"content-type": "application/json", "authorization": f"Bearer {key}"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


def _children(pid: int) -> dict[str, int]:
    """{"smg": pid, "worker": pid} of the serve process."""
    out = {}
    for child in children(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()   # smg retitles itself
        out["worker" if b"deltaserve.cli\0worker" in cmdline else "smg"] = child
    return out


class Serve(ServeProcess):
    """The chat model on free loopback ports, with the OpenAI API on --host/--port."""

    def __init__(self, model_dir: Path, log: Path, *flags: str, env: dict | None = None):
        require_smg()
        self.port, self.openai_port = free_port(), free_port()
        super().__init__(log, ["--model", str(model_dir), "--listen", f"127.0.0.1:{self.port}",
                               "--worker-listen", f"127.0.0.1:{free_port()}", "--device", "cpu",
                               "--kv-cache-gib", SMALL_KV_GIB, "--metrics-listen", "off",
                               "--host", "127.0.0.1", "--port", str(self.openai_port), *flags],
                         env)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    return chat_model_dir(tiny_models("qwen3"), tmp_path_factory.mktemp("chat") / "tiny-chat")


def test_serve_with_host_and_port_answers_openai_and_stops_as_a_group(chat_model, tmp_path):
    # A grace period longer than the test's wait: the gateway's KV-event stream must not hold
    # the drain (it ends when the gateway exits, which the drain does not wait on).
    serve = Serve(chat_model, tmp_path / "serve.log", "--api-key", KEY, KEY2,
                  "--tensor-parallel-size", "1", "--served-model-name", "my-model", "my-alias",
                  "--grace-period", "600")
    try:
        text = serve.wait_ready(240)
        url = f"http://127.0.0.1:{serve.openai_port}/v1"
        assert f"DeltaServe ready on 127.0.0.1:{serve.port}, OpenAI API on {url}" in text
        assert "\n[smg] " in text          # its log, folded into ours
        (curl,) = [line.strip() for line in text.splitlines() if line.strip().startswith("curl")]
        done = subprocess.run(shlex.split(curl.replace("Bearer KEY", f"Bearer {KEY}")),
                              capture_output=True, text=True, timeout=120)
        answer = json.loads(done.stdout)
        assert answer["object"] == "chat.completion", done.stdout
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] >= 1

        status, models = http_json(serve.openai_port, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["my-model"], models
        request = {"model": "my-model", "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}
        status, body = http_json(serve.openai_port, "POST", "/v1/chat/completions", request)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        status, body = _chat_with_key(serve.openai_port, {**request, "model": "my-alias"}, KEY2)
        assert (status, body.get("model")) == (200, "my-model"), body

        children = _children(serve.proc.pid)
        assert set(children) == {"smg", "worker"}
        serve.proc.send_signal(signal.SIGINT)       # what Ctrl-C delivers
        assert serve.proc.wait(60) == 0, serve.text()
        assert all(gone(pid) for pid in children.values())
        # The gateway (the front) stops while the scheduler drains (its OpenAI streams are the
        # drain's to finish), and is gone before the worker stops.
        out = serve.text()
        draining = out.index("draining (grace period 600.0 s;")
        assert draining < out.index("[smg] ", draining), out[-3000:]
        assert out.index("Process exiting.") < out.index("stopping worker"), out[-3000:]
    finally:
        serve.close()


def test_vllm_api_key_from_the_environment_guards_the_api_even_starting_with_a_dash(
        chat_model, tmp_path):
    """`VLLM_API_KEY=-... vllm serve M` (no --api-key; secrets.token_urlsafe starts a key with
    '-' one time in 64): the API is guarded by that key, and the gateway starts with it."""
    dash_key = "-dash-key_0123"
    serve = Serve(chat_model, tmp_path / "serve.log", env={"VLLM_API_KEY": dash_key})
    try:
        serve.wait_ready(240)
        request = {"model": chat_model.name, "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}
        status, body = http_json(serve.openai_port, "POST", "/v1/chat/completions", request)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        status, body = _chat_with_key(serve.openai_port, request, dash_key)
        assert status == 200 and body["choices"][0]["message"]["content"], body
    finally:
        serve.close()


def test_a_gateway_that_dies_stops_the_group_and_says_why(chat_model, tmp_path):
    serve = Serve(chat_model, tmp_path / "serve.log")
    try:
        serve.wait_ready()
        children = _children(serve.proc.pid)
        subprocess.run(["kill", "-KILL", str(children["smg"])], check=True)
        assert serve.proc.wait(60) == 1, serve.text()
        assert "the OpenAI gateway (smg) exited with code -9" in serve.text()
        wait_for(lambda: gone(children["worker"]), 30, "the worker to stop with the group")
    finally:
        serve.close()


def test_the_scheduler_command_fronts_itself_when_given_a_port(chat_model, tmp_path):
    """`deltaserve scheduler --port P`: off by default there, on when asked; the gateway's
    /v1/models lists the served name and its exit stops the scheduler."""
    require_smg()
    procs = Processes(tmp_path)
    try:
        worker_port, port, openai_port = free_port(), free_port(), free_port()
        procs.worker(worker_port)
        scheduler = procs.scheduler(str(chat_model), [worker_port], port, "--host", "127.0.0.1",
                                    "--port", str(openai_port), "--served-model-name", "dp-1")
        url = f"http://127.0.0.1:{openai_port}/v1"
        wait_for(lambda: f"OpenAI API ready on {url}" in scheduler.log_tail(10**6), 240,
                 "the OpenAI ready line", procs.procs)
        status, models = http_json(openai_port, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["dp-1"], models
        (smg,) = children(scheduler.pid)
        os.kill(smg, signal.SIGKILL)
        assert scheduler.popen.wait(60) == 1
        assert "the OpenAI gateway (smg) exited with code -9" in scheduler.log_tail(10**6)
    finally:
        procs.close()
