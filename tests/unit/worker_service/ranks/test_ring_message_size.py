"""Every step diff a worker's port accepts fits the ring that carries it to the rank processes.

--max-message-mib goes up to 2047 MiB and Init allows settings whose largest diff is that big,
but the command ring kept its own default limit of 1 GiB: on a tensor-parallel worker a legal
diff above it failed as an INTERNAL PayloadTooLarge (and did not even fail the epoch). The ring
now takes the port's limit plus the step command's header. The diff here is an anonymous
mapping (no memory is touched beyond the chunks the ring copies)."""
from __future__ import annotations

import dataclasses
import mmap

import pytest

from engine_common.configuration.config import WorkerServiceOptions
from worker_service.ranks.messages import STEP_HEADER_BYTES
from worker_service.ranks.rank_set import command_ring
from worker_service.ranks.shm_ring import PayloadTooLarge, RingTimeout
from worker_service.service.init_checks import MIB
from worker_service.service.server import serve_worker

LARGEST_MIB = 2047


def test_the_largest_diff_the_port_accepts_fits_the_rank_ring():
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(
        device="cpu", local_ranks=2, max_message_mib=LARGEST_MIB))
    try:
        options = server.node_worker.ranks.options.rank_set
    finally:
        server.stop(None)
        server.node_worker.close()
    ring = command_ring(1, dataclasses.replace(options, ring_slots=2, ring_slot_bytes=4096))
    try:
        with mmap.mmap(-1, options.max_message_bytes + 1) as too_large:
            with pytest.raises(PayloadTooLarge):      # one byte more is refused at once
                ring.write(too_large, timeout=0.5)
        with mmap.mmap(-1, LARGEST_MIB * MIB + STEP_HEADER_BYTES) as command:
            # Past the size check, the write waits for the reader, which never comes.
            with pytest.raises(RingTimeout):
                ring.write(command, timeout=0.5)
    finally:
        ring.close()
        ring.unlink()
