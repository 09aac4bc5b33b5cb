"""The worker service process: a synchronous gRPC server around one node worker.

One worker service runs per node. With one rank in all (--local-ranks 1 --nodes 1) the model
runs in this process (a RunnerKeeper); otherwise this process spawns --local-ranks rank processes
and relays every diff to them (a RankGroup), and all ranks of all --nodes join one
torch.distributed group of tp_size = nodes * local-ranks at the rendezvous address the scheduler
sends in Init (node 0's host and the scheduler's --dist-port).

Also serves grpc.health.v1 (service "" = liveness, "deltaserve.v1.Worker" = readiness: a model is
loaded and its KV cache allocated) when grpcio-health-checking is installed, and server
reflection when grpcio-reflection is installed; both are optional on worker machines.

Every call but grpc.health.v1's Check must carry the worker's credential (service/auth.py): the
token of --worker-token-file and/or a client certificate (--worker-tls-*); a worker with neither
listens on loopback only, unless --insecure. Every handler runs on one of the pool's
`max_workers` threads, so no streaming method is open to a caller without the credential.

Started by `deltaserve worker --listen HOST:PORT [flags of WorkerServiceOptions and
WorkerCredentials]`, which prints "deltaserve worker listening on HOST:PORT" once it accepts
calls (port 0 picks a free one).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent import futures

import grpc

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.configuration.listen_address import check_bind_port
from engine_common.runtime.gil_switch import shorten_gil_switch_interval
from engine_common.runtime.metrics_http import start_metrics_server
from engine_common.runtime.stop_signals import StopSignals
from engine_common.wire.protos import WORKER_SERVICE, worker_pb2_grpc
from engine_common.security.worker_auth import WorkerAuth
from worker_service.config import NodeLayout
from worker_service.device_info import resolve_device
from worker_service.ranks.messages import STEP_HEADER_BYTES
from worker_service.ranks.rank_group import RankGroup, RankGroupOptions
from worker_service.ranks.rank_set import RankSetOptions
from worker_service.ranks.runner_keeper import RunnerKeeper
from worker_service.service.auth import add_port, check_exposure, describe, interceptors
from worker_service.service.init_checks import MIB, InitGuards
from worker_service.service.node_worker import NodeWorker
from worker_service.service.orphan_watch import ORPHAN_GRACE_S
from worker_service.service.servicer import WorkerServicer
from worker_service.service.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

# Seconds a stopping worker may take beyond its grace period before it exits anyway.
_STOP_SLACK_SECONDS = 5.0

# Accept client keepalive pings every second so a scheduler can notice a dead link quickly. The
# message size limit (payloads carry whole prompts) comes from --max-message-mib.
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silent share
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def node_layout(options: WorkerServiceOptions) -> NodeLayout:
    """This node's layout from the worker's flags."""
    return NodeLayout(tp_size=options.local_ranks * options.nodes, node_rank=options.node_rank,
                      num_nodes=options.nodes, num_local_ranks=options.local_ranks)


def make_node_worker(device: str, layout: NodeLayout,
                     options: RankGroupOptions = RankGroupOptions(),
                     guards: InitGuards = InitGuards(),
                     orphan_grace_s: float = ORPHAN_GRACE_S) -> NodeWorker:
    """In-process for a single rank in all; rank processes otherwise."""
    ranks = RunnerKeeper(device) if layout.tp_size == 1 else RankGroup(device, layout, options)
    return NodeWorker(ranks, layout, guards, orphan_grace_s)


def serve_worker(listen: str, options: WorkerServiceOptions = WorkerServiceOptions(),
                 auth: WorkerAuth = WorkerAuth(), max_workers: int = 8) -> grpc.Server:
    """Start a worker service on `listen` (HOST:PORT); returns the started server. ParamError
    for a worker without credentials on a non-loopback address (unless options.insecure).

    The bound port (useful with port 0) is in `server.bound_port`, the NodeWorker in
    `server.node_worker` (call its close() after stopping the server), the /metrics endpoint
    (options.metrics_listen) in `server.metrics_server` (None when off; stop it too).
    """
    check_exposure(listen, auth, options.insecure)
    guards = InitGuards(model_root=options.model_root,
                        max_message_bytes=options.max_message_mib * MIB)
    # Every diff the port accepts must also fit the rank ring.
    ring = RankSetOptions(max_message_bytes=guards.max_message_bytes + STEP_HEADER_BYTES)
    rank_options = RankGroupOptions(dist_timeout_s=options.dist_timeout_s,
                                    step_timeout_s=options.rank_step_timeout_s, rank_set=ring)
    worker = make_node_worker(resolve_device(options.device), node_layout(options), rank_options,
                              guards, options.orphan_grace_s)
    size = (("grpc.max_send_message_length", guards.max_message_bytes),
            ("grpc.max_receive_message_length", guards.max_message_bytes))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="worker-rpc"),
                         interceptors=interceptors(auth), options=SERVER_OPTIONS + size)
    set_ready = _add_health(server)
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerServicer(worker, set_ready, options.simulated_device_ms), server)
    _add_reflection(server)
    check_bind_port(listen)
    port = add_port(server, listen, auth)
    if port == 0:
        raise OSError(f"could not listen on {listen!r}")
    metrics = WorkerMetrics(worker)
    worker.step_listener = metrics.observe_step
    server.metrics_server = start_metrics_server(options.metrics_listen, metrics.registry)
    server.start()
    server.bound_port = port
    server.node_worker = worker
    return server


def run_worker(listen: str, options: WorkerServiceOptions = WorkerServiceOptions(),
               auth: WorkerAuth = WorkerAuth(), grace_s: float = 5.0) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully (in-flight calls get `grace_s`) and
    stop the rank processes."""
    shorten_gil_switch_interval()   # the Step stream's threads wait less for each other
    server = serve_worker(listen, options, auth)
    host = listen.rsplit(":", 1)[0]
    print(f"deltaserve worker listening on {host}:{server.bound_port} (device "
          f"{server.node_worker.device}, node {options.node_rank} of {options.nodes}, "
          f"{options.local_ranks} local ranks; {describe(auth)})", flush=True)
    if server.metrics_server is not None:
        print(f"deltaserve worker metrics on http://{server.metrics_server.address}/metrics",
              flush=True)
    signals = StopSignals()
    signals.wait()
    log.info("stopping worker (grace %.1fs)", grace_s)
    # A stop that outlives its grace (a call or a rank that will not end) must not leave the
    # worker running, e.g. after its parent `deltaserve serve` was killed.
    watchdog = threading.Timer(grace_s + _STOP_SLACK_SECONDS, os._exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    server.stop(grace_s).wait()
    server.node_worker.close()
    if server.metrics_server is not None:
        server.metrics_server.stop()
    watchdog.cancel()


def _add_health(server: grpc.Server):
    """Register grpc.health.v1 if available; returns a callback that sets readiness."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:
        return None
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    status = health_pb2.HealthCheckResponse
    servicer.set("", status.SERVING)
    servicer.set(WORKER_SERVICE, status.NOT_SERVING)

    def set_ready(ready: bool) -> None:
        servicer.set(WORKER_SERVICE, status.SERVING if ready else status.NOT_SERVING)

    return set_ready


def _add_reflection(server: grpc.Server) -> None:
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        return
    names = [WORKER_SERVICE, reflection.SERVICE_NAME, "grpc.health.v1.Health"]
    reflection.enable_server_reflection(names, server)
