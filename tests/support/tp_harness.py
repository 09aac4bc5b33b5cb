"""Tensor-parallel worker clusters on loopback for the TP tests: real worker services (each with
its spawned rank processes), a scheduler-side EngineCore driving them, and the in-process TP=1
reference. Every process is killed by `Cluster.close()` (call it from a fixture finalizer).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine_common.configuration.config import SchedulerConfig
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from engine_common.wire.codec import encode_scheduler_output
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.workers.worker_client import InitSpec, WorkerClient
from tests.support.init_specs import init_spec
from tests.support.paths import REPO
from tests.support.ports import free_port

BLOCK_SIZE = 4
NUM_BLOCKS = 160            # the scheduler's pool; every worker holds at least this many
KV_BYTES = 1 << 20          # per rank: >= 512 blocks of the tiny models
LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=48, max_model_len=96)



class WorkerNode:
    """`deltaserve worker` for one node; stdout/stderr go to files."""

    def __init__(self, log_dir: Path, *, local_ranks: int, node_rank: int = 0, nodes: int = 1,
                 env: dict | None = None, rank_step_timeout_s: int = 60):
        self.name = f"node{node_rank}"
        self.out_path = log_dir / f"{self.name}.out"
        self.err_path = log_dir / f"{self.name}.err"
        cmd = [sys.executable, "-m", "deltaserve.cli", "worker", "--listen", "127.0.0.1:0",
               "--device", "cpu",
               "--local-ranks", str(local_ranks), "--node-rank", str(node_rank),
               "--nodes", str(nodes), "--dist-timeout", "60",
               "--rank-step-timeout", str(rank_step_timeout_s)]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                                              **(env or {})})
        self.address = ""
        self._rank_pids: set[int] = set()

    def wait_listening(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out_path.read_text().splitlines():
                if "listening on" in line:
                    self.address = line.split("listening on ")[1].split()[0]
                    return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.err_path.read_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not start listening")

    def rank_pids(self) -> list[int]:
        """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
        pids = []
        for tasks in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            for pid in tasks.read_text().split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"spawn_main" in cmdline:
                    pids.append(int(pid))
        self._rank_pids.update(pids)
        return sorted(pids)

    def log_tail(self, n: int = 4000) -> str:
        return self.err_path.read_text()[-n:]

    def kill(self) -> None:
        """SIGKILL the worker and every rank process it ever had."""
        if self.proc.poll() is None:
            self.rank_pids()
        for pid in self._rank_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@dataclass
class Cluster:
    """The worker services of one model replica, node 0 first."""

    nodes: list[WorkerNode]
    local_ranks: int
    dist_port: int = field(default_factory=free_port)
    kept_pids: list | None = None    # for tests that check rank processes survive a re-Init

    @classmethod
    def start(cls, log_dir: Path, *, nodes: int, local_ranks: int,
              env_by_node: dict[int, dict] | None = None,
              rank_step_timeout_s: int = 60) -> Cluster:
        workers = [WorkerNode(log_dir, local_ranks=local_ranks, node_rank=n, nodes=nodes,
                              env=(env_by_node or {}).get(n),
                              rank_step_timeout_s=rank_step_timeout_s) for n in range(nodes)]
        cluster = cls(workers, local_ranks)
        try:
            for w in workers:
                w.wait_listening()
        except BaseException:
            cluster.close()
            raise
        return cluster

    @property
    def tp_size(self) -> int:
        return len(self.nodes) * self.local_ranks

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def client(self, **kwargs) -> WorkerClient:
        return WorkerClient(self.addresses, **kwargs)

    def spec(self, model_dir: str, **overrides) -> InitSpec:
        args = dict(model_dir=model_dir, dtype="float32", block_size=BLOCK_SIZE,
                    kv_cache_bytes=KV_BYTES, dist_port=self.dist_port, **LIMITS)
        return init_spec(**{**args, **overrides})

    def logs(self) -> str:
        return "\n".join(f"--- {n.name} ({n.address}):\n{n.log_tail()}" for n in self.nodes)

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


