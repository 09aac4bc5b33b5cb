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

from tests.support.grpc_harness import (collect, free_port, generation_stub, greedy_request,
                                        scheduler_and_worker)
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
