"""The bar of the real default model, through real processes: `deltaserve serve` with no --model
serves SmolLM2-135M-Instruct; `deltaserve chat "What is the capital of France?"` names Paris;
grpcurl with `messages` streams the same answer; chat-templated greedy tokens over gRPC equal
transformers'; a GGUF path serves the same tokens as the converted directory; the interactive
chat keeps going after Ctrl-C; a TP size that does not fit the 9 heads is refused in one line.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from deltaserve.default_model import default_gguf_path
from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (REPO, Processes, child_env, collect, free_port,
                                        generation_stub, grpcurl, json_stream, server_status,
                                        wait_for)
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy
from tests.support.serve_process import GrpcServe
from tests.support.real_model import (CHATS, FRANCE_ANSWER, FRANCE_ANSWER_IDS,
                                      hf_chat_ids)

pytestmark = pytest.mark.slow
MAX_NEW = 24


def _cli(*args: str, timeout: float = 300, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "deltaserve.cli", *args], cwd=REPO,
                          env=child_env(None), capture_output=True, text=True,
                          timeout=timeout, input=stdin)


def _chat_request(chat, max_tokens: int, ignore_eos: bool = False) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in chat],
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens,
                                                           ignore_eos=ignore_eos))


def test_serve_without_model_serves_the_default_and_says_how_to_chat(served, default_model):
    text = served.ready_text
    assert f"DeltaServe ready on {served.target} (model {default_model})" in text
    assert f'deltaserve chat --target {served.target} "What is the capital of France?"' in text
    assert "RANDOM" not in text


def test_chat_one_shot_names_paris(served):
    proc = _cli("chat", "--target", served.target, "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == FRANCE_ANSWER


def test_grpcurl_messages_stream_the_same_answer(served):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stopping": {"max_tokens": 32}}
    proc = grpcurl("-d", json.dumps(body), served.target,
                   "deltaserve.v1.Generation/Generate", timeout=300)
    assert proc.returncode == 0, proc.stderr
    msgs = json_stream(proc.stdout)
    assert len(msgs) > 1                                          # streamed, not one reply
    assert "".join(m.get("text", "") for m in msgs) == FRANCE_ANSWER
    assert [t for m in msgs for t in m.get("tokenIds", [])] == FRANCE_ANSWER_IDS
    assert msgs[-1]["finishReason"] == "STOP_TOKEN"


def test_chat_greedy_tokens_over_grpc_equal_transformers(served, default_model):
    near_ties, failures = [], []
    with grpc.insecure_channel(served.target) as ch:
        stub = generation_stub(ch)
        for i, chat in enumerate(CHATS):
            prompt = hf_chat_ids(default_model, chat)
            tok = stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in chat]),
                                timeout=60)
            assert list(tok.token_ids) == prompt
            ids, _, msgs = collect(stub.Generate(_chat_request(chat, MAX_NEW, True), timeout=300))
            assert msgs[-1].usage.prompt_tokens == len(prompt)
            failure = compare_greedy(f"grpc chat{i}", ids,
                                     hf_greedy(default_model, tuple(prompt), MAX_NEW), near_ties)
            if failure:
                failures.append(failure)
    assert_greedy_agrees(failures, near_ties)


def test_generate_with_raw_text_warns_once(served):
    proc = _cli("generate", "--target", served.target, "What is the capital of France?",
                "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("has a chat template, but this prompt is raw text") == 1
    assert "deltaserve chat" in proc.stderr


def test_interactive_chat_keeps_history_and_survives_ctrl_c(served):
    chat = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "chat", "--target",
                             served.target, "--max-tokens", "400"], cwd=REPO,
                            env=child_env(None), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: chat.stdout.read(1), "")),
                              daemon=True)
    reader.start()
    try:
        wait_for(lambda: "Chatting with SmolLM2-135M-Instruct" in "".join(out), 60, "banner")
        chat.stdin.write("Write a long story about a dragon who learns to bake bread.\n")
        chat.stdin.flush()
        start = len("".join(out))
        wait_for(lambda: len("".join(out)) > start + 40, 300, "the answer to stream")
        chat.send_signal(signal.SIGINT)                        # Ctrl-C: cancel this answer
        wait_for(lambda: "(answer cancelled" in "".join(out), 60, "the cancellation")
        wait_for(lambda: server_status(served.target).num_running == 0, 60,
                 "the server to drop the cancelled request")
        chat.stdin.write("What is the capital of France?\n")
        chat.stdin.flush()
        wait_for(lambda: FRANCE_ANSWER in "".join(out), 300, "the next answer")
        chat.stdin.close()                                     # Ctrl-D leaves
        assert chat.wait(60) == 0
    except AssertionError as e:                                # say what the chat printed
        raise AssertionError(f"{e}\n--- chat output (last 3000 characters):\n"
                             f"{''.join(out)[-3000:]}") from None
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()


def test_a_gguf_path_serves_the_same_tokens_as_the_converted_directory(served, tmp_path):
    gguf_server = GrpcServe(tmp_path / "gguf.log", "--model", str(default_gguf_path()))
    try:
        text = gguf_server.wait_ready()
        assert "SmolLM2-135M-Instruct.Q4_1.gguf" in text
        for chat in CHATS[:2]:
            got = {}
            for name, target in (("gguf", gguf_server.target), ("dir", served.target)):
                with grpc.insecure_channel(target) as ch:
                    got[name] = collect(generation_stub(ch).Generate(
                        _chat_request(chat, 16, True), timeout=300))[:2]
            assert got["gguf"] == got["dir"]
    finally:
        gguf_server.stop()


def test_tp_size_that_does_not_fit_the_heads_is_refused_in_one_line(default_model):
    proc = _cli("serve", "--device", "cpu", "--local-ranks", "2", "--listen",
                f"127.0.0.1:{free_port()}", "--worker-listen", f"127.0.0.1:{free_port()}",
                "--openai-listen", "off", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.strip() == (
        "deltaserve serve: error: --local-ranks=2 is invalid: must be a tensor-parallel size "
        "this model can be split over: 1, 3 (2 does not divide num_attention_heads=9; 9 divides "
        "the 9 attention heads but does not divide intermediate_size=1536)")


def test_a_worker_refuses_that_tp_size_before_starting_ranks(default_model, tmp_path):
    """The same check on a worker started on its own (--local-ranks 2) and a scheduler: every
    Init (the scheduler retries slowly) is refused with the sizes that would work, in one log
    line of the worker, before any rank process starts: no traceback, nothing from a rank."""
    procs = Processes(tmp_path)
    worker_port, port = free_port(), free_port()
    try:
        worker = procs.worker(worker_port, "--local-ranks", "2")
        scheduler = procs.scheduler(default_model, [worker_port], port)
        wait_for(lambda: "can be split over: 1, 3" in scheduler.log_tail(20000), 120,
                 "the refusal", [worker, scheduler])
        # A second refusal: a whole retry went by, and still no rank started.
        wait_for(lambda: worker.log_tail(20000).count("Init refused") >= 2, 60,
                 "a second refusal", [worker, scheduler])
        lines = worker.log_tail(20000).strip().splitlines()
        assert lines[0].startswith("deltaserve worker listening on"), lines
        refusal = ("Init refused: ParamError: tp_size=2 is invalid: must be a tensor-parallel "
                   "size this model can be split over: 1, 3 (2 does not divide "
                   "num_attention_heads=9; 9 divides the 9 attention heads but does not divide "
                   "intermediate_size=1536)")
        assert lines[1:] and all(line.endswith(refusal) for line in lines[1:]), lines
    finally:
        procs.close()
