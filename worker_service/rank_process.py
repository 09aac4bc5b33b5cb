"""One tensor-parallel rank: a process started with the `spawn` method by RankSet.

    worker service ── command ring (broadcast) ──▶ rank r: RankLoop ── RunnerHost(ModelRunner)
                   ◀── reply ring r ──────────────
                                        rank r ◀── torch.distributed (gloo / nccl) ──▶ peers

On its first "configure" the rank joins the process group: backend gloo on CPU, nccl on CUDA,
init_method tcp://RENDEZVOUS, world size tp_size, rank node_rank * local_ranks + local_rank. It
then answers every command with exactly one reply (rank_messages.py). It reads with a timeout
and exits when its parent is gone or the ring is shut down, so it never outlives the worker.

Test-only: when the environment variable DELTASERVE_TEST_CORRUPT_RANK equals this rank's global
rank, the rank corrupts its own cached state once (the last token of the first request that
sampled), which symmetry verification must then report. Never set it in production.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

from worker_service.shm_ring import RingClosed, RingHandle, RingTimeout, ShmBroadcastRing

log = logging.getLogger(__name__)

CORRUPT_RANK_ENV = "DELTASERVE_TEST_CORRUPT_RANK"


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs; plain fields, so it crosses `spawn`."""

    local_rank: int
    global_rank: int
    world_size: int
    device: str                  # "cpu" or "cuda:N"
    init_method: str             # "tcp://HOST:PORT" of the rendezvous store (global rank 0's)
    dist_timeout_s: float        # rendezvous and collective timeout
    command_ring: RingHandle
    reply_ring: RingHandle
    parent_pid: int
    poll_s: float = 1.0          # how often an idle rank checks that its parent is alive
    cpu_threads: int = 0         # torch intra-op threads on CPU (0: torch's default)
    log_level: str = "INFO"

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


def rank_main(spec: RankSpec) -> None:
    """The spawn target: attach the rings, serve commands until stopped, exit."""
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{spec.global_rank} %(name)s: "
                               "%(message)s")
    commands = ShmBroadcastRing.attach(spec.command_ring, spec.local_rank)
    replies = ShmBroadcastRing.attach_writer(spec.reply_ring)
    corrupt = os.environ.get(CORRUPT_RANK_ENV, "") == str(spec.global_rank)
    stopped = False
    try:
        from worker_service.rank_loop import RankLoop

        stopped = RankLoop(spec, replies, corrupt).serve(lambda: _next_command(spec, commands))
    finally:
        commands.close()
        replies.close()
    if stopped:  # a peer may be dead otherwise, and leaving could wait for it
        _leave_group()


def _next_command(spec: RankSpec, ring: ShmBroadcastRing) -> bytes | None:
    """The next message, or None when the ring is shut down or the parent has died."""
    while True:
        try:
            return ring.read(timeout=spec.poll_s)
        except RingTimeout:
            if os.getppid() != spec.parent_pid:
                log.warning("parent %d is gone; exiting", spec.parent_pid)
                return None
        except RingClosed:
            return None


def join_group(spec: RankSpec):
    """Join the tensor-parallel process group; returns this rank's TPGroup."""
    import torch
    import torch.distributed as dist

    from worker_service.parallel_state import TPGroup

    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    elif spec.cpu_threads > 0:
        torch.set_num_threads(spec.cpu_threads)
    log.info("joining %s group at %s as rank %d of %d", spec.backend, spec.init_method,
             spec.global_rank, spec.world_size)
    dist.init_process_group(spec.backend, init_method=spec.init_method,
                            world_size=spec.world_size, rank=spec.global_rank,
                            timeout=timedelta(seconds=spec.dist_timeout_s))
    return TPGroup(rank=spec.global_rank, world_size=spec.world_size)


def _leave_group() -> None:
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group: the process is exiting anyway
            pass
