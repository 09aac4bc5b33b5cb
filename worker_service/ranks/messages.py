"""The messages between a worker service and its rank processes, as msgpack (never pickle).

Worker -> every rank, on the shared-memory broadcast ring, one msgpack array per message:

    ["configure", {RunnerConfig fields}, gpu_memory_utilization | None]
        join the process group (first time only), load or keep the model, measure the KV blocks
    ["allocate", num_kv_blocks]     drop cached requests, (re)allocate the KV cache
    ["reset"]                       drop cached requests
    ["step", payload bytes, verify] run one diff; verify: also return the state digest
    ["stop"]                        leave the loop and exit

Rank r -> worker, on reply ring r, exactly one reply per message:

    [error kind | None, message, payload bytes, digest bytes | None, info map]

`error kind` is a FailureKind value; `payload` is the encoded RunnerOutput from the output rank
(global rank 0) of a step, b"" from the others; `info` carries configure's measurements.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

from worker_service.config import RunnerConfig
from worker_service.device_info import DeviceDescription

CONFIGURE, ALLOCATE, RESET, STEP, STOP = "configure", "allocate", "reset", "step", "stop"
COMMANDS = (CONFIGURE, ALLOCATE, RESET, STEP, STOP)


class RankMessageError(ValueError):
    """A message on a rank ring does not have the documented shape."""


def encode_command(name: str, *args) -> bytes:
    if name not in COMMANDS:
        raise RankMessageError(f"command={name!r} is invalid: must be one of {COMMANDS}")
    return msgpack.packb([name, *args], use_bin_type=True)


def decode_command(data: bytes) -> tuple[str, list]:
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise RankMessageError(f"undecodable rank command: {e}") from e
    if not isinstance(msg, list) or not msg or msg[0] not in COMMANDS:
        raise RankMessageError(f"rank command {msg!r:.80} is not [name, *args] with a name in "
                               f"{COMMANDS}")
    return msg[0], msg[1:]


def config_to_wire(config: RunnerConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_wire(data: dict) -> RunnerConfig:
    return RunnerConfig(**data)


@dataclass(frozen=True)
class RankReply:
    """One rank's answer to one message; `kind` None means success."""

    kind: str | None = None
    message: str = ""
    payload: bytes = b""
    digest: bytes | None = None
    info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.kind is None


def encode_reply(reply: RankReply) -> bytes:
    return msgpack.packb([reply.kind, reply.message, reply.payload, reply.digest, reply.info],
                         use_bin_type=True)


def decode_reply(data: bytes) -> RankReply:
    try:
        kind, message, payload, digest, info = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise RankMessageError(f"undecodable rank reply: {e}") from e
    return RankReply(kind, message, payload, digest, info)


def device_to_wire(d: DeviceDescription) -> dict:
    return dataclasses.asdict(d)


def device_from_wire(data: dict) -> DeviceDescription:
    return DeviceDescription(**data)
