"""A worker restarted under a scheduler whose LoRA set changed at run time (docs/lora.md,
"Workers restarted"): real processes on loopback. The new worker gets the adapters served *now*:
a --lora-modules adapter unloaded (its directory then deleted) is not sent again, so the worker
rejoins; an adapter loaded at run time comes back with its id; tokens == transformers + peft.
A scheduler restarted with --max-cpu-loras against a worker that keeps its model: the worker
drops the adapter the scheduler before it loaded, so the new one's replay fits."""
from __future__ import annotations

import shutil

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub,
                                        greedy_request, health_status, wait_for, wait_ready)
from tests.support.lora_adapters import make_adapter, peft_greedy

GENERATION = "deltaserve.v1.Generation"
PROMPT = (11, 40, 7, 93, 5, 120, 64, 3, 77)
MAX_NEW = 6


def _generate(stub, name: str) -> list[int]:
    request = greedy_request(PROMPT, MAX_NEW)
    request.lora_name = name
    return collect(stub.Generate(request, timeout=60))[0]


def _served(stub) -> list[tuple[str, int, bool]]:
    return [(a.lora_name, a.lora_id, a.static) for a in
            stub.ListLoraAdapters(pb.ListLoraAdaptersRequest()).adapters]


def test_restarted_worker_gets_the_adapters_served_now(tiny_models, tmp_path):
    model = tiny_models("llama")
    a = make_adapter(model, tmp_path / "a", r=8, alpha=32, seed=1)
    b = make_adapter(model, tmp_path / "b", r=4, alpha=8, seed=2)
    c = make_adapter(model, tmp_path / "c", r=8, alpha=16, seed=3, targets=("v_proj",))
    procs = Processes(tmp_path)
    w_port, s_port = free_port(), free_port()
    target = f"127.0.0.1:{s_port}"
    try:
        worker = procs.worker(w_port)
        sched = procs.scheduler(model, [w_port], s_port, "--enable-lora",
                                "--allow-runtime-lora-updating", "--lora-modules",
                                f"a={a} b={b}", "--max-lora-rank", "8", "--dtype", "float32")
        wait_ready(target, [worker, sched])
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            assert _generate(stub, "a") == list(peft_greedy(model, a, PROMPT, MAX_NEW).token_ids)
            stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="a"))
            shutil.rmtree(a)
            assert stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
                lora_name="c", lora_path=c)).lora_id == 1
            want_c = list(peft_greedy(model, c, PROMPT, MAX_NEW).token_ids)
            assert _generate(stub, "c") == want_c

            worker.kill()
            wait_for(lambda: health_status(target, GENERATION) == "NOT_SERVING", 30,
                     "the scheduler to see the worker gone", [sched])
            worker = procs.worker(w_port)               # the same port, no adapter held
            wait_ready(target, [worker, sched], timeout=120)
            assert _served(stub) == [("c", 1, False), ("b", 2, True)]
            assert _generate(stub, "c") == want_c
            assert _generate(stub, "b") == list(peft_greedy(model, b, PROMPT, MAX_NEW).token_ids)
            with pytest.raises(grpc.RpcError) as err:
                _generate(stub, "a")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        procs.close()


def test_restarted_scheduler_with_max_cpu_loras_on_a_kept_worker(tiny_models, tmp_path):
    model = tiny_models("llama")
    a = make_adapter(model, tmp_path / "a", r=8, alpha=32, seed=1)
    b = make_adapter(model, tmp_path / "b", r=4, alpha=8, seed=2)
    c = make_adapter(model, tmp_path / "c", r=8, alpha=16, seed=3, targets=("v_proj",))
    flags = ("--enable-lora", "--allow-runtime-lora-updating", "--max-cpu-loras", "1",
             "--lora-modules", f"a={a} b={b}", "--max-lora-rank", "8", "--dtype", "float32")
    procs = Processes(tmp_path)
    w_port, s_port = free_port(), free_port()
    target = f"127.0.0.1:{s_port}"
    try:
        worker = procs.worker(w_port)
        sched = procs.scheduler(model, [w_port], s_port, *flags)
        wait_ready(target, [worker, sched])
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            assert stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
                lora_name="c", lora_path=c)).lora_id == 3          # the worker holds c alone
        sched.stop()
        sched = procs.scheduler(model, [w_port], s_port, *flags)   # a, b again; not c
        wait_ready(target, [worker, sched], timeout=120)
        assert worker.log_tail(100_000).count("loaded model ") == 1    # the model was kept
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            assert _served(stub) == [("a", 1, True), ("b", 2, True)]
            for name, path in (("b", b), ("a", a)):
                assert _generate(stub, name) == list(
                    peft_greedy(model, path, PROMPT, MAX_NEW).token_ids)
    finally:
        procs.close()
