"""The two paths `bench.grpc_overhead` compares, each run on one workload after a warm-up.

in-process  `deltaserve.llm.LLM.generate`: scheduler and model runner in this process, talking
            through the same encoded diffs the worker protocol carries, no sockets.
gRPC        a `deltaserve worker` and a `deltaserve scheduler` process on loopback; this process
            opens one streaming Generate call per request (token-id prompts), all at once, on
            one grpc.aio channel.

Times are wall clock from just before the first request is submitted; a request's time to first
token is from that same instant to the moment its first token reaches the caller.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine_common.request.params import SamplingParams, StoppingParams

from bench.services import Services, ServiceError
from bench.workload import Workload

_CHANNEL_READY_SECONDS = 30.0
_STREAM_DEADLINE_SECONDS = 3600.0   # a hung service fails the run instead of blocking it


@dataclass(frozen=True)
class EngineSettings:
    """What both paths are configured with. kv_cache_gib is per device."""

    device: str
    dtype: str
    attention_backend: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_gib: float
    cpu_threads: int | None = None   # torch intra-op threads; None: torch's default
    async_scheduling: bool = False   # two steps in flight (the scheduler's --async-scheduling)

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * (1 << 30))   # as the scheduler CLI converts it

    def llm_kwargs(self) -> dict:
        """Keyword arguments of deltaserve.llm.LLM."""
        return dict(device=self.device, dtype=self.dtype,
                    attention_backend=self.attention_backend, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    max_model_len=self.max_model_len, kv_cache_bytes=self.kv_cache_bytes,
                    async_scheduling=self.async_scheduling)

    def scheduler_flags(self, num_seqs: int) -> list[str]:
        """`deltaserve scheduler` flags; the queue admits the whole workload at once."""
        return ["--dtype", self.dtype, "--attention-backend", self.attention_backend,
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-model-len", str(self.max_model_len),
                "--kv-cache-gib", repr(self.kv_cache_gib),
                "--max-waiting", str(max(1024, num_seqs)), "--grace-period", "1",
                *(["--async-scheduling"] if self.async_scheduling else [])]

    def worker_env(self) -> dict[str, str]:
        """Environment for the service processes (torch reads OMP_NUM_THREADS at start)."""
        return {} if self.cpu_threads is None else {"OMP_NUM_THREADS": str(self.cpu_threads)}


@dataclass(frozen=True)
class PathRun:
    """One path's timed run. token_ids[i] and first_token_s[i] belong to workload request i."""

    token_ids: list[list[int]]
    wall_s: float
    first_token_s: list[float]
    num_steps: int = 0       # engine steps (known in-process only; 0 when not)

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.first_token_s) / len(self.first_token_s)


# -- in-process ---------------------------------------------------------------------------------

def run_in_process(model_dir: str, settings: EngineSettings, workload: Workload,
                   warmup: Workload) -> tuple[PathRun, str]:
    """Time LLM.generate on the workload. Returns the run and the engine in words; the engine
    is gone when this returns."""
    import torch

    from deltaserve.llm import LLM

    if settings.cpu_threads is not None:
        torch.set_num_threads(settings.cpu_threads)
    llm = LLM(model_dir, **settings.llm_kwargs())
    _generate(llm, warmup)
    with _FirstTokens(llm.engine) as seen:
        start, start_monotonic = time.perf_counter(), time.monotonic()
        completions = _generate(llm, workload)
        wall = time.perf_counter() - start
    ids = [list(c.token_ids) for c in completions]
    ttft = [seen.times[c.request_id] - start_monotonic for c in completions]
    engine = _describe_engine(llm, settings)
    del llm
    return PathRun(ids, wall, ttft, seen.num_steps), engine


