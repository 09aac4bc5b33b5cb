"""A runtime-updating server without --max-cpu-loras holds a bounded number of adapters
(docs/lora.md, "Adapters the workers keep", "Default"): a scheduler process started with
--enable-lora --allow-runtime-lora-updating, two --lora-modules and --max-loras 1, and a real
CPU worker service in this process on loopback (so its runner can be inspected).

The worker's Init carries max_cpu_loras = max(--max-loras + 1, the 2 --lora-modules) = 2 and no
adapter; the slots its memory check counts are 2 and its LoRASlots refuses a third. Two more
adapters loaded at run time, then requests of the four one after another: each answers the
tokens of transformers + peft with that adapter (evicted adapters read again), and no change
of the rank's slots ever left it holding more than 2. Before, this Init counted --max-loras
(1) slots while the rank held all four."""
from __future__ import annotations

import grpc
import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.security.worker_auth import WorkerAuth
from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub,
                                        greedy_request, running_stream,
                                        scheduler_and_worker, wait_ready)
from tests.support.lora_adapters import make_adapter, peft_greedy
from worker_service.lora.adapter import LoRAError
from worker_service.lora.load import lora_slots
from worker_service.lora.slots import LoRASlots
from worker_service.service.server import serve_worker

PROMPT = (11, 40, 7, 93, 5, 120, 64, 3, 77, 18)
MAX_NEW = 6
CAPACITY = 2            # max(--max-loras 1 + 1, two --lora-modules)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """(stub, runner, adapters by name, the held counts after each slot change)."""
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("lora-capacity")
    adapters = {n: make_adapter(model, root / n, r=4, alpha=16, seed=i + 1)
                for i, n in enumerate("abcd")}
    held: list[int] = []
    apply = LoRASlots._apply

    def spy(self, new):         # every change of a rank's slots goes through _apply
        apply(self, new)
        held.append(len(self.adapters))

    patch = pytest.MonkeyPatch()
    patch.setattr(LoRASlots, "_apply", spy)
    worker = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"), WorkerAuth())
    (root / "logs").mkdir()
    procs = Processes(root / "logs")
    port = free_port()
    sched = procs.scheduler(
        model, [worker.bound_port], port, "--enable-lora", "--allow-runtime-lora-updating",
        "--lora-modules", f"a={adapters['a']} b={adapters['b']}", "--max-loras", "1",
        "--max-lora-rank", "4", "--dtype", "float32")
    try:
        wait_ready(f"127.0.0.1:{port}", [sched])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield (generation_stub(channel), worker.node_worker.ranks.runner, adapters,
                   held)
    finally:
        procs.close()
        worker.stop(None)
        worker.node_worker.close()
        patch.undo()


def _generate(stub, name: str) -> list[int]:
    request = greedy_request(PROMPT, MAX_NEW)
    request.lora_name = name
    return collect(stub.Generate(request))[0]


def test_the_init_carries_the_capacity_and_the_worker_counts_it(served):
    _, runner, _, _ = served
    received = runner.config
    assert received.max_cpu_loras == CAPACITY and received.lora_modules is None
    assert received.allow_runtime_lora_updating
    assert lora_slots(received) == CAPACITY          # what its memory check counted
    assert runner.lora.capacity == CAPACITY
    assert sorted(runner.lora.adapters) == [0, 1]    # both --lora-modules loaded at start


def test_more_adapters_than_the_capacity_all_answer_and_the_rank_stays_bounded(served):
    stub, runner, adapters, held = served
    for name in "cd":
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name=name,
                                                       lora_path=adapters[name]))
    want = {n: list(peft_greedy(runner.config.model_dir, p, PROMPT, MAX_NEW).token_ids)
            for n, p in adapters.items()}
    assert len({tuple(t) for t in want.values()}) == 4        # a wrong adapter would show
    for name in "abcdacbd":
        assert _generate(stub, name) == want[name], name
        assert len(runner.lora.adapters) <= CAPACITY
    assert held and max(held) == CAPACITY, held
    assert len(held) > 2 * 4, held        # evicted and read again, not held all along


def test_the_rank_refuses_a_third_adapter(served):
    """LoRASlots itself refuses to hold more than it counted (the scheduler's LRU never asks:
    this is the worker's own guard), naming --max-cpu-loras."""
    _, runner, adapters, _ = served
    assert len(runner.lora.adapters) == CAPACITY
    free = next(i for i in range(1, 9) if i - 1 not in runner.lora.adapters)
    with pytest.raises(LoRAError, match=r"the most --max-cpu-loras 2 allows"):
        runner.lora.load(free, "extra", adapters["a"])


def test_a_load_while_every_max_loras_adapter_runs_is_served(tiny_models, tmp_path):
    """--max-loras 1, one --lora-modules adapter, runtime updating, no --max-cpu-loras: while a
    request of 'a' runs, LoadLoraAdapter('d') and then ('e') are served, as vLLM's are (the
    default capacity, --max-loras + 1 = 2, leaves a slot no running request pins; with 1 they
    were RESOURCE_EXHAUSTED). 'e' evicts 'd'; a queued request of 'd' then reads it again
    and answers peft's tokens once 'a' ends."""
    model = tiny_models("llama")
    paths = {n: make_adapter(model, tmp_path / n, r=4, alpha=16, seed=i + 1)
             for i, n in enumerate("ade")}
    (tmp_path / "logs").mkdir()
    flags = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-modules",
             f"a={paths['a']}", "--max-loras", "1", "--max-lora-rank", "4", "--dtype",
             "float32"]
    with scheduler_and_worker(model, tmp_path / "logs", scheduler_args=flags) as (target, _):
        with grpc.insecure_channel(target) as channel:
            stub = generation_stub(channel)
            running = running_stream(stub, PROMPT, "a")
            for name in "de":
                stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name=name,
                                                               lora_path=paths[name]),
                                     timeout=60)
            queued = greedy_request(PROMPT, MAX_NEW)
            queued.lora_name = "d"
            waiting = stub.Generate(queued)
            running.cancel()
            assert collect(waiting)[0] == list(peft_greedy(model, paths["d"], PROMPT,
                                                           MAX_NEW).token_ids)
