"""StepRequest.digest (service/step_digest.py): BLAKE2b-128 of the payload; absent, nothing is
checked; a wrong one is BAD_PAYLOAD, which fails the step before the ranks see it."""
from __future__ import annotations

import hashlib

import pytest

from worker_service.failures import FailureKind, StepFailure
from worker_service.service.step_digest import check_digest, payload_digest


def test_the_digest_is_blake2b_128_of_the_payload():
    payload = b"\x01step diff bytes"
    assert payload_digest(payload) == hashlib.blake2b(payload, digest_size=16).digest()
    assert len(payload_digest(b"")) == 16


def test_a_wrong_digest_is_a_bad_payload_and_none_is_not_checked():
    payload = b"diff"
    check_digest(payload, None)
    check_digest(payload, payload_digest(payload))
    with pytest.raises(StepFailure, match="does not match its digest") as failure:
        check_digest(payload, payload_digest(b"diff!"))
    assert failure.value.kind is FailureKind.BAD_PAYLOAD
