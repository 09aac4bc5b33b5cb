"""The epoch's stream key: only the caller that started an epoch may open its Step streams.

Within one epoch the worker token used to be the trust boundary: a holder of it read the owner's
epoch from Info, opened a Step stream of that epoch (which superseded the owner's at its first
step), learnt the next step number from STEP_GAP, and inherited the epoch's requests and KV
cache, another tenant's data. Now every Init and Reset makes a new random key (secrets, 32
bytes) that only its caller learns (InitResponse/ResetResponse.stream_key; never in Info, Health,
logs, metrics or a status). A Step stream presents it as metadata; one without it or with another
is refused PERMISSION_DENIED when it opens, before it reads a message: it cannot supersede the
owner's stream, learn a step number, nor hold a pool thread. The owner's reconnect within the
orphan grace presents the same key and takes over as before.

A stream opened before the epoch began (with the previous epoch's key) cannot step in it: the
scheduler opens new streams after every Init and Reset.

A Reset presents the current key too (the same metadata): the token holder could read the
owner's id from Info and Reset the owner's epoch with it, wiping its cache at will. Only Init at a
higher epoch takes a worker over without the key (fencing.py: a restarted scheduler holds none).

The rank ring (ranks/shm_ring.py) needs no key: only the service process writes it, after a step
was admitted here, and its shared memory is the worker's own (mode 0600, a random name). Each
node of a group has its own key (its own Init); the scheduler holds one per node.
"""
from __future__ import annotations

import hmac
import secrets
import threading

from engine_common.security.stream_key import STREAM_KEY_BYTES, STREAM_KEY_METADATA
from worker_service.failures import FailureKind, StepFailure


class StreamKeys:
    """The current epoch's key and the Step streams' ids. Thread-safe, with its own lock: a
    refused stream never waits behind a step or a model load."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keyed: tuple[int, bytes] | None = None    # (epoch, its key)
        self._opened = 0                                # stream ids handed out
        self._epoch_after = 0                           # higher ids opened in this epoch

    def new_epoch(self, epoch: int) -> None:
        """Init or Reset started `epoch`: a new key, the last one void."""
        with self._lock:
            self._keyed = (epoch, secrets.token_bytes(STREAM_KEY_BYTES))
            self._epoch_after = self._opened

    def key(self, epoch: int | None) -> bytes:
        """`epoch`'s key while it is the current one, else b"" (an epoch is started once, by
        one Init or Reset, whose caller is told the key)."""
        keyed = self._keyed
        return keyed[1] if keyed is not None and keyed[0] == epoch else b""

    def open(self, key: bytes | None) -> int:
        """A new stream's id, when `key` is the current epoch's (compared in constant time);
        else StepFailure NOT_ALLOWED, and nothing changes."""
        with self._lock:
            self._check(key, "Step stream")
            self._opened += 1
            return self._opened

    def check_reset(self, key: bytes | None) -> None:
        """StepFailure NOT_ALLOWED unless `key` is the current epoch's: a Reset is its caller's
        only, not any holder of the token who read the owner's id from Info."""
        with self._lock:
            self._check(key, "Reset")

    def check_key(self, key: bytes | None, call: str) -> None:
        """As check_reset, for another owner-only call (LoadLora, UnloadLora)."""
        with self._lock:
            self._check(key, call)

    def _check(self, key: bytes | None, call: str) -> None:
        keyed = self._keyed
        if not key or keyed is None or not hmac.compare_digest(key, keyed[1]):
            raise StepFailure(FailureKind.NOT_ALLOWED, _refusal(call, key, keyed))

    def check_step(self, stream_id: int, epoch: int) -> None:
        """NOT_ALLOWED for a stream opened before `epoch` (the current one) began."""
        keyed = self._keyed
        if keyed is not None and keyed[0] == epoch and stream_id <= self._epoch_after:
            raise StepFailure(FailureKind.NOT_ALLOWED,
                              f"this Step stream was opened before epoch {epoch} began: open "
                              "a new one with the key its Init or Reset returned")


def _refusal(call: str, key: bytes | None, keyed: tuple[int, bytes] | None) -> str:
    """Why `call` (a Step stream, a Reset) is refused; never a key, nor how close a wrong one
    came."""
    if keyed is None:
        return (f"{call} refused: the worker has no epoch yet (Init returns the epoch's "
                f"stream key, which every Step stream and Reset presents as "
                f"`{STREAM_KEY_METADATA}`)")
    what = "carries no" if not key else "carries the wrong"
    return (f"{call} refused: it {what} stream key (metadata `{STREAM_KEY_METADATA}`); "
            "every Step stream and Reset presents the key returned by the Init or Reset that "
            "started the current epoch, and only its caller has it")
