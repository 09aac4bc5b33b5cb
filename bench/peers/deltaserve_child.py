"""The DeltaServe engine process of the peer harness, greedy with ignore_eos on token-id prompts:

    in-process (default)  `deltaserve.llm.LLM.generate`, scheduler and model runner in this process
    --grpc                a `deltaserve worker` and a `deltaserve scheduler` process on loopback,
                          the workload sent as concurrent streaming Generate calls; both run
                          in this process's group, so a run's CPU seconds include theirs

    python -m bench.peers.deltaserve_child WORKLOAD_JSON SETTINGS_JSON
"""
from __future__ import annotations

import json
import sys
import tempfile
import time

from bench.peers.protocol import load_workload, serve
from bench.workload import Workload


def _workload(part: dict) -> Workload:
    return Workload(part["prompts"], part["output_lens"], 0)


def _llm_kwargs(settings: dict) -> dict:
    kwargs = dict(device="cpu", dtype=settings["dtype"], max_num_seqs=settings["max_num_seqs"],
                  max_model_len=settings["max_model_len"],
                  kv_cache_bytes=int(settings["kv_cache_gib"] * (1 << 30)),
                  enable_prefix_caching=settings["prefix_caching"])
    if settings.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = settings["max_num_batched_tokens"]
    kwargs.update(settings.get("options") or {})
    return kwargs


class InProcess:
    """LLM.generate in this process."""

    def __init__(self, workload: dict, settings: dict) -> None:
        import torch

        from deltaserve.llm import LLM

        torch.set_num_threads(settings["threads"])
        self.llm = LLM(settings["model"], **_llm_kwargs(settings))
        self.generate(workload["warmup"])
        runner, sched = self.llm.runner, self.llm.scheduler
        self.description = (
            f"DeltaServe LLM.generate (in-process), {str(runner.model_dtype)[6:]}, "
            f"{runner.attention_backend_name} attention, max_num_seqs "
            f"{sched.config.max_num_seqs}, max_num_batched_tokens "
            f"{sched.config.max_num_batched_tokens}, prefix caching "
            f"{'on, emptied before each run' if sched.config.enable_prefix_caching else 'off'}"
            f"{', async scheduling' if sched.config.async_scheduling else ''}, "
            f"{torch.get_num_threads()} torch threads, {_vector_code()}")

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be emptied: blocks still held")

    def generate(self, part: dict) -> list[list[int]]:
        from engine_common.request.params import SamplingParams, StoppingParams

        stopping = [StoppingParams(max_tokens=n, ignore_eos=True) for n in part["output_lens"]]
        done = self.llm.generate(part["prompts"], SamplingParams(temperature=0.0), stopping)
        return [list(c.token_ids) for c in done]


def _vector_code() -> str:
    """Which bodies this process's CPU kernels and torch's run (what --isa changed)."""
    import torch

    from kernels.cpu import extension

    ours = (f"deltaserve_cpu {extension.isa()} build ({extension.ops().body()} bodies)"
            if extension.load() else "no deltaserve_cpu kernels")
    return f"{ours}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


class OverGrpc:
    """A worker and a scheduler process; each run streams the workload over one channel."""

    def __init__(self, workload: dict, settings: dict) -> None:
        from bench.grpc_paths import EngineSettings
        from bench.services import Services

        kwargs = _llm_kwargs(settings)
        self.settings = EngineSettings(
            device="cpu", dtype=settings["dtype"], attention_backend="auto",
            max_num_seqs=settings["max_num_seqs"],
            max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 2048),
            max_model_len=settings["max_model_len"], kv_cache_gib=settings["kv_cache_gib"],
            cpu_threads=settings["threads"],
            async_scheduling=bool((settings.get("options") or {}).get("async_scheduling")))
        self._logs = tempfile.TemporaryDirectory(prefix="deltaserve-peers-")
        # In this process's group: the harness's CPU count and quiet-engine wait cover the
        # worker and the scheduler, and stopping the group stops them.
        self.services = Services(self._logs.name, self.settings.worker_env(), own_session=False)
        flags = self.settings.scheduler_flags(len(workload["prompts"]))
        if not settings["prefix_caching"]:
            flags.append("--no-prefix-caching")
        self.target = self.services.start(settings["model"], "cpu", flags)
        self.generate(workload["warmup"])
        self.description = (f"DeltaServe over gRPC (worker + scheduler processes), "
                            f"{settings['dtype']}, max_num_seqs {self.settings.max_num_seqs}, "
                            f"max_num_batched_tokens {self.settings.max_num_batched_tokens}, "
                            f"{settings['threads']} torch threads in the worker"
                            + (", prefix caching on, emptied before each run (FlushCache)"
                               if settings["prefix_caching"] else ", prefix caching off"))

    def generate(self, part: dict) -> list[list[int]]:
        from bench.grpc_paths import time_on_channel

        return time_on_channel(self.target, _workload(part)).token_ids

    def reset_prefix_cache(self) -> None:
        """The scheduler's FlushCache RPC (vLLM's protocol, on the same port)."""
        import grpc

        from engine_common.wire.protos import smg_common_pb2, vllm_engine_pb2_grpc

        with grpc.insecure_channel(self.target) as channel:
            reply = vllm_engine_pb2_grpc.VllmEngineStub(channel).FlushCache(
                smg_common_pb2.FlushCacheRequest(timeout_s=60), timeout=120)
        if not reply.success:
            raise RuntimeError(f"the prefix cache could not be emptied: {reply.message}")

    def close(self) -> None:
        self.services.close()
        self._logs.cleanup()


def main() -> int:
    workload, settings = load_workload(sys.argv[1]), json.loads(sys.argv[2])
    engine_class = OverGrpc if settings.get("grpc") else InProcess

    def run_one(engine, tag):
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        ids = engine.generate(workload)
        return time.perf_counter() - t0, ids, {}

    def start():
        engine = engine_class(workload, settings)
        return engine, engine.description
    return serve("DeltaServe", start, run_one)


if __name__ == "__main__":
    sys.exit(main())
