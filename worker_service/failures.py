"""Why a step or an Init failed: the failure kinds of the worker side, raised as StepFailure.

Every layer of the worker (runner, rank processes, node worker) reports failures with these
kinds; the servicer maps each kind to one StepError code and one gRPC status.
"""
from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """Why a step was refused or failed."""

    NOT_INITIALIZED = "not initialized"
    EPOCH_MISMATCH = "epoch mismatch"
    STEP_GAP = "step gap"
    SUPERSEDED = "superseded"
    BAD_PAYLOAD = "bad payload"     # undecodable bytes or a wrong digest
    BAD_STATE = "bad state"         # decodes, but does not fit the cached requests
    EPOCH_FAILED = "epoch failed"   # an earlier step of this epoch failed
    RANK_FAILED = "rank failed"     # a rank process died or stopped answering
    SYMMETRY_DIVERGENCE = "symmetry divergence"  # ranks disagree (verify_symmetry)
    INTERNAL = "internal"


class StepFailure(RuntimeError):
    def __init__(self, kind: FailureKind, message: str):
        super().__init__(message)
        self.kind = kind
