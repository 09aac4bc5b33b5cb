"""grpc.health.v1 for the scheduler service: liveness and readiness.

    service ""                          liveness: SERVING for as long as the process serves RPCs
    service "deltaserve.v1.Generation"  readiness: SERVING only while the engine is ready (every
                                        worker initialized); NOT_SERVING while a worker is
                                        missing or restarting, and from the start of a drain on

Readiness follows the engine by polling its `ready` flag on the event loop (a cheap attribute
read), so no callback ever crosses from the engine thread.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

_POLL_SECONDS = 0.1


class Readiness:
    """Owns the Health servicer and keeps the readiness entry in step with `is_ready()`."""

    def __init__(self, service_name: str, is_ready: Callable[[], bool]):
        self.service_name = service_name
        self._is_ready = is_ready
        self.servicer = health_aio.HealthServicer()   # "" starts SERVING
        self._draining = False
        self._published: int | None = None
        self._task: asyncio.Task | None = None

    def serving(self) -> bool:
        """Ready and not draining: what the readiness entry says (without the poll's delay)."""
        return not self._draining and self._is_ready()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        """Publish the current readiness and keep it updated until `drain()`."""
        await self._publish()
        self._task = asyncio.create_task(self._follow(), name="readiness")

    async def drain(self) -> None:
        """Readiness goes NOT_SERVING for good (liveness stays SERVING while RPCs finish)."""
        self._draining = True
        if self._task is not None:
            self._task.cancel()
        await self.servicer.set(self.service_name, NOT_SERVING)

    async def _follow(self) -> None:
        while not self._draining:
            await asyncio.sleep(_POLL_SECONDS)
            await self._publish()

    async def _publish(self) -> None:
        if self._draining:
            return
        status = SERVING if self._is_ready() else NOT_SERVING
        if status != self._published:   # only on change: `set` wakes every Watch stream
            self._published = status
            await self.servicer.set(self.service_name, status)
