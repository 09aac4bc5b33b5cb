"""Unauthenticated streams held open on a worker port, as an attacker would (issue 23, item 1);
run as a script, the issue's soak: a token-guarded worker and its scheduler, 32 streams of each
kind held open for 60 s while a client sends requests through the scheduler one after another;
every one must succeed (exit 1 otherwise).

    python -m bench.worker_port_flood [--model DIR] [--seconds 60] [--per-kind 32]

    with PortFlood(address, per_kind=32) as flood:
        flood.wait_settled(timeout_s)   # each stream answered once or ended
        ... the scheduler must keep serving ...
    flood.outcomes()                    # kind -> how its streams ended (status names)

Three kinds, every streaming service a worker port answers: server reflection (a request sent,
the request stream then held open), grpc.health.v1 `Watch`, and `Worker/Step` without a token
(the request stream held open, nothing sent). Each stream has its own client-side waiter; the
whole flood ends when the context exits (the request streams are released, the calls cancelled).
"""
from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.services import Services
from deltaserve.default_model import default_model_dir
from engine_common.wire.protos import generation_pb2, generation_pb2_grpc, worker_pb2_grpc

KINDS = ("reflection", "health_watch", "step")


class PortFlood:
    """`per_kind` streams of each of KINDS against `address`, held open until close()."""

    def __init__(self, address: str, per_kind: int = 32, deadline_s: float = 600.0):
        self._release = threading.Event()
        self._channels = {kind: grpc.insecure_channel(address) for kind in KINDS}
        self._calls: list[tuple[str, object]] = []
        self._first: dict[int, str] = {}
        opener = {"reflection": self._reflection, "health_watch": self._watch,
                  "step": self._step}
        for kind in KINDS:
            for _ in range(per_kind):
                self._calls.append((kind, opener[kind](deadline_s)))
        self._settled = [threading.Event() for _ in self._calls]
        for i in range(len(self._calls)):
            threading.Thread(target=self._wait_first, args=(i,), daemon=True).start()

    def _held(self, first=None):
        """A request stream that sends `first` (if any), then waits for the release."""
        if first is not None:
            yield first
        self._release.wait()

    def _reflection(self, deadline_s: float):
        stub = reflection_pb2_grpc.ServerReflectionStub(self._channels["reflection"])
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        return stub.ServerReflectionInfo(self._held(request), timeout=deadline_s)

    def _watch(self, deadline_s: float):
        stub = health_pb2_grpc.HealthStub(self._channels["health_watch"])
        return stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=deadline_s)

    def _step(self, deadline_s: float):
        stub = worker_pb2_grpc.WorkerStub(self._channels["step"])
        return stub.Step(self._held(), timeout=deadline_s)

    def _wait_first(self, i: int) -> None:
        """Records how stream `i` first answered: "answered" (a message: the server holds it) or
        its status name."""
        _, call = self._calls[i]
        try:
            next(call)
            self._first[i] = "answered"
        except StopIteration:
            self._first[i] = "OK"
        except grpc.RpcError as e:
            self._first[i] = e.code().name
        self._settled[i].set()

    def wait_settled(self, timeout_s: float) -> int:
        """Waits (at most `timeout_s` in all) until every stream answered once or ended; returns
        how many did (a stream queued behind a full thread pool never does)."""
        done = threading.Event()
        threading.Thread(target=lambda: ([e.wait() for e in self._settled], done.set()),
                         daemon=True).start()
        done.wait(timeout_s)
        return sum(e.is_set() for e in self._settled)

    def outcomes(self) -> dict[str, dict[str, int]]:
        """kind -> {first outcome: count} ("pending" for a stream not answered yet)."""
        out: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
        for i, (kind, _) in enumerate(self._calls):
            what = self._first.get(i, "pending")
            out[kind][what] = out[kind].get(what, 0) + 1
        return out

    def close(self) -> None:
        self._release.set()
        for _, call in self._calls:
            call.cancel()
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> "PortFlood":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _requests(target: str, seconds: float) -> tuple[int, list[str]]:
    """Greedy 8-token requests one after another for `seconds`: (successes, failures)."""
    ok, failures = 0, []
    request = generation_pb2.GenerateRequest(
        token_ids=[5, 6, 7], stopping=generation_pb2.StoppingCriteria(max_tokens=8,
                                                                       ignore_eos=True))
    deadline = time.monotonic() + seconds
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            try:
                tokens = sum(len(m.token_ids) for m in stub.Generate(request, timeout=30))
                ok += tokens == 8
            except grpc.RpcError as e:
                failures.append(f"{e.code().name}: {e.details()}")
    return ok, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--per-kind", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, Services(tmp) as services:
        token = Path(tmp) / "token"
        token.write_text(secrets.token_urlsafe(32))
        flags = ("--worker-token-file", str(token))
        target = services.start(args.model, "cpu", list(flags), worker_flags=flags)
        with PortFlood(f"127.0.0.1:{services.worker_port}", args.per_kind) as flood:
            settled = flood.wait_settled(30)
            ok, failures = _requests(target, args.seconds)
            outcomes = flood.outcomes()
    print(f"{args.per_kind} streams of each of {', '.join(KINDS)} ({settled} settled): "
          f"{outcomes}")
    print(f"requests through the scheduler in {args.seconds:g} s: {ok} succeeded, "
          f"{len(failures)} failed {failures[:3]}")
    return 0 if ok and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