class RecordingExecutor:
    """Passes steps through and keeps every payload sent (the diff bytes)."""

    def __init__(self, inner):
        self.inner = inner
        self.payloads: list[bytes] = []

    def execute(self, payload: bytes) -> bytes:
        self.payloads.append(payload)
        return self.inner.execute(payload)

    def __getattr__(self, name):
        # Everything else (close() from LLM.__del__, above all) is the wrapped executor's.
        return getattr(self.inner, name)


def scheduler_config() -> SchedulerConfig:
    return SchedulerConfig(block_size=BLOCK_SIZE, **LIMITS)


def make_core(model_dir: str, executor, config: SchedulerConfig | None = None,
              num_blocks: int = NUM_BLOCKS, sliding_window: int = 0,
              window_group=None) -> LLMEngine:
    # the model's vocab_size bounds every reply's ids, as `deltaserve serve` (server.py) does
    scheduler = Scheduler(config or scheduler_config(), num_blocks,
                          sliding_window=sliding_window, window_group=window_group,
                          vocab_size=ModelInfo.from_dir(model_dir).vocab_size)
    return LLMEngine(EngineCore(scheduler, executor),
                     OutputProcessor(Tokenizer.from_dir(model_dir)))


@contextmanager
def engine_on(cluster: Cluster, model_dir: str, config: SchedulerConfig | None = None,
              num_blocks: int = NUM_BLOCKS, **spec_overrides):
    """An engine over `cluster`'s workers, Init-ed with symmetry verification on (and the
    InitSpec's `spec_overrides`), its scheduler given `num_blocks` (a hybrid model's full group)
    and the sliding window and window group Init reported, as the server does. After the body the finished requests' handles reach the
    workers, which must then hold no request; a failure prints the cluster's logs."""
    client = cluster.client(init_timeout_s=120.0, step_timeout_s=60.0)
    try:
        result = client.init(cluster.spec(model_dir, verify_symmetry=True, **spec_overrides))
        core = make_core(model_dir, client, config, num_blocks, result.sliding_window,
                         result.window_group)
        yield core
        client.execute(encode_scheduler_output(core.scheduler.schedule()))
        assert client.reset() == 0
    except Exception:
        print(cluster.logs())
        raise
    finally:
        client.close()


def run_requests(core: LLMEngine, model_dir: str, prompts: list[list[int]],
                 samplings: list[SamplingParams], stoppings: list[StoppingParams],
                 max_steps: int = 2000, constraints=None) -> list[list[int]]:
    """Add every prompt (with its constraint, when `constraints` lists them), step the core
    until all finish; the generated ids in prompt order."""
    eos = ModelInfo.from_dir(model_dir).eos_token_ids
    tokens: dict[str, list[int]] = {}
    constraints = constraints or [None] * len(prompts)
    for i, (prompt, sp, st) in enumerate(zip(prompts, samplings, stoppings)):
        tokens[f"r{i}"] = []
        core.add_request(Request(f"r{i}", list(prompt), sp, st, eos,
                                 constraint=constraints[i]))
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not core.has_unfinished_requests(), "the workload did not finish"
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def reference(model_dir: str, prompts, samplings, stoppings,
              num_blocks: int = NUM_BLOCKS, constraints=None) -> tuple[list[list[int]], list]:
    """TP=1 in process (deltaserve.llm.LLM, same scheduler settings): (tokens, diff payloads)."""
    from deltaserve.llm import LLM

    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
              **LIMITS)
    # (a hybrid model's full group gets more: kv_groups.split_kv_blocks)
    assert llm.scheduler.num_total_blocks == num_blocks or llm.runner.window_group is not None
    recorder = RecordingExecutor(llm.engine.core.executor)
    llm.engine.core.executor = recorder
    return (run_requests(llm.engine, model_dir, prompts, samplings, stoppings,
                         constraints=constraints), recorder.payloads)


def workload(seed: int = 7):
    """8 prompts of 5..40 ids (some prefills get chunked), half greedy, half seeded sampling.
    Every request names its seed, so the scheduler draws none and the diffs are reproducible."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 41))] for _ in range(8)]
    samplings = [SamplingParams(seed=1000 + i) if i % 2 == 0 else
                 SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i)
                 for i in range(8)]
    stoppings = [StoppingParams(max_tokens=rng.randrange(4, 11), ignore_eos=True)
                 for _ in range(8)]
    return prompts, samplings, stoppings
