"""The worker service process: a synchronous gRPC server around one LocalWorker.

Also serves grpc.health.v1 (service "" = liveness, "deltaserve.v1.Worker" = readiness: a model is
loaded and its KV cache allocated) when grpcio-health-checking is installed, and server
reflection when grpcio-reflection is installed; both are optional on worker machines.

    python -m worker_service.server --listen 127.0.0.1:50061 [--device cpu|cuda]

prints "deltaserve worker listening on HOST:PORT" once it accepts calls (port 0 picks a free one).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from concurrent import futures

import grpc

from engine_common.protos import WORKER_SERVICE, worker_pb2_grpc
from worker_service.local_worker import LocalWorker
from worker_service.servicer import WorkerServicer

log = logging.getLogger(__name__)

# Payloads carry whole prompts: allow large messages. Accept client keepalive pings every second
# so a scheduler can notice a dead link quickly.
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def serve_worker(listen: str, device: str = "cpu", *, max_workers: int = 8) -> grpc.Server:
    """Start a worker service on `listen` (HOST:PORT) for `device`; returns the started server.

    The bound port (useful with port 0) is in `server.bound_port`.
    """
    worker = LocalWorker(device)
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
    server.local_worker = worker
    return server


def run_worker(listen: str, device: str = "cpu", *, grace_s: float = 5.0) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully (in-flight calls get `grace_s`)."""
    server = serve_worker(listen, device)
    host = listen.rsplit(":", 1)[0]
    print(f"deltaserve worker listening on {host}:{server.bound_port} (device {device})",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping worker (grace %.1fs)", grace_s)
    server.stop(grace_s).wait()


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
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(args.listen, args.device)


if __name__ == "__main__":
    main()
