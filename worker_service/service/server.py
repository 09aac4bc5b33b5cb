"""The worker service process: a synchronous gRPC server around one node worker.

One worker service runs per node. With one rank in all (--local-ranks 1 --nodes 1) the model
runs in this process (InProcessWorker); otherwise this process spawns --local-ranks rank processes
and relays every diff to them (RankGroupWorker), and all ranks of all --nodes join one
torch.distributed group of tp_size = nodes * local-ranks at the rendezvous address the scheduler
sends in Init (node 0's host and the scheduler's --dist-port).

Also serves grpc.health.v1 (service "" = liveness, "deltaserve.v1.Worker" = readiness: a model is
loaded and its KV cache allocated) when grpcio-health-checking is installed, and server
reflection when grpcio-reflection is installed; both are optional on worker machines.

    python -m worker_service.service.server --listen 127.0.0.1:50061 [--device cpu|cuda]
        [--local-ranks G] [--node-rank N] [--nodes M]

prints "deltaserve worker listening on HOST:PORT" once it accepts calls (port 0 picks a free one).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc

from engine_common.protos import WORKER_SERVICE, worker_pb2_grpc
from worker_service.service.in_process_worker import InProcessWorker
from worker_service.service.node_worker import NodeLayout, NodeWorker
from worker_service.service.rank_group_worker import RankGroupOptions, RankGroupWorker
from worker_service.service.servicer import WorkerServicer

log = logging.getLogger(__name__)

# Payloads carry whole prompts: allow large messages. Accept client keepalive pings every second
# so a scheduler can notice a dead link quickly.
# Seconds a stopping worker may take beyond its grace period before it exits anyway.
_STOP_SLACK_SECONDS = 5.0

SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),  # a port already in use is an error, not a silent share
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def node_layout(local_ranks: int = 1, node_rank: int = 0, num_nodes: int = 1) -> NodeLayout:
    """This node's layout from the worker's flags (ValueError naming the bad one)."""
    for name, value in (("local_ranks", local_ranks), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be an int >= 1")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) \
            or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank!r} is invalid: must be in [0, {num_nodes - 1}]")
    return NodeLayout(tp_size=local_ranks * num_nodes, node_rank=node_rank, num_nodes=num_nodes,
                      num_local_ranks=local_ranks)


def make_node_worker(device: str, layout: NodeLayout,
                     options: RankGroupOptions = RankGroupOptions()) -> NodeWorker:
    """In-process for a single rank in all; rank processes otherwise."""
    if layout.tp_size == 1:
        return InProcessWorker(device, layout)
    return RankGroupWorker(device, layout, options)


def serve_worker(listen: str, device: str = "cpu", *, local_ranks: int = 1, node_rank: int = 0,
                 num_nodes: int = 1, options: RankGroupOptions = RankGroupOptions(),
                 max_workers: int = 8) -> grpc.Server:
    """Start a worker service on `listen` (HOST:PORT) for `device`; returns the started server.

    The bound port (useful with port 0) is in `server.bound_port`, the NodeWorker in
    `server.node_worker` (call its close() after stopping the server).
    """
    worker = make_node_worker(device, node_layout(local_ranks, node_rank, num_nodes), options)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="worker-rpc"),
                         options=SERVER_OPTIONS)
    set_ready = _add_health(server)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker, set_ready), server)
    _add_reflection(server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not listen on {listen!r}")
    server.start()
    server.bound_port = port
    server.node_worker = worker
    server.local_worker = worker  # the older name
    return server


def run_worker(listen: str, device: str = "cpu", *, local_ranks: int = 1, node_rank: int = 0,
               num_nodes: int = 1, options: RankGroupOptions = RankGroupOptions(),
               grace_s: float = 5.0) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully (in-flight calls get `grace_s`) and
    stop the rank processes."""
    server = serve_worker(listen, device, local_ranks=local_ranks, node_rank=node_rank,
                          num_nodes=num_nodes, options=options)
    host = listen.rsplit(":", 1)[0]
    print(f"deltaserve worker listening on {host}:{server.bound_port} (device {device}, node "
          f"{node_rank} of {num_nodes}, {local_ranks} local ranks)", flush=True)
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():  # a second Ctrl-C / SIGTERM: do not wait any longer
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    stop.wait()
    log.info("stopping worker (grace %.1fs)", grace_s)
    # A stop that outlives its grace (a call or a rank that will not end) must not leave the
    # worker running, e.g. after its parent `deltaserve serve` was killed.
    watchdog = threading.Timer(grace_s + _STOP_SLACK_SECONDS, os._exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    server.stop(grace_s).wait()
    server.node_worker.close()
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a DeltaServe worker service.")
    parser.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT (port 0: any)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda (rank r uses cuda:r) or cuda:N (one local rank)")
    parser.add_argument("--local-ranks", type=int, default=1,
                        help="rank processes (devices) on this node (default: 1)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's index, 0 .. nodes-1; node 0 hosts the rendezvous and "
                             "the output rank (default: 0)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="worker services (nodes) in the tensor-parallel group (default: 1)")
    parser.add_argument("--dist-timeout", type=float, default=RankGroupOptions.dist_timeout_s,
                        help="seconds a rendezvous or a collective may take (default: "
                             f"{RankGroupOptions.dist_timeout_s:g})")
    parser.add_argument("--rank-step-timeout", type=float,
                        default=RankGroupOptions.step_timeout_s,
                        help="seconds one step may take on the ranks before they count as "
                             f"stuck (default: {RankGroupOptions.step_timeout_s:g})")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = RankGroupOptions(dist_timeout_s=args.dist_timeout,
                               step_timeout_s=args.rank_step_timeout)
    try:
        node_layout(args.local_ranks, args.node_rank, args.nodes)
    except ValueError as e:
        parser.error(str(e))
    run_worker(args.listen, args.device, local_ranks=args.local_ranks, node_rank=args.node_rank,
               num_nodes=args.nodes, options=options)


if __name__ == "__main__":
    main()
