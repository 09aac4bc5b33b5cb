"""The public port's gate, one grpc.aio interceptor: API keys and undecodable requests.

- With --api-key-file, a call whose metadata lacks `authorization: Bearer <key>` naming one of the
  keys is refused UNAUTHENTICATED before its handler runs. grpc.health.v1 stays open for probes;
  server reflection too with --open-reflection.
- Every unary request is decoded here rather than by grpc itself: bytes that are not the request
  message are INVALID_ARGUMENT naming the method (grpc would answer UNKNOWN).

`caller_of(context)` names the key a call carried by a fingerprint (never the key itself), so
Abort can end only the caller's own requests.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import Callable, Iterable

import grpc

from engine_common.grpc_metadata import same_shape_handler
from engine_common.params import ParamError

AUTH_KEY = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/",
                       "/grpc.reflection.v1.ServerReflection/")
MIN_KEY_CHARS = 16
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7f))


def load_api_keys(path: str) -> frozenset[str]:
    """The keys of an API key file: one per line; blank lines and lines starting with # are
    skipped. ParamError names the file and the line of a key that is too short or not
    printable ASCII without spaces."""
    keys = set()
    with open(path, encoding="ascii", errors="replace") as f:
        for number, line in enumerate(f, 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if len(key) < MIN_KEY_CHARS or not set(key) <= _KEY_CHARS:
                raise ParamError("api_key_file", f"{path}:{number}", f"one key per line, each "
                                 f"at least {MIN_KEY_CHARS} printable ASCII characters without "
                                 "spaces")
            keys.add(key)
    if not keys:
        raise ParamError("api_key_file", path, "a file holding at least one key")
    return frozenset(keys)


def fingerprint(header: str) -> str:
    return hashlib.sha256(header.encode(errors="replace")).hexdigest()[:16]


def caller_of(context) -> str:
    """Who made a call: the fingerprint of its authorization header ("" without one)."""
    header = dict(context.invocation_metadata() or ()).get(AUTH_KEY)
    return fingerprint(header) if header else ""


class Gate(grpc.aio.ServerInterceptor):
    """API keys (when `keys` is not None) and safe decoding for every handler."""

    def __init__(self, keys: Iterable[str] | None = None, open_reflection: bool = False):
        self._allowed = None if keys is None else {fingerprint(f"Bearer {k}") for k in keys}
        self._open = (HEALTH_PREFIX,) + (REFLECTION_PREFIXES if open_reflection else ())

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        if self._allowed is not None and not details.method.startswith(self._open):
            header = dict(details.invocation_metadata or ()).get(AUTH_KEY)
            if header is None or fingerprint(header) not in self._allowed:
                what = "no API key" if header is None else "an unknown API key"
                return _refusal(handler, f"{what}: send `authorization: Bearer <key>` with a "
                                "key of the server's --api-key-file")
        return _safe_decoding(handler, details.method)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

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
    if not inspect.isasyncgenfunction(behavior):   # a coroutine that writes to the context
        return _unary_guard(behavior, refuse)

    async def guarded(request, context):
        if isinstance(request, _Undecodable):
            await refuse(request, context)
            return
        async for item in behavior(request, context):
            yield item
    return guarded
