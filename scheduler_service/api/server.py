"""The scheduler service process: the engine, the public API, health and reflection on one port.

    build_scheduler_server(workers, listen, worker_config, policy, options) -> SchedulerServer
    run_scheduler(...)  blocks until SIGTERM/SIGINT, then drains and stops

Engine life cycle: AsyncEngine calls `WorkerCoreFactory` until it succeeds. Each call Inits every
worker (a new epoch; a worker that already holds the model keeps it) and builds a fresh
Scheduler + EngineCore over the KV blocks the workers report (the text side, an OutputProcessor
per event loop, lives in the AsyncEngine and outlasts epochs). When a worker fails, the engine
drops the core and calls the factory again: that is worker-restart recovery.

Shutdown (SIGTERM/SIGINT): readiness goes NOT_SERVING, the port stops taking new RPCs, open
streams get `grace_period_s` to finish, then the engine stops and fails the rest (UNAVAILABLE,
"the server is shutting down"); any still open 2 s later are cancelled.
Torch is never imported here: this process runs where torch is not installed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from dataclasses import dataclass
from typing import Callable

import grpc

from engine_common.text.chat_template import load_chat_template
from engine_common.configuration.config import SchedulerConfig, WorkerConfig, limits_of
from engine_common.runtime.gc_heap import freeze_heap
from engine_common.runtime.gil_switch import shorten_gil_switch_interval
from engine_common.configuration.listen_address import ListenAddress
from engine_common.runtime.metrics_http import MetricsServer, start_metrics_server
from engine_common.model_files.model_dir import ModelInfo
from engine_common.wire.protos import (GENERATION_SERVICE, VLLM_ENGINE_SERVICE, generation_pb2_grpc,
                                  vllm_engine_pb2_grpc)
from engine_common.configuration.settings import (AtLeast, AtLeastZero, OneOf, Positive,
                                                  ReadableFile, setting, validate)
from engine_common.text.tokenizer import Tokenizer
from engine_common.security.worker_auth import WorkerAuth
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.api.adapter_ports import (AdapterPort, adapter_listen_of,
                                                 check_not_model_name,
                                                 build_adapter_ports, start_ports, stop_ports)
from scheduler_service.core.lora_registry import LoRARegistry
from scheduler_service.engine.lora_updates import (LoRAUpdates, init_config, lora_cache,
                                                   lora_capacity)
from scheduler_service.engine.metrics import SchedulerMetrics
from scheduler_service.api import public_port
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.embeddings import served_pooler
from scheduler_service.api.front_door import ServedModel
from scheduler_service.api.generation_servicer import GenerationServicer
from scheduler_service.api.health import HEALTH_SERVICE, Readiness
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.api.reflection import add_reflection
from scheduler_service.api.request_quota import RequestQuota
from scheduler_service.api.sampling_defaults import sampling_defaults
from scheduler_service.api.stream_sends import send_watch
from scheduler_service.api.tokenizer_pool import TokenizerPool
from scheduler_service.api.vllm_convert import EngineShape
from scheduler_service.api.vllm_servicer import VllmEngineServicer
from scheduler_service.core.kv_events import KvEventFeed
from scheduler_service.api.worker_core_factory import WorkerCoreFactory
from scheduler_service.engine.kv_event_publisher import KvEventPublisher
from scheduler_service.workers.lora_calls import WorkerLoRA
from scheduler_service.workers.worker_client import InitSpec, WorkerClient
from scheduler_service.workers.worker_spec import DEFAULT_DIST_PORT

log = logging.getLogger(__name__)

# How long one reconnect attempt waits for a worker's port; retried every half second after.
_CONNECT_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class ServerOptions:
    """The scheduler process's own settings (the engine's are SchedulerConfig and WorkerConfig)."""

    grace_period_s: float = setting(10.0, "seconds open streams may finish after SIGTERM/SIGINT",
                                    rule=AtLeastZero(), flag="--grace-period")
    dist_port: int = setting(DEFAULT_DIST_PORT, "with several workers: the torch.distributed "
                             "rendezvous port on node 0's host", rule=AtLeast(1, 65535))
    metrics_listen: str | None = setting(
        None, "HOST:PORT of the Prometheus /metrics endpoint (port 0: any free port), or off",
        rule=ListenAddress())
    step_timeout_s: float = setting(
        10.0, "seconds a step may take beyond twice the slowest recent step before the worker "
        "must answer Health: one that does not is stuck (open streams get UNAVAILABLE, the "
        "workers are re-initialized); one that does gets another period, up to 30",
        rule=Positive(), flag="--step-timeout")
    served_model_name: str | None = setting(
        None, "the model's name in both APIs (/v1/models, GetModelInfo) and the metrics; "
        "unset: the model directory's name (its flag, which takes aliases too: "
        "deltaserve/vllm_lists.py)", cli=False)
    chat_template: str | None = setting(
        None, "a Jinja chat template file, used instead of the model's (by the gateway too)",
        rule=ReadableFile(), metavar="FILE")
    generation_config: str = setting(
        "auto", "where unset sampling fields take their defaults: auto (the model's "
        "generation_config.json), vllm (none), or a directory holding a generation_config.json; "
        "a temperature it does not set is 1", metavar="auto|vllm|DIR")
    runner: str = setting("generate", "generate, or pooling: serve embeddings (Embed, "
                          "/v1/embeddings), or a classification model's Classify, Score and "
                          "/v1/classify, instead of generation, as vLLM's --runner pooling",
                          rule=OneOf(("generate", "pooling")))
    lora_engine_listen: str | None = setting(
        None, "with --enable-lora: NAME=HOST:PORT entries, each a VllmEngine port of its own "
        "for LoRA adapter NAME (its model name to the smg gateway, which has no adapter "
        "field: docs/lora.md)", metavar="NAME=HOST:PORT ...")
    pooler_config: str | None = setting(
        None, "with --runner pooling: JSON {\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", "
        "\"normalize\": true|false} over the model's own (docs/embeddings.md)", metavar="JSON")

    def __post_init__(self):
        validate(self)


# After the grace period, how long the streams the engine fails get to send that status (a
# stream the engine does not own, as a KV-event subscription, is cancelled that much later).
_STREAM_FAIL_SECONDS = 2.0


class SchedulerServer:
    """A built, not yet started scheduler service. `port` is the bound port."""

    def __init__(self, server: grpc.aio.Server, engine: AsyncEngine, readiness: Readiness,
                 client: WorkerClient, port: int, grace_period_s: float,
                 metrics_server: MetricsServer | None = None,
                 adapter_ports: list[AdapterPort] | None = None):
        self.server = server
        self.engine = engine
        self.readiness = readiness
        self.client = client
        self.port = port
        self.grace_period_s = grace_period_s
        self.metrics_server = metrics_server   # serving /metrics already; None when off
        self.adapter_ports = adapter_ports or []  # --lora-engine-listen

    async def start(self) -> None:
        self.engine.start()
        await self.server.start()
        await start_ports(self.adapter_ports)
        await self.readiness.start()

    async def stop(self, grace_period_s: float | None = None,
                   hurry: asyncio.Event | None = None) -> None:
        """Drain: readiness NOT_SERVING, no new RPCs, open streams finish or are cancelled.
        `hurry` set (a second Ctrl-C) ends the grace period at once."""
        grace = self.grace_period_s if grace_period_s is None else grace_period_s
        await self.readiness.drain()
        # Streams still open at the end of the grace period are failed by the engine
        # (UNAVAILABLE "the server is shutting down") before gRPC cancels them: grpc's own
        # cancel reached the clients first as a bare "UNAVAILABLE: Cancelling all calls".
        stopping = asyncio.ensure_future(asyncio.gather(
            self.server.stop(grace + _STREAM_FAIL_SECONDS),
            stop_ports(self.adapter_ports, grace + _STREAM_FAIL_SECONDS)))
        hurried = asyncio.ensure_future((hurry or asyncio.Event()).wait())
        done, _ = await asyncio.wait({stopping, hurried}, timeout=grace,
                                     return_when=asyncio.FIRST_COMPLETED)
        hurried.cancel()
        if stopping not in done:
            await asyncio.to_thread(self.engine.shutdown)
        await stopping
        await asyncio.to_thread(self.engine.shutdown)     # a second call returns at once
        await asyncio.to_thread(self.client.close)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until every worker is initialized; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self.engine.ready:
            if deadline is not None and loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def build_scheduler_server(workers: list[str], listen: str, worker: WorkerConfig,
                           policy: SchedulerConfig | None = None,
                           options: ServerOptions = ServerOptions(), *,
                           api: ApiOptions = ApiOptions(),
                           worker_auth: WorkerAuth = WorkerAuth()) -> SchedulerServer:
    """Everything of the scheduler service, wired and bound to `listen` but not started.

    The batch limits (BatchLimits fields) are the worker config's, for both sides: `policy`
    contributes only its own fields (waiting queue, prefix caching, async scheduling). `api`
    guards the public port; `worker_auth` is the credential every Worker RPC carries."""
    adapter_listen = adapter_listen_of(options.lora_engine_listen, worker)
    info = ModelInfo.from_dir(worker.model_dir, worker.max_model_len)
    if options.served_model_name:
        info = dataclasses.replace(info, name=options.served_model_name)
    check_not_model_name(adapter_listen, info.name)
    tokenizer = Tokenizer.from_dir(worker.model_dir)
    info = info.with_tokenizer_eos(tokenizer.eos_token_id)
    worker = dataclasses.replace(worker, max_model_len=info.max_model_len)
    config = dataclasses.replace(policy or SchedulerConfig(max_model_len=info.max_model_len),
                                 **limits_of(worker))
    spec = InitSpec(init_config(worker), dist_port=options.dist_port)
    client = WorkerClient(list(workers), connect_timeout_s=_CONNECT_TIMEOUT_SECONDS,
                          step_timeout_s=options.step_timeout_s, auth=worker_auth)
    kv_events = KvEventPublisher(KvEventFeed())
    registry = LoRARegistry(config.lora)
    lora = LoRAUpdates(registry, WorkerLoRA(client), config.allow_runtime_lora_updating,
                       lora_cache(registry, lora_capacity(config)))
    factory = WorkerCoreFactory(client, spec, config, kv_events.feed, lora, info.vocab_size)
    metrics = SchedulerMetrics(info.name, info.max_model_len)
    engine = AsyncEngine(factory, lambda: OutputProcessor(tokenizer),
                         idle_check=factory.check_health, metrics=metrics,
                         on_turn=lambda: (kv_events.publish(), lora.on_turn(engine)))
    metrics.attach(lambda: engine.stats, engine.counters, len(workers))
    served = ServedModel(info=info, tokenizer=tokenizer, block_size=worker.block_size,
                         num_workers=len(workers), lora=lora.registry,
                         default_sampling=sampling_defaults(worker.model_dir,
                                                            options.generation_config),
                         chat_template=load_chat_template(worker.model_dir,
                                                          options.chat_template),
                         pooler=served_pooler(options.runner, options.pooler_config,
                                              worker.model_dir),
                         max_step_tokens=config.max_num_batched_tokens,
                         max_num_seqs=config.max_num_seqs)

    keys = public_port.api_keys(api)
    server = grpc.aio.server(options=public_port.port_options(api),
                             interceptors=public_port.interceptors(api, keys))
    pool = TokenizerPool(api.tokenizer_threads)   # both services' tokenizing, off the loop
    quota = RequestQuota(api.max_requests_per_key)  # both services' requests per key
    sends = send_watch(api, engine)                 # both services' --stream-send-timeout
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, served, tp_size=factory.tp_size, options=api,
                           tokenizer_pool=pool, keys=keys, quota=quota, lora=lora,
                           sends=sends), server)
    readiness = Readiness(GENERATION_SERVICE, lambda: engine.ready, quota)
    readiness.add_to_server(server)
    shape = EngineShape(worker.block_size, worker.max_num_seqs, worker.dtype,
                        worker.attention_backend, max_waiting=config.max_waiting,
                        kv_cache_dtype=worker.kv_cache_dtype)
    def vllm_servicer(adapter: str | None = None) -> VllmEngineServicer:
        return VllmEngineServicer(engine, served, shape, kv_events, readiness.serving,
                                  options=api, tokenizer_pool=pool, keys=keys, quota=quota,
                                  adapter=adapter, sends=sends)

    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm_servicer(), server)
    add_reflection(server, (GENERATION_SERVICE, VLLM_ENGINE_SERVICE, HEALTH_SERVICE))
    port = public_port.bind(server, listen, api)
    adapter_ports = build_adapter_ports(adapter_listen, vllm_servicer, readiness, api, keys)
    metrics_server = start_metrics_server(options.metrics_listen, metrics.registry)
    return SchedulerServer(server, engine, readiness, client, port, options.grace_period_s,
                           metrics_server, adapter_ports)


async def serve_scheduler(workers: list[str], listen: str, worker: WorkerConfig,
                          policy: SchedulerConfig | None = None,
                          options: ServerOptions = ServerOptions(),
                          on_ready: Callable[[SchedulerServer], None] | None = None,
                          should_stop: Callable[[], str | None] | None = None,
                          exit_on_refusal: bool = False, *, api: ApiOptions = ApiOptions(),
                          worker_auth: WorkerAuth = WorkerAuth(),
                          on_drain: Callable[[], None] | None = None) -> int:
    """Start, call `on_ready` once the workers are initialized, and serve until SIGTERM/SIGINT
    (or until `should_stop()` returns a reason; or, with `exit_on_refusal`, until the workers
    refuse the first Init's settings); then drain and stop, running `on_drain` meanwhile (in a
    thread: it may stop a front whose last requests still need this server). Returns an exit
    code: 0, 1 when `should_stop` stopped it, 2 when the workers refused the settings."""
    app = build_scheduler_server(workers, listen, worker, policy, options, api=api,
                                 worker_auth=worker_auth)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    log.info("scheduler listening on %s (port %d); workers: %s", listen, app.port,
             ",".join(workers))
    if app.metrics_server is not None:
        print(f"deltaserve scheduler metrics on http://{app.metrics_server.address}/metrics",
              flush=True)
    refused: list[str] = []
    watcher = asyncio.create_task(_watch(app, stop, on_ready, should_stop,
                                         refused if exit_on_refusal else None))
    await stop.wait()
    watcher.cancel()
    # Why it stopped, read before on_drain stops what should_stop may be watching.
    reason = should_stop() if should_stop else None
    # A front (the OpenAI gateway) stops while we drain: its open OpenAI streams are ours to
    # finish within the grace period (cancelled at its end, which ends them at the front too),
    # and its own streams (KV events) end when it exits. Stopped first, it waited for streams
    # we no longer served until it was killed, and the grace period began only after that.
    front = asyncio.create_task(asyncio.to_thread(on_drain)) if on_drain is not None else None
    log.info("draining (grace period %.1f s; Ctrl-C again ends it now)", app.grace_period_s)
    hurry = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, _hurry, hurry)   # a repeated SIGTERM changes nothing
    await app.stop(hurry=hurry)
    if front is not None:
        await front
    if refused:
        return 2
    return 1 if reason else 0


def _hurry(hurry: asyncio.Event) -> None:
    if not hurry.is_set():
        log.warning("second Ctrl-C: ending the drain now (open streams get UNAVAILABLE)")
        hurry.set()


async def _watch(app: SchedulerServer, stop: asyncio.Event,
                 on_ready: Callable[[SchedulerServer], None] | None,
                 should_stop: Callable[[], str | None] | None,
                 refused: list[str] | None) -> None:
    """Announce readiness once; stop on `should_stop`, or (when `refused` is a list) on a refused
    first Init, whose reason is appended to it."""
    announced = False
    while not stop.is_set():
        if not announced and app.engine.ready:
            announced = True
            freeze_heap()    # start-up is over: collections walk only what requests make
            if on_ready:
                on_ready(app)
        if not announced and refused is not None and app.engine.refused:
            refused.append(app.engine.refused)
            log.error("stopping: the worker refused the settings: %s", app.engine.refused)
            stop.set()
            return
        reason = should_stop() if should_stop else None
        if reason:
            log.error("stopping: %s", reason)
            stop.set()
        await asyncio.sleep(0.1)


def run_scheduler(workers: list[str], listen: str, worker: WorkerConfig,
                  policy: SchedulerConfig | None = None,
                  options: ServerOptions = ServerOptions(),
                  on_ready: Callable[[SchedulerServer], None] | None = None,
                  should_stop: Callable[[], str | None] | None = None,
                  exit_on_refusal: bool = False, *, api: ApiOptions = ApiOptions(),
                  worker_auth: WorkerAuth = WorkerAuth(),
                  on_drain: Callable[[], None] | None = None) -> int:
    """Blocking `serve_scheduler` with logging to stderr."""
    shorten_gil_switch_interval()   # the engine's and the Step stream's threads wait less
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    if on_ready is None:
        on_ready = _print_ready(listen)
    return asyncio.run(serve_scheduler(workers, listen, worker, policy, options, on_ready,
                                       should_stop, exit_on_refusal, api=api,
                                       worker_auth=worker_auth, on_drain=on_drain))


def _print_ready(listen: str) -> Callable[[SchedulerServer], None]:
    def announce(app: SchedulerServer) -> None:
        host = listen.rsplit(":", 1)[0]
        print(f"DeltaServe scheduler ready on {host}:{app.port}", flush=True)
    return announce
