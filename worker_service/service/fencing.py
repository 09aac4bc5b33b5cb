"""Fencing: a worker serves one scheduler at a time, the owner of the highest epoch it accepted.

    check(epoch)          Init: the epoch must be above every epoch accepted before
    take(epoch, owner)    Init succeeded (the model loaded): `owner` now drives the worker (a
                          takeover when it differs from the previous owner)
    check_reset(e, owner) Reset: only the owner may reset, and only to a higher epoch
    stale(epoch)          the STALE_EPOCH failure of a step that carries an older epoch

Epochs only grow. A scheduler that starts reads the worker's epoch from Info and goes above it,
so the newest scheduler wins; the one it displaced learns so from STALE_EPOCH (its next step, or
its next Init) and stops. An epoch may climb at most MAX_EPOCH_JUMP at a time, and a scheduler id
is at most MAX_OWNER_CHARS: otherwise one credential holder could set 2^64 - 1 and lock every
later scheduler out until the worker restarts, or make every status and log line carry a
megabyte of id (both refused INVALID_ARGUMENT, naming the value and the range). Not thread-safe: the node worker calls it under its lock (`check` also
before it, to refuse a stale Init without disturbing the owner's step).
"""
from __future__ import annotations

from dataclasses import dataclass

from worker_service.failures import FailureKind, StepFailure

MAX_EPOCH_JUMP = 1 << 32     # legitimate schedulers go one above the highest epoch they saw
MAX_OWNER_CHARS = 256        # host:pid:random is a few dozen


@dataclass
class Fence:
    epoch: int = 0        # the highest epoch accepted; 0 before the first Init
    owner: str = ""       # the scheduler id that set it

    def _current(self) -> str:
        return f"the worker's epoch is {self.epoch} (scheduler {self.owner or '?'})"

    def check(self, epoch: int) -> None:
        if epoch > self.epoch + MAX_EPOCH_JUMP:
            raise StepFailure(FailureKind.INVALID_SETTINGS,
                              f"epoch={epoch} is invalid: must be in [{self.epoch + 1}, "
                              f"{self.epoch + MAX_EPOCH_JUMP}] ({self._current()}; an epoch "
                              f"climbs at most {MAX_EPOCH_JUMP} at a time)")
        if epoch <= self.epoch:
            raise StepFailure(FailureKind.STALE_EPOCH,
                              f"epoch {epoch} is stale: {self._current()}; a scheduler takes a "
                              "worker over only with a higher epoch (see Info)")

    def take(self, epoch: int, owner: str) -> str | None:
        """Accept `epoch` from `owner` (its length checked by the caller, before any work:
        NodeWorker.init, check_reset); returns the previous owner when this is a takeover."""
        self.check(epoch)
        previous = self.owner if self.owner and self.owner != owner else None
        self.epoch, self.owner = epoch, owner
        return previous

    def check_reset(self, epoch: int, owner: str) -> None:
        check_owner(owner)
        if not self.epoch or owner != self.owner:
            raise StepFailure(FailureKind.STALE_EPOCH,
                              f"scheduler {owner or '?'} does not own this worker: "
                              f"{self._current()}; Init with a higher epoch takes it over")
        self.check(epoch)

    def stale(self, epoch: int, step: int) -> StepFailure:
        return StepFailure(FailureKind.STALE_EPOCH,
                           f"step {step} carries epoch {epoch}, which is stale: "
                           f"{self._current()}; this scheduler was superseded and must stop")


def check_owner(owner: str) -> None:
    """A scheduler id longer than MAX_OWNER_CHARS is refused before it is stored or logged."""
    if len(owner) > MAX_OWNER_CHARS:
        raise StepFailure(FailureKind.INVALID_SETTINGS,
                          f"scheduler_id of {len(owner)} characters is invalid: must be at most "
                          f"{MAX_OWNER_CHARS}")
