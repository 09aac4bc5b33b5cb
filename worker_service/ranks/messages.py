"""The messages between a worker service and its rank processes (msgpack, never pickle).

A step's diff and a step's RunnerOutput travel as they came, raw after a small header: the ring
adds no second envelope around the bytes the Step RPC carried.

Worker -> every rank, on the shared-memory broadcast ring:

    0x01, verify (1 byte), diff bytes ...     "step": run one diff; verify: return the digest too
    msgpack ["configure", {RunnerConfig fields}]
        join the process group (first time only), load or keep the model, measure the KV blocks
    msgpack ["allocate", num_kv_blocks]     drop cached requests, (re)allocate the KV cache
    msgpack ["reset"]                       drop cached requests
    msgpack ["lora_load", id, name, path]   load a LoRA adapter into slot id - 1 (docs/lora.md)
    msgpack ["lora_unload", id]             free that slot
    msgpack ["stop"]                        leave the loop and exit

(A msgpack array never starts with byte 0x01, so the first byte tells the two forms apart.)

Rank r -> worker, on reply ring r, exactly one reply per message:

    header length (4 bytes, little endian), msgpack header, payload bytes ...
    header = [error kind | None, message, digest bytes | None, info map]

`error kind` is a FailureKind value; `payload` is the encoded RunnerOutput from the output rank
(global rank 0) of a step, b"" from the others; `info` carries configure's measurements, and a
step's RankStepStats (ranks/rank_api.py: execute and phase seconds, requests cached).
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field

import msgpack

from worker_service.device_info import DeviceDescription

CONFIGURE, ALLOCATE, RESET, STEP, STOP = "configure", "allocate", "reset", "step", "stop"
LORA_LOAD, LORA_UNLOAD = "lora_load", "lora_unload"
COMMANDS = (CONFIGURE, ALLOCATE, RESET, STEP, STOP, LORA_LOAD, LORA_UNLOAD)
_STEP_TAG = 0x01
_HEADER_LEN = struct.Struct("<I")


class RankMessageError(ValueError):
    """A message on a rank ring does not have the documented shape."""


STEP_HEADER_BYTES = 2      # the tag and the verify byte before a step's diff


def encode_step(payload: bytes, verify: bool) -> bytes:
    return bytes((_STEP_TAG, int(verify))) + payload


def encode_command(name: str, *args) -> bytes:
    """A control command (not "step": see encode_step)."""
    if name not in COMMANDS or name == STEP:
        raise RankMessageError(f"command={name!r} is invalid: must be one of "
                               f"{tuple(c for c in COMMANDS if c != STEP)}")
    return msgpack.packb([name, *args], use_bin_type=True)


def decode_command(data: bytes) -> tuple[str, list]:
    """(name, args); a step's args are [diff bytes, verify]."""
    if data[:1] == bytes((_STEP_TAG,)):
        if len(data) < 2:
            raise RankMessageError("a step command without its verify byte")
        return STEP, [data[2:], bool(data[1])]
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise RankMessageError(f"undecodable rank command: {e}") from e
    if not isinstance(msg, list) or not msg or msg[0] not in COMMANDS or msg[0] == STEP:
        raise RankMessageError(f"rank command {msg!r:.80} is not [name, *args] with a name in "
                               f"{COMMANDS}")
    return msg[0], msg[1:]


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
    header = msgpack.packb([reply.kind, reply.message, reply.digest, reply.info],
                           use_bin_type=True)
    return _HEADER_LEN.pack(len(header)) + header + reply.payload


def decode_reply(data: bytes) -> RankReply:
    try:
        (size,) = _HEADER_LEN.unpack_from(data)
        kind, message, digest, info = msgpack.unpackb(data[4:4 + size], raw=False)
    except Exception as e:
        raise RankMessageError(f"undecodable rank reply: {e}") from e
    return RankReply(kind, message, data[4 + size:], digest, info)


def device_to_wire(d: DeviceDescription) -> dict:
    return dataclasses.asdict(d)


def device_from_wire(data: dict) -> DeviceDescription:
    return DeviceDescription(**data)
