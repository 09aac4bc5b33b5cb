"""--kv-cache-dtype over real gRPC: the scheduler's flag travels to the worker in Init (field
23), the worker caches one byte per value (GetServerStatus: four times the float32 blocks in
the same --kv-cache-gib), GetServerInfo reports the flag, and the tokens streamed are the
in-process engine's with the same fp8 cache."""
from __future__ import annotations

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.wire.protos import vllm_engine_pb2, vllm_engine_pb2_grpc
from tests.support.grpc_harness import (collect, generation_stub, greedy_request,
                                        scheduler_and_worker, server_status)

PROMPT = list(range(5, 29))
FLAGS = ("--dtype", "float32", "--block-size", "4")


def _serve(model: str, log_dir, *flags: str) -> tuple[int, list[int], str]:
    log_dir.mkdir()
    with scheduler_and_worker(model, log_dir, (*FLAGS, *flags)) as (target, _):
        blocks = server_status(target).num_kv_blocks
        with grpc.insecure_channel(target) as ch:
            ids, _, _ = collect(generation_stub(ch).Generate(greedy_request(PROMPT, 8),
                                                             timeout=120))
            info = vllm_engine_pb2_grpc.VllmEngineStub(ch).GetServerInfo(
                vllm_engine_pb2.GetServerInfoRequest(), timeout=5)
    return blocks, ids, info.kv_cache_dtype


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_the_flag_reaches_the_worker_and_quadruples_the_float32_blocks(tiny_models,
                                                                       tmp_path, name):
    model = tiny_models("llama")
    auto_blocks, _, auto_name = _serve(model, tmp_path / "auto")
    blocks, ids, reported = _serve(model, tmp_path / name, "--kv-cache-dtype", name)
    assert (auto_name, reported) == ("auto", name)
    assert blocks == 4 * auto_blocks, (blocks, auto_blocks)
    llm = LLM(model, dtype="float32", block_size=4, num_kv_blocks=64, kv_cache_dtype=name)
    want = llm.generate([PROMPT], SamplingParams(),
                        StoppingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert ids == list(want)
