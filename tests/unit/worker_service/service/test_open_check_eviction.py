"""Withheld unauthenticated health checks cannot lock the probes out.

At most 2 unauthenticated checks are served at once (each holds a pool thread until its message
comes). A third was refused RESOURCE_EXHAUSTED: two withheld checks, reopened whenever the
worker cancelled them (2 s), answered every Kubernetes probe RESOURCE_EXHAUSTED, the liveness
probe failed, and the kubelet restarted a healthy worker. Now a new check cancels the oldest one
still waiting for its message and takes its slot; a probe's message comes with it. A real worker
service on loopback, with a token and no model; the withheld checks wait up to 60 s here."""
from __future__ import annotations

import threading

import grpc
import pytest

from tests.support.grpc_harness import health_status
from tests.support.inproc_worker import cpu_worker
from tests.unit.worker_service.service.test_withheld_messages import CHECK, TOKEN, Withheld
from worker_service.service import open_check


class Waits:
    """Counts the unauthenticated checks that started waiting for their message."""

    def __init__(self, monkeypatch):
        self.started = 0
        self._changed = threading.Condition()
        first = open_check.OpenChecks._first

        def counted(checks, requests, context):
            with self._changed:
                self.started += 1
                self._changed.notify_all()
            return first(checks, requests, context)
        monkeypatch.setattr(open_check.OpenChecks, "_first", counted)

    def wait_for(self, n: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.started >= n, timeout=30), self.started


@pytest.fixture
def waits(monkeypatch):
    return Waits(monkeypatch)


@pytest.fixture
def worker_address(monkeypatch, waits):
    monkeypatch.setattr(open_check, "OPEN_CHECK_WAIT_S", 60.0)   # only eviction ends them
    with cpu_worker(TOKEN) as address:
        yield address


def test_a_probe_is_answered_while_withheld_checks_fill_every_slot(worker_address, waits):
    slots = open_check.MAX_OPEN_CHECKS
    with grpc.insecure_channel(worker_address) as channel:
        held = Withheld(channel)
        try:
            withheld = [held.open(CHECK) for _ in range(slots)]
            started = slots
            for _ in range(3):
                waits.wait_for(started)        # every slot holds a withheld check
                assert health_status(worker_address, "", timeout=10) == "SERVING"
                started += 1                   # the probe's own wait
                withheld.append(held.open(CHECK))      # the attacker takes a slot back
                started += 1
            # The oldest withheld checks were cancelled, one per newcomer.
            for call in withheld[:3]:
                assert call.exception(timeout=30).code() == grpc.StatusCode.CANCELLED
        finally:
            held.close()
