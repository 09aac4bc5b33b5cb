"""The optional digest of a StepRequest's payload (StepRequest.digest): BLAKE2b, 16 bytes. A
step whose payload does not match it fails BAD_PAYLOAD before the ranks see it (and the epoch
with it, as any bad payload)."""
from __future__ import annotations

import hashlib

from worker_service.failures import FailureKind, StepFailure


def payload_digest(payload: bytes) -> bytes:
    """The optional StepRequest digest: BLAKE2b, 16 bytes, of the payload."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def check_digest(payload: bytes, digest: bytes | None) -> None:
    """StepFailure BAD_PAYLOAD when `digest` is given and is not the payload's."""
    if digest is not None and digest != payload_digest(payload):
        raise StepFailure(FailureKind.BAD_PAYLOAD, "the payload does not match its digest")
