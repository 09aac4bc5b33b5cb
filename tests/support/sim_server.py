"""The scheduler's public gRPC services in-process, over a simulated worker: fast, torch-free.

`SimServer` wires an AsyncEngine (the real Scheduler, OutputProcessor and KV event publisher)
to `SimWorker` through the byte-level executor interface, serves Generation and VllmEngine on
a loopback port from an event loop on its own thread, and is used with sync gRPC stubs. The
simulated worker honours structured-output constraints with the workers' own grammar compiler
(torch-free) over the tiny tokenizer. The port is guarded as the scheduler's is (`api`: API keys,
request limits, one tokenizer pool).
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import grpc

from engine_common.wire.codec import decode_scheduler_output, encode_runner_output
from engine_common.configuration.config import SchedulerConfig
from engine_common.model_files.model_dir import ModelInfo
from engine_common.text.chat_template import ChatTemplate
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2_grpc
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api import public_port
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.front_door import ServedModel
from scheduler_service.api.generation_servicer import GenerationServicer
from scheduler_service.api.health import Readiness
from scheduler_service.api.request_quota import RequestQuota
from scheduler_service.api.stream_sends import SendWatch
from scheduler_service.api.tokenizer_pool import TokenizerPool
from scheduler_service.api.vllm_convert import EngineShape
from scheduler_service.api.vllm_servicer import VllmEngineServicer
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.kv_event_publisher import KvEventPublisher
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.errors import EngineUnavailable
from tests.support.scheduler_sim import SimWorker
from tests.support.tokenizers import build_tiny_tokenizer_dir
from worker_service.sample.grammar import GrammarCompiler

EOS = 1          # "</s>" in the tiny tokenizer


class StepGate:
    """Lets the simulated worker run a set number of steps, then holds it until opened again:
    a test fixes how far a request gets before it acts on it, however fast the machine."""

    def __init__(self):
        self._cond = threading.Condition()
        self._budget: int | None = None          # None: open
        self._waiting = 0                        # steps waiting at the gate

    def hold_after(self, steps: int) -> None:
        with self._cond:
            self._budget = steps
            self._cond.notify_all()      # a held step may go on when steps > 0

    def open(self) -> None:
        with self._cond:
            self._budget = None
            self._cond.notify_all()

    def pass_step(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._budget != 0, timeout)
            self._waiting -= 1
            if self._budget:
                self._budget -= 1

    def wait_held(self, timeout: float = 30.0) -> bool:
        """Until the worker has run its steps and the next one waits at the gate."""
        with self._cond:
            return self._cond.wait_for(lambda: self._budget == 0 and self._waiting > 0,
                                       timeout)


class AdvancedClock:
    """time.monotonic() plus what a test added with advance(): the engine's deadlines pass
    without waiting for them."""

    def __init__(self):
        self._ahead = 0.0

    def advance(self, seconds: float) -> None:
        self._ahead += seconds

    def __call__(self) -> float:
        return time.monotonic() + self._ahead


def make_sim_model_dir(path: Path, max_position: int = 256) -> Path:
    """config.json + the tiny tokenizer: all the scheduler reads of a model directory."""
    build_tiny_tokenizer_dir(path)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 320,
              "max_position_embeddings": max_position, "eos_token_id": EOS, "bos_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    return path


class _SimExecutor:
    """SimWorker behind the byte-level executor interface. Its "model" samples a token of the
    tiny vocabulary (never eos) from the sequence so far, and from the seed unless greedy, so
    greedy answers depend on the prompt alone, as a real model's do. A constrained request
    takes the first id its grammar allows from there on (eos once the text is complete); one
    whose grammar allows none of its allowed_token_ids, or errs, is reported failed, as the
    workers report it (RunnerOutput.request_errors)."""

    def __init__(self, num_blocks: int, block_size: int, gate: StepGate,
                 grammars: GrammarCompiler):
        self.worker = SimWorker(num_blocks, block_size, sample_fn=self._sample)
        self._greedy: dict[int, bool] = {}
        self._allowed: dict[int, tuple[int, ...]] = {}
        self._gate = gate
        self._grammars = grammars
        self._matchers: dict = {}            # handle -> llguidance matcher
        self._errors: dict[int, str] = {}    # this step's failed requests

    def _sample(self, state) -> int:
        key = tuple(state.tokens) if self._greedy[state.handle] else (state.seed,
                                                                      tuple(state.tokens))
        token = hash(key) % 300 + 2
        matcher = self._matchers.get(state.handle)
        if matcher is None:
            return token
        bits = matcher.compute_bitmask()
        vocab = self._grammars.vocab_size
        allowed = self._allowed[state.handle] or range(vocab)
        ok = [t for t in allowed if bits[t // 8] >> (t % 8) & 1]
        if matcher.is_error() or not ok:
            self._errors[state.handle] = "allowed_token_ids and its grammar leave no token"
            return 0                         # what an all -inf row's argmax picks
        token = next(t % vocab for t in range(token, token + vocab) if t % vocab in ok)
        matcher.consume_token(token)
        return token

    def execute(self, payload: bytes) -> bytes:
        self._gate.pass_step()
        out = decode_scheduler_output(payload)
        for handle in out.finished_handles:
            self._matchers.pop(handle, None)
        for new in out.new_requests:
            self._greedy[new.handle] = new.sampling.sampling.greedy
            self._allowed[new.handle] = new.sampling.sampling.allowed_token_ids
            if new.constraint is not None:
                self._matchers[new.handle] = self._grammars.matcher(new.constraint)
        reply = self.worker.execute(out)     # reports the compiled ones
        reply.request_errors, self._errors = self._errors, {}
        return encode_runner_output(reply)


class SimServer:
    def __init__(self, model_dir: Path, num_blocks: int = 64, block_size: int = 4,
                 enable_prefix_caching: bool = True, api: ApiOptions = ApiOptions(),
                 chat_template: ChatTemplate | None = None, max_waiting: int | None = None,
                 max_model_len: int = 256):
        self.api = api
        self.info = ModelInfo.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.grammars = GrammarCompiler(lambda: self.tokenizer.backend.to_str(),
                                        self.info.vocab_size, self.info.eos_token_ids)
        self.config = SchedulerConfig(block_size=block_size, max_num_seqs=8,
                                      max_num_batched_tokens=64, max_model_len=max_model_len,
                                      enable_prefix_caching=enable_prefix_caching,
                                      **({} if max_waiting is None
                                         else {"max_waiting": max_waiting}))
        self.num_blocks = num_blocks
        self.kv_events = KvEventPublisher()
        self.workers_up = True          # False: make_core fails (no worker ready)
        self.gate = StepGate()
        self.clock = AdvancedClock()
        self.workers: list[SimWorker] = []        # one per engine core made, the last live
        self.engine = AsyncEngine(self._make_core, lambda: OutputProcessor(self.tokenizer),
                                  idle_check=self._check_workers, idle_check_seconds=0.05,
                                  on_turn=self.kv_events.publish, clock=self.clock)
        self.model = ServedModel(info=self.info, tokenizer=self.tokenizer, block_size=block_size,
                                 chat_template=chat_template)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self._call(self._start())
        self.target = f"127.0.0.1:{self.port}"

    def _make_core(self) -> EngineCore:
        if not self.workers_up:
            raise EngineUnavailable("simulated: no worker")
        scheduler = Scheduler(self.config, self.num_blocks, rng=random.Random(0),
                              kv_events=self.kv_events.feed, vocab_size=self.info.vocab_size)
        executor = _SimExecutor(self.num_blocks, self.config.block_size, self.gate,
                                self.grammars)
        self.workers.append(executor.worker)
        return EngineCore(scheduler, executor)

    def _check_workers(self, core: EngineCore) -> None:
        if not self.workers_up:
            raise EngineUnavailable("simulated: the worker went away")

    def _call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> int:
        keys = public_port.api_keys(self.api)
        self.server = grpc.aio.server(options=public_port.port_options(self.api),
                                      interceptors=public_port.interceptors(self.api, keys))
        shape = EngineShape(self.config.block_size, self.config.max_num_seqs, "float32", "auto",
                            max_waiting=self.config.max_waiting)
        self.pool = pool = TokenizerPool(self.api.tokenizer_threads)
        self.quota = RequestQuota(self.api.max_requests_per_key)   # shared, as server.py does
        # --stream-send-timeout by the test's clock, checked every 20 ms of the loop
        self.sends = SendWatch(self.api.stream_send_timeout_s, clock=self.clock, tick_s=0.02,
                               on_stall=self.engine.counters.stalled)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(self.engine, self.model, shape, self.kv_events,
                               lambda: self.engine.ready, options=self.api,
                               tokenizer_pool=pool, keys=keys, quota=self.quota,
                               sends=self.sends), self.server)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.engine, self.model, options=self.api, tokenizer_pool=pool,
                               keys=keys, quota=self.quota, sends=self.sends), self.server)
        # grpc.health.v1, each key's Watch streams bounded by the same quota (server.py)
        self.readiness = Readiness("deltaserve.v1.Generation", lambda: self.engine.ready,
                                   self.quota)
        self.readiness.add_to_server(self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.engine.start()
        await self.server.start()
        await self.readiness.start()
        return port

    def hold_steps(self, after: int = 0) -> None:
        """The simulated worker runs `after` more steps, then holds until `release_steps` (so
        requests stay live while a test acts on them)."""
        self.gate.hold_after(after)

    def release_steps(self) -> None:
        self.gate.open()

    def step_once(self) -> None:
        """One more step of a held worker; returns once the next one is held again."""
        self.gate.hold_after(1)
        assert self.gate.wait_held(), "the held worker did not come back to the gate"

    def used_blocks(self) -> int:
        stats = self.engine.stats
        return stats.num_used_blocks

    def close(self) -> None:
        self._call(self.readiness.drain())
        self._call(self.server.stop(None))
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
