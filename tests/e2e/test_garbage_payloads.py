"""Garbage step payloads sent by a token holder to a real worker process: every kind is answered
with StepError BAD_PAYLOAD and INVALID_ARGUMENT or FAILED_PRECONDITION (never INTERNAL or
UNKNOWN), the worker stays ready, and the next epoch runs clean."""
from __future__ import annotations

import collections

import grpc
import pytest

from engine_common.wire.codec import decode_runner_output
from engine_common.model_files.model_dir import ModelInfo
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from engine_common.security.worker_auth import WorkerAuth
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.garbage_diffs import Limits, clean_run, garbage_cases
from tests.support.grpc_harness import (Processes, bearer, free_port, keyed, wait_for,
                                        write_token)
from tests.support.init_specs import init_request, init_spec

pytestmark = pytest.mark.slow

LIMITS = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)


def _stream(address: str, token: str, epoch: int, key: bytes, payloads: list[bytes]):
    """(responses, final status) of one Step stream of `epoch` (whose stream key is `key`)
    carrying `payloads` as steps 0, 1, ..."""
    requests = [worker_pb2.StepRequest(epoch=epoch, step=i, payload=p)
                for i, p in enumerate(payloads)]
    responses = []
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)]) \
            as channel:
        try:
            for r in worker_pb2_grpc.WorkerStub(channel).Step(iter(requests), timeout=60,
                                                             metadata=keyed(token, key)):
                responses.append(r)
        except grpc.RpcError as e:
            assert len(e.details()) <= 2000, (len(e.details()), e.details()[:300])
            return responses, e.code()
    return responses, grpc.StatusCode.OK


def test_garbage_payloads_are_bad_payloads_never_internal(tiny_models, tmp_path):
    model = tiny_models("qwen3")
    procs = Processes(tmp_path)
    token = write_token(tmp_path / "token")
    port = free_port()
    worker = procs.worker(port, "--worker-token-file", str(tmp_path / "token"))
    address = f"127.0.0.1:{port}"
    client = WorkerClient([address], connect_timeout_s=60, auth=WorkerAuth(token=token))
    try:
        wait_for(lambda: "listening on" in worker.log_tail(), 120, "the worker", [worker])
        spec = init_spec(model, dtype="float32", kv_cache_bytes=1 << 20, **LIMITS)
        result = client.init(spec)
        vocab = ModelInfo.from_dir(model).vocab_size
        cases = garbage_cases(Limits(result.num_kv_blocks, vocab, **{
            k: LIMITS[k] for k in ("max_model_len", "block_size", "max_num_seqs",
                                   "max_num_batched_tokens")}))
        assert len(cases) >= 35
        statuses = collections.Counter()
        epoch = result.epoch + 1
        with grpc.insecure_channel(address) as channel:     # the test drives the worker itself
            stub = worker_pb2_grpc.WorkerStub(channel)
            # Its own Init (same settings: the model stays) tells it the epoch's stream key,
            # and each Reset, which presents it, the next one.
            key = stub.Init(init_request(spec, epoch, client.scheduler_id), timeout=120,
                            metadata=bearer(token)).stream_key
            for case in cases:
                epoch += 1
                key = stub.Reset(worker_pb2.ResetRequest(
                    epoch=epoch, scheduler_id=client.scheduler_id), timeout=60,
                    metadata=keyed(token, key)).stream_key
                responses, status = _stream(address, token, epoch, key, case.payloads)
                _check(case, responses, status, statuses)
        assert set(statuses) <= {"INVALID_ARGUMENT", "FAILED_PRECONDITION"}, statuses
        # The worker is still ready, and a clean epoch gives the tokens of a fresh worker.
        assert client.health()[0].ready
        client.init(init_spec(model, dtype="float32", kv_cache_bytes=1 << 20, **LIMITS))
        got = [decode_runner_output(client.execute(p)).sampled_token_ids for p in clean_run()]
        assert all(got)
        assert "Traceback" not in worker.log_tail(2_000_000)
        print("statuses of", len(cases), "garbage payloads:", dict(statuses))
    finally:
        client.close()
        procs.close()


def _check(case, responses, status, statuses) -> None:
    """Every payload answered, the last one refused BAD_PAYLOAD with a clipped message."""
    statuses[status.name] += 1
    assert len(responses) == len(case.payloads), (case.name, status)
    assert not any(r.HasField("error") for r in responses[:-1]), case.name
    error = responses[-1].error
    assert error.code == worker_pb2.StepError.BAD_PAYLOAD, (case.name, error)
    assert len(error.message) <= 2000, (case.name, len(error.message))
    assert status in (grpc.StatusCode.INVALID_ARGUMENT,
                      grpc.StatusCode.FAILED_PRECONDITION), (case.name, status)
