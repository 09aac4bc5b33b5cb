"""The public port's gate, one grpc.aio interceptor: API keys and undecodable requests.

- With --api-key-file, a call whose metadata lacks `authorization: Bearer <key>` naming one of the
  keys is refused UNAUTHENTICATED before its handler runs. grpc.health.v1 stays open for probes;
  server reflection too with --open-reflection. The operator's methods (api_keys.ADMIN_METHODS)
  are PERMISSION_DENIED to a key not marked `admin` in the file.
- Every unary request is decoded here rather than by grpc itself: bytes that are not the request
  message are INVALID_ARGUMENT naming the method (grpc would answer UNKNOWN).

`caller_of(context)` names the key a call carried by a fingerprint (never the key itself), so
Abort can end only the caller's own requests, and `scoped_id` gives each key its own request ids.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import grpc

from engine_common.security.grpc_metadata import same_shape_handler
from scheduler_service.api.api_keys import ADMIN_METHODS, KeyBook, KeyPolicy, fingerprint

AUTH_KEY = "authorization"
# Open without a key: the probes' Check (Kubernetes, grpc-health-probe). Not Watch, a stream
# the server holds for as long as its client likes (as on the worker's port).
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/",
                       "/grpc.reflection.v1.ServerReflection/")
def caller_of(context) -> str:
    """Who made a call: the fingerprint of its authorization header ("" without one)."""
    header = dict(context.invocation_metadata() or ()).get(AUTH_KEY)
    return fingerprint(header) if header else ""


def scoped_id(caller: str, request_id: str) -> str:
    """The engine's id of `caller`'s request `request_id`: each API key has its own namespace of
    ids, so a live id of another key is neither refused nor revealed (issue 23); without keys,
    the id itself."""
    return f"{caller}/{request_id}" if caller else request_id


def client_id(caller: str, engine_id: str) -> str:
    """The id the caller gave (scoped_id undone)."""
    return engine_id.removeprefix(f"{caller}/") if caller else engine_id


def pool_caller(context) -> str:
    """Whose share of the tokenizer threads a call uses: its API key's, else its client
    address's (the host of `ipv4:HOST:PORT` / `ipv6:[HOST]:PORT`: one client, many connections)."""
    return caller_of(context) or (context.peer() or "").rsplit(":", 1)[0]


# What a call whose key the book does not know may do (the Gate refuses such calls first).
_NO_RIGHTS = KeyPolicy(salt="unknown", admin=False, min_priority=0)


def policy_of(context, keys: KeyBook) -> KeyPolicy:
    """What the key a call carried may do (everything in the open mode)."""
    return keys.policy_of(dict(context.invocation_metadata() or ()).get(AUTH_KEY)) or _NO_RIGHTS


class Gate(grpc.aio.ServerInterceptor):
    """API keys (when `keys` has some) and safe decoding for every handler."""

    def __init__(self, keys: KeyBook = KeyBook(), open_reflection: bool = False):
        self._keys = keys
        self._open = (HEALTH_CHECK,) + (REFLECTION_PREFIXES if open_reflection else ())

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        if not self._keys.open and not details.method.startswith(self._open):
            header = dict(details.invocation_metadata or ()).get(AUTH_KEY)
            policy = self._keys.policy_of(header)
            if policy is None:
                what = "no API key" if header is None else "an unknown API key"
                return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                                f"{what}: send `authorization: Bearer <key>` with a key of the "
                                "server's --api-key-file")
            if details.method in ADMIN_METHODS and not policy.admin:
                return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                                f"{details.method.lstrip('/')} is for the operator: a key marked "
                                "`admin` in the server's --api-key-file")
        return _safe_decoding(handler, details.method)


def _refusal(handler: grpc.RpcMethodHandler, status: grpc.StatusCode,
             message: str) -> grpc.RpcMethodHandler:
    async def abort(request_or_iterator, context):
        await context.abort(status, message)

    return same_shape_handler(handler, abort)


class _Undecodable:
    def __init__(self, reason: str):
        self.reason = reason


def _safe_decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """The handler with a deserializer that never raises: bytes that do not decode reach the
    behaviour as _Undecodable, which aborts INVALID_ARGUMENT naming the method."""
    decode = handler.request_deserializer
    if handler.request_streaming or decode is None:
        return handler

    def safe(data: bytes):
        try:
            return decode(data)
        except Exception as e:   # protobuf's DecodeError, or anything a parser raises
            return _Undecodable(f"{type(e).__name__}: {e}")

    async def refuse(request: _Undecodable, context) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request to {method.lstrip('/')} could not be decoded "
                            f"({request.reason})")

    if handler.response_streaming:
        return handler._replace(request_deserializer=safe,
                                unary_stream=_stream_guard(handler.unary_stream, refuse))
    return handler._replace(request_deserializer=safe,
                            unary_unary=_unary_guard(handler.unary_unary, refuse))


def _unary_guard(behavior: Callable, refuse: Callable) -> Callable:
    async def guarded(request, context):
        if isinstance(request, _Undecodable):
            return await refuse(request, context)
        return await behavior(request, context)
    return guarded


def _stream_guard(behavior: Callable, refuse: Callable) -> Callable:
    """The handler as a coroutine that writes each item of `behavior` (an async generator) to
    the context: what grpc does with a generator handler, without a second generator layer
    between it and grpc on every message. The generator is closed when the call ends early
    (cancelled, a failed write), so its cleanup (aborting the request) runs at once."""
    if not inspect.isasyncgenfunction(behavior):   # a coroutine that writes to the context
        return _unary_guard(behavior, refuse)

    async def guarded(request, context):
        if isinstance(request, _Undecodable):
            return await refuse(request, context)
        async with contextlib.aclosing(behavior(request, context)) as items:
            async for item in items:
                await context.write(item)
    return guarded
