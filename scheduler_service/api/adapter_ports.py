"""One VllmEngine port per LoRA adapter (--lora-engine-listen; docs/lora.md, "Through the
gateway"): how the Shepherd Model Gateway's OpenAI `model` field picks an adapter.

The gateway (smg 1.13.0) routes a request by its `model` to a worker that registered that name
(GetModelInfo.served_model_name; any other name is HTTP 404 "No worker available for model")
and sends the worker no model or adapter field: vllm_engine.proto's GenerateRequest has none,
as vLLM's own gRPC servicer has none. So each adapter gets a port of its own whose GetModelInfo
names the adapter and whose every Generate runs it; the gateway lists that port as one more
worker (`--worker-urls grpc://HOST:PORT`). It is the same engine behind the same gate (TLS, API
keys, limits) as the main port, with the same health servicer (a drain covers every port).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import grpc

from engine_common.configuration.config import WorkerConfig
from engine_common.configuration.listen_address import ListenAddress
from engine_common.request.params import ParamError
from engine_common.wire.protos import VLLM_ENGINE_SERVICE, vllm_engine_pb2_grpc
from scheduler_service.api import public_port
from scheduler_service.api.health import HEALTH_SERVICE, Readiness
from scheduler_service.api.reflection import add_reflection
from scheduler_service.core.lora_registry import check_name

FIELD = "lora_engine_listen"


def parse_adapter_listen(text: str | None) -> tuple[tuple[str, str], ...]:
    """--lora-engine-listen as (adapter name, HOST:PORT) pairs: whitespace-separated
    NAME=HOST:PORT entries, names and addresses unique. ParamError naming the flag's field."""
    pairs = []
    for entry in (text or "").split():
        name, sep, address = entry.partition("=")
        if not sep or not ListenAddress().ok(address) or address == "off":
            raise ParamError(FIELD, entry, "NAME=HOST:PORT entries (port in [0, 65535])")
        try:
            check_name(name)
        except ParamError as e:
            raise ParamError(FIELD, entry, f"an adapter name of {e.allowed}") from None
        pairs.append((name, address))
    for i in (0, 1):
        seen = [p[i] for p in pairs]
        dup = sorted({v for v in seen if seen.count(v) > 1})
        if dup:
            raise ParamError(FIELD, dup, "unique adapter names and addresses")
    return tuple(pairs)


def adapter_listen_of(text: str | None, worker: WorkerConfig) -> tuple[tuple[str, str], ...]:
    """parse_adapter_listen, and ParamError unless every name can ever be served: it needs
    --enable-lora, and without runtime updating a name of --lora-modules (a port whose every
    request is NOT_FOUND would still be listed by the gateway)."""
    pairs = parse_adapter_listen(text)
    if pairs and not worker.enable_lora:
        raise ParamError("enable_lora", False, "true with --lora-engine-listen")
    names = [m.name for m in worker.lora]
    for name, _ in pairs:
        if not worker.allow_runtime_lora_updating and name not in names:
            raise ParamError(FIELD, name, f"an adapter of --lora-modules {names} (or start "
                             "with --allow-runtime-lora-updating and load it)")
    return pairs


def check_not_model_name(pairs: tuple[tuple[str, str], ...], model_name: str) -> None:
    """ParamError when an adapter has the model's served name: the gateway would take the
    model's port and the adapter's for one model's two workers and answer from either."""
    for name, _ in pairs:
        if name == model_name:
            raise ParamError(FIELD, name, f"an adapter name other than the model's served name "
                             f"{model_name!r} (--served-model-name renames the model)")


@dataclass
class AdapterPort:
    """One adapter's bound, not yet started gRPC server."""

    name: str
    address: str            # as given (HOST:PORT; port 0: any free one)
    server: grpc.aio.Server
    port: int               # the bound port


def build_adapter_ports(pairs: tuple[tuple[str, str], ...],
                        servicer_for: Callable[[str], vllm_engine_pb2_grpc.VllmEngineServicer],
                        readiness: Readiness, api, keys) -> list[AdapterPort]:
    """A server per (adapter, address) with `servicer_for(adapter)` and the main port's health
    servicer and gate; OSError when an address cannot be bound (the ones bound are stopped by
    the caller's failure path: nothing was started yet)."""
    ports = []
    for name, address in pairs:
        server = grpc.aio.server(options=public_port.port_options(api),
                                 interceptors=public_port.interceptors(api, keys))
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer_for(name), server)
        readiness.add_to_server(server)
        add_reflection(server, (VLLM_ENGINE_SERVICE, HEALTH_SERVICE))
        ports.append(AdapterPort(name, address, server, public_port.bind(server, address, api)))
    return ports


async def start_ports(ports: list[AdapterPort]) -> None:
    for p in ports:
        await p.server.start()


async def stop_ports(ports: list[AdapterPort], grace_s: float | None) -> None:
    for p in ports:
        await p.server.stop(grace_s)
