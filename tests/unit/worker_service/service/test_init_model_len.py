"""max_model_len must leave room for a prompt token and an output token, and stay within the
model's max_position_embeddings (the rotary tables stop there): an Init outside [2, max] is
refused INVALID_ARGUMENT naming the field, the value and the range, and so is
`deltaserve serve --max-model-len`, before anything starts.

max_model_len=1 was accepted at Init and by serve; every request was then refused ("at most 0
tokens", on the worker "length=1 is invalid: must be in [1, 0]"). A value below block_size works
(one partly used block) and stays accepted. A real worker service on loopback (tiny model)."""
from __future__ import annotations

import grpc
import pytest

from deltaserve import cli
from engine_common.model_files.model_dir import MIN_MODEL_LEN as MODEL_FILES_FLOOR
from engine_common.request.diff_limits import MIN_MODEL_LEN
from engine_common.wire.codec import decode_runner_output
from engine_common.wire.diff import SchedulerOutput
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.garbage_diffs import enc, new
from tests.support.grpc_harness import bearer, keyed
from tests.support.inproc_worker import cpu_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(dtype="float32", block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_bytes=1 << 20)
TINY_MAX = 2048                  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def worker(tiny_models):
    """(stub, next epoch) of a worker without a model."""
    with cpu_worker(TOKEN) as address, grpc.insecure_channel(address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel), iter(range(1, 100))


def _init(worker, model_dir: str, max_model_len: int):
    stub, epochs = worker
    epoch = next(epochs)
    config = worker_pb2.WorkerConfig(model_dir=model_dir, max_model_len=max_model_len, **LIMITS)
    reply = stub.Init(worker_pb2.InitRequest(epoch=epoch, scheduler_id="s", config=config),
                      timeout=120, metadata=bearer(TOKEN))
    return epoch, reply.stream_key


@pytest.mark.parametrize("max_model_len, allowed", [
    (1, "[2, 2147483647]"),              # the field's own range, checked first
    (TINY_MAX + 1, f"[2, {TINY_MAX}]"),  # the model's
])
def test_init_refuses_a_max_model_len_outside_the_range(worker, tiny_models, max_model_len,
                                                        allowed):
    with pytest.raises(grpc.RpcError) as refused:
        _init(worker, tiny_models("qwen3"), max_model_len)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    details = refused.value.details()
    assert f"max_model_len={max_model_len} " in details and allowed in details, details


def test_both_rooms_agree_on_the_floor():
    assert MODEL_FILES_FLOOR == MIN_MODEL_LEN == 2


@pytest.mark.parametrize("max_model_len", [2, 3])        # below block_size (4)
def test_a_max_model_len_below_the_block_size_serves_a_request(worker, tiny_models,
                                                               max_model_len):
    epoch, key = _init(worker, tiny_models("qwen3"), max_model_len)
    prompt = [3, 14][:max_model_len - 1]                  # room for exactly one output token
    diff = SchedulerOutput(0, new_requests=[new(0, prompt, [0])],
                           num_scheduled_tokens={0: len(prompt)})
    stub, _ = worker
    (reply,) = stub.Step(iter([worker_pb2.StepRequest(epoch=epoch, step=0, payload=enc(diff))]),
                         timeout=120, metadata=keyed(TOKEN, key))
    assert not reply.HasField("error"), reply.error
    assert len(decode_runner_output(reply.payload).sampled_token_ids) == 1


def _never_started(*args, **kwargs):       # accepted flags would start serving here
    raise AssertionError("the command got past its checks and started")


@pytest.mark.parametrize("command, max_model_len, allowed", [
    ("serve", "1", "[2, 2147483647]"), ("serve", str(TINY_MAX + 1), f"[2, {TINY_MAX}]"),
    ("scheduler", "1", "[2, 2147483647]"),       # past the model's: test_scheduler_worker_...
])
def test_the_cli_refuses_it_first(command, max_model_len, allowed, tiny_models, capsys,
                                  monkeypatch):
    monkeypatch.setattr("deltaserve.embedded.start_worker", _never_started)
    monkeypatch.setattr("scheduler_service.api.server.run_scheduler", _never_started)
    argv = [command, "--model", tiny_models("qwen3"), "--listen", "127.0.0.1:0",
            "--max-model-len", max_model_len]
    if command == "scheduler":
        argv += ["--workers", "127.0.0.1:1"]
    assert cli.main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"deltaserve {command}: error: "), line
    assert f"max_model_len={max_model_len}" in line.replace("--max-model-len", "max_model_len")
    assert allowed in line, line
