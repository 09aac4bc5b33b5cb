"""--max-cpu-loras over gRPC (docs/lora.md, "Adapters the workers keep"): a scheduler serving
three adapters of --lora-modules with --max-cpu-loras 1 and a separate CPU worker process (one
rank with two steps in flight, and two rank processes with every step's symmetry verified).
The Init carries no adapter; the scheduler loads and evicts them with LoadLora / UnloadLora, the
same calls on every rank; requests cycling through the adapters give transformers + peft's
tokens (a worker refuses a step naming an adapter it does not hold, so a wrong residency
decision fails the request), and the scheduler's metrics say one adapter is loaded after each
request, and how many loads and evictions it took."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (collect, free_port, generation_stub, greedy_request,
                                        running_stream, scheduler_and_worker, wait_for)
from tests.support.lora_adapters import make_adapter, peft_greedy
from tests.support.metrics_scrape import scrape

MAX_NEW = 6
PROMPT = (11, 40, 7, 93, 5, 120, 64, 3, 77, 18)
TP2 = ["--local-ranks", "2", "--dist-timeout", "60", "--rank-step-timeout", "60"]


@pytest.mark.parametrize("worker_args,more", [
    pytest.param([], ["--async-scheduling"], id="tp1-async"),
    pytest.param(TP2, [], id="tp2", marks=pytest.mark.slow)])
def test_cycling_adapters_through_one_slot(tiny_models, tmp_path, worker_args, more):
    model = tiny_models("llama")
    adapters = {n: make_adapter(model, tmp_path / n, r=4, alpha=16, seed=i + 1)
                for i, n in enumerate("abc")}
    (tmp_path / "logs").mkdir()
    metrics = free_port()
    flags = ["--metrics-listen", f"127.0.0.1:{metrics}","--enable-lora", "--lora-modules", " ".join(f"{n}={p}" for n, p in
                                                         adapters.items()),
             "--max-cpu-loras", "1", "--verify-symmetry", "--dtype", "float32", *more]
    with scheduler_and_worker(model, tmp_path / "logs", scheduler_args=flags,
                              worker_args=worker_args) as (target, _):
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            for name in ["c", "a", "b", "a", "c", ""]:
                request = greedy_request(PROMPT, MAX_NEW)
                request.lora_name = name
                ids, _, _ = collect(stub.Generate(request))
                want = peft_greedy(model, adapters.get(name), PROMPT, MAX_NEW).token_ids
                assert ids == list(want), name
                assert scrape(metrics).total("deltaserve:lora_adapters_loaded") == 1
            s = scrape(metrics)
            # a at start, then c, a, b, a, c read again, each evicting the one before
            assert s.total("deltaserve:lora_loads_total") == 6
            assert s.total("deltaserve:lora_evictions_total") == 5


def test_a_runtime_load_evicts_an_adapter_only_waiting_requests_use(tiny_models, tmp_path):
    """--max-cpu-loras 1, --max-num-seqs 1. While a request of 'a' runs, LoadLoraAdapter('d')
    is RESOURCE_EXHAUSTED naming the flag (retry later, not a bad argument). Then a base
    request runs, one of 'a' waits behind it: LoadLoraAdapter('d') evicts 'a' (vLLM's LRU
    evicts the oldest; a waiting request's adapter is read again before it runs), never a
    refusal because a queued request names 'a'; the waiting request gets a's tokens (peft's)."""
    model = tiny_models("llama")
    a, d = (make_adapter(model, tmp_path / n, r=4, alpha=16, seed=i + 1)
            for i, n in enumerate("ad"))
    (tmp_path / "logs").mkdir()
    metrics = free_port()
    flags = ["--metrics-listen", f"127.0.0.1:{metrics}", "--enable-lora",
             "--allow-runtime-lora-updating", "--lora-modules", f"a={a}", "--max-cpu-loras",
             "1", "--max-num-seqs", "1", "--dtype", "float32"]
    with scheduler_and_worker(model, tmp_path / "logs", scheduler_args=flags) as (target, procs):
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            running = running_stream(stub, PROMPT, "a")                # until cancelled
            with pytest.raises(grpc.RpcError) as busy:               # retry once it ends
                stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="d", lora_path=d),
                                     timeout=60)
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert busy.value.details() == (
                "lora_name='d' is invalid: must be room for it: --max-cpu-loras=1 adapters are "
                "loaded and each is in use by a running request")
            running.cancel()
            base = running_stream(stub, PROMPT)                        # until cancelled
            queued = greedy_request(PROMPT, MAX_NEW)
            queued.lora_name = "a"
            waiting = stub.Generate(queued)
            wait_for(lambda: scrape(metrics).total("deltaserve:num_requests_waiting") == 1,
                     60, "the request of 'a' queued", procs)
            stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="d", lora_path=d),
                                 timeout=60)
            base.cancel()
            ids, _, _ = collect(waiting)
            assert ids == list(peft_greedy(model, a, PROMPT, MAX_NEW).token_ids)
            s = scrape(metrics)
            # a at start, d (evicting a), a read again (evicting d)
            assert s.total("deltaserve:lora_loads_total") == 3
            assert s.total("deltaserve:lora_evictions_total") == 2
