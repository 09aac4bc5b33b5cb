"""grpc.health.v1 for the scheduler service: liveness and readiness.

    service ""                          liveness: SERVING for as long as the process serves RPCs
    service "deltaserve.v1.Generation"  readiness: SERVING only while the engine is ready (every
                                        worker initialized); NOT_SERVING while a worker is
                                        missing or restarting, and from the start of a drain on

Readiness follows the engine by polling its `ready` flag on the event loop (a cheap attribute
read), so no callback ever crosses from the engine thread.

A Watch is a stream the server holds for as long as its client keeps it open: with
--max-requests-per-key N a key holds at most N at once (request_quota.py), the next one is
RESOURCE_EXHAUSTED naming the bound.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from scheduler_service.api.guard import caller_of
from scheduler_service.api.request_quota import WATCH, RequestQuota
from scheduler_service.api.status import status_for
from scheduler_service.core.admission import QueueFull

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

_POLL_SECONDS = 0.1


class _BoundedHealthServicer(health_aio.HealthServicer):
    """grpc's servicer, each key's Watch streams bounded by `quota` (none: unbounded)."""

    def __init__(self, quota: RequestQuota | None):
        super().__init__()
        self._quota = quota

    async def Watch(self, request, context) -> None:
        if self._quota is None:
            return await super().Watch(request, context)
        try:
            with self._quota.call(caller_of(context), "", WATCH):
                await super().Watch(request, context)
        except QueueFull as e:          # the key holds its bound of them (taken at once)
            await context.abort(*status_for(e))


class Readiness:
    """Owns the Health servicer and keeps the readiness entry in step with `is_ready()`.
    `quota`: bounds each key's Watch streams (--max-requests-per-key)."""

    def __init__(self, service_name: str, is_ready: Callable[[], bool],
                 quota: RequestQuota | None = None):
        self.service_name = service_name
        self._is_ready = is_ready
        self.servicer = _BoundedHealthServicer(quota)   # "" starts SERVING
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
