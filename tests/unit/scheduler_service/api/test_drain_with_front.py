"""serve_scheduler stops its front (the OpenAI gateway, `on_drain`) while it drains, not before.

The gateway's open OpenAI streams are answered by this scheduler: it can finish them only while
the scheduler still serves. Stopped first, the gateway waited for those streams, the scheduler
did not serve them past its drain, and `deltaserve serve` killed the gateway after 15 s: an
OpenAI client streaming through SIGTERM got a connection cut mid-stream (curl: exit 18), and
the drain's grace period started only after those 15 s. Here the front's stop waits until it
sees the scheduler draining (readiness NOT_SERVING), as a gateway waits for its streams: before,
it never did and serve_scheduler did not return until the front gave up."""
from __future__ import annotations

import asyncio
import threading

from engine_common.configuration.config import WorkerConfig
from scheduler_service.api.server import ServerOptions, serve_scheduler
from tests.support.grpc_harness import free_port, health_status
from tests.support.sim_server import make_sim_model_dir


def test_the_front_stops_while_the_scheduler_drains(tmp_path):
    model_dir = make_sim_model_dir(tmp_path / "model")
    target = f"127.0.0.1:{free_port()}"
    stop = threading.Event()
    saw = []

    def front_stop() -> None:
        """Waits (as the gateway for its open streams) until the scheduler drains."""
        stop.set()
        for _ in range(3000):
            try:
                status = health_status(target, "", timeout=0.5)
            except Exception as e:  # noqa: BLE001 - the port closed: the drain is over
                status = type(e).__name__
            if status != "SERVING":
                saw.append(status)
                return
            threading.Event().wait(0.01)
        saw.append("never drained")

    # No worker answers at 127.0.0.1:1: the scheduler serves, not ready; `should_stop` stops
    # it at once (its port is open by then).
    code = asyncio.run(serve_scheduler(
        ["127.0.0.1:1"], target, WorkerConfig(model_dir=str(model_dir)),
        options=ServerOptions(grace_period_s=0.0),
        should_stop=lambda: "test",
        on_drain=front_stop))
    assert code == 1
    assert saw and saw[0] != "never drained", saw