def _generate(llm, workload: Workload):
    sampling = SamplingParams(temperature=0.0)
    stopping = [StoppingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    return llm.generate(workload.prompts, [sampling] * workload.num_seqs, stopping)


class _FirstTokens:
    """While active, wraps one LLMEngine's `step` (an instance attribute, removed on exit) and
    records when each request's first token was made (time.monotonic()), and how many steps ran."""

    def __init__(self, engine):
        self.engine = engine
        self.times: dict[str, float] = {}
        self.num_steps = 0
        self._step = engine.step

    def __enter__(self) -> "_FirstTokens":
        self.engine.step = self._observed_step
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step

    def _observed_step(self):
        outputs = self._step()
        self.num_steps += 1
        for out in outputs:
            # LLM.generate's outputs are final-only: the first token's time is the engine's
            # record of it (time.monotonic()), not when an output showed it.
            if out.timings.first_token_time is not None:
                self.times.setdefault(out.request_id, out.timings.first_token_time)
        return outputs


def _describe_engine(llm, s: EngineSettings) -> str:
    runner, sched = llm.runner, llm.scheduler
    dtype = str(runner.model_dtype).removeprefix("torch.")
    threads = "" if s.cpu_threads is None else f", {s.cpu_threads} torch threads"
    return (f"{runner.attention_backend_name} attention, {dtype}, {sched.num_total_blocks} KV "
            f"blocks of {sched.config.block_size} ({s.kv_cache_gib:g} GiB), max_num_seqs "
            f"{s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}, "
            f"max_model_len {s.max_model_len}, prefix caching on{threads}")


# -- gRPC ---------------------------------------------------------------------------------------

def run_grpc(model_dir: str, settings: EngineSettings, workload: Workload, warmup: Workload,
             log_dir: str) -> PathRun:
    """Start a worker and a scheduler, warm them up, time the workload as concurrent streams,
    stop both. A failed stream raises ServiceError with the services' log tails."""
    import grpc

    with Services(log_dir, settings.worker_env()) as services:
        target = services.start(model_dir, settings.device,
                                settings.scheduler_flags(workload.num_seqs))
        try:
            return asyncio.run(_warm_then_time(target, warmup, workload))
        except grpc.RpcError as e:
            logs = "\n".join(f"--- {p.name}:\n{p.log_tail()}" for p in services.procs)
            raise ServiceError(f"a Generate stream failed: {e.code().name}: {e.details()}"
                               f"\n{logs}") from None


def time_on_channel(target: str, workload: Workload, tag: str = "bench") -> PathRun:
    """Stream `workload` to a running scheduler at `target` on a fresh channel and event loop;
    the wall time is from the first request to the last token."""
    async def run() -> PathRun:
        import grpc

        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), _CHANNEL_READY_SECONDS)
            return await _stream_workload(channel, workload, tag)
    return asyncio.run(run())


async def _warm_then_time(target: str, warmup: Workload, workload: Workload) -> PathRun:
    """Both on one channel and one event loop (grpc.aio binds to the loop that first uses it)."""
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), _CHANNEL_READY_SECONDS)
        await _stream_workload(channel, warmup, "warmup")
        return await _stream_workload(channel, workload, "bench")


async def _stream_workload(channel, workload: Workload, tag: str) -> PathRun:
    from engine_common.wire.protos import generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(channel)
    start = time.perf_counter()
    results = await asyncio.gather(*(
        _stream_one(stub, f"{tag}-{i}", prompt, max_tokens, start)
        for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens))))
    wall = time.perf_counter() - start
    return PathRun([ids for ids, _ in results], wall, [ttft for _, ttft in results])


async def _stream_one(stub, request_id: str, prompt: list[int], max_tokens: int,
                      start: float) -> tuple[list[int], float]:
    """(token ids, seconds from `start` to the first token) of one greedy Generate stream."""
    from engine_common.wire.protos import generation_pb2 as pb

    request = pb.GenerateRequest(
        request_id=request_id, token_ids=prompt, sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
    ids: list[int] = []
    first = float("nan")
    async for msg in stub.Generate(request, timeout=_STREAM_DEADLINE_SECONDS):
        if msg.token_ids and not ids:
            first = time.perf_counter() - start
        ids.extend(msg.token_ids)
    return ids, first
