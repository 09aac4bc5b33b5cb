"""Why a step or an Init failed: the failure kinds of the worker side, raised as StepFailure.

NOTE one exception -> kind mapping (`as_failure`), applied where the exception is caught (the
runner keeper, a rank process, the node worker); the kind travels as its value on the rank ring;
the servicer maps each kind to one StepError code and one gRPC status (servicer.FAILURES).
"""
from __future__ import annotations

import enum

from engine_common.wire.codec import CodecError


class FailureKind(enum.Enum):
    """Why a step or an Init was refused or failed."""

    UNAUTHENTICATED = "unauthenticated"  # no or a wrong worker credential
    NOT_ALLOWED = "not allowed"     # a CA-signed client cert not in --worker-tls-allowed-clients
    NOT_INITIALIZED = "not initialized"
    EPOCH_MISMATCH = "epoch mismatch"
    STALE_EPOCH = "stale epoch"     # older than the worker's: another scheduler took it over
    STEP_GAP = "step gap"
    SUPERSEDED = "superseded"
    BAD_PAYLOAD = "bad payload"     # undecodable bytes or a wrong digest
    BAD_STATE = "bad state"         # decodes, but does not fit the cached requests
    EPOCH_FAILED = "epoch failed"   # an earlier step of this epoch failed
    RANK_FAILED = "rank failed"     # a rank process died or stopped answering
    SYMMETRY_DIVERGENCE = "symmetry divergence"  # ranks disagree (verify_symmetry)
    INVALID_SETTINGS = "invalid settings"        # Init: a setting this worker refuses
    OUT_OF_MEMORY = "out of memory"
    DOES_NOT_FIT = "does not fit"   # Init: the model and its KV cache exceed the machine
    UNSUPPORTED = "unsupported"     # e.g. a kernel this device cannot run
    INTERNAL = "internal"


# The kinds whose message is an exception's own text, which may quote any request (StepError
# code INTERNAL: the scheduler tells its streams the code only, servicer.FAILURES).
EXCEPTION_TEXT_KINDS = frozenset({FailureKind.INTERNAL, FailureKind.OUT_OF_MEMORY,
                                  FailureKind.UNSUPPORTED})


class StepFailure(RuntimeError):
    context = ""        # what failed ("epoch 3 step 7"), when within() made it

    def __init__(self, kind: FailureKind, message: str):
        super().__init__(message)
        self.kind = kind

    def within(self, context: str) -> "StepFailure":
        """This failure as part of `context`, as the failed epoch remembers it."""
        failure = StepFailure(self.kind, f"{context}: {self}")
        failure.context = context
        return failure

    def retold(self) -> str:
        """The failure as a later refusal repeats it: an exception's text stays in the log it
        was written to when it happened (a later step's refusal reaches every stream)."""
        if self.kind in EXCEPTION_TEXT_KINDS:
            where = f"{self.context}: " if self.context else ""
            return f"{self.kind.value}: {where}its message is in the worker's log"
        return f"{self.kind.value}: {self}"


class DoesNotFit(RuntimeError):
    """Init: the weights and KV cache the settings ask for exceed the machine's memory."""


class StepProtocolError(RuntimeError):
    """The diff asks for something the cached state cannot satisfy (a protocol violation)."""


def as_failure(exc: BaseException, at_init: bool = False) -> StepFailure:
    """The StepFailure an exception means. At Init a ValueError is a refused setting; during a
    step it is a bug like any other exception (INTERNAL)."""
    if isinstance(exc, StepFailure):
        return exc
    if isinstance(exc, CodecError):
        return StepFailure(FailureKind.BAD_PAYLOAD, str(exc))
    if isinstance(exc, StepProtocolError):
        return StepFailure(FailureKind.BAD_STATE, str(exc))
    if isinstance(exc, DoesNotFit):
        return StepFailure(FailureKind.DOES_NOT_FIT, str(exc))
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return StepFailure(FailureKind.OUT_OF_MEMORY, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, NotImplementedError):
        return StepFailure(FailureKind.UNSUPPORTED, f"{type(exc).__name__}: {exc}")
    if at_init and isinstance(exc, ValueError):
        return StepFailure(FailureKind.INVALID_SETTINGS, f"{type(exc).__name__}: {exc}")
    return StepFailure(FailureKind.INTERNAL, f"{type(exc).__name__}: {exc}")
