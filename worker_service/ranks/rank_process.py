"""One tensor-parallel rank: a process started with the `spawn` method by RankSet.

    worker service ── command ring (broadcast) ──▶ rank r: RankLoop ── RunnerKeeper(ModelRunner)
                   ◀── reply ring r ──────────────
                                        rank r ◀── torch.distributed (gloo / nccl) ──▶ peers

On its first "configure" the rank joins the process group: backend gloo on CPU, nccl on CUDA,
init_method tcp://RENDEZVOUS, world size tp_size, rank node_rank * local_ranks + local_rank. It
then answers every command with exactly one reply (messages.py). It reads with a timeout
and exits when its parent is gone or the ring is shut down, so it never outlives the worker; a
watcher thread also ends it when the parent is gone while the rank is blocked where no ring is
read (the rendezvous, a collective, a model load): a worker killed outright (SIGKILL, the OOM
killer) would otherwise leave it waiting up to --dist-timeout.

Test-only: when the environment variable DELTASERVE_TEST_CORRUPT_RANK equals this rank's global
rank, the rank corrupts its own cached state once (the last token of the first request that
sampled), which symmetry verification must then report. Never set it in production.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from engine_common.wire.diff import RunnerOutput
from engine_common.configuration.settings import from_wire
from worker_service.config import RunnerConfig
from worker_service.device_info import describe_device
from worker_service.failures import FailureKind, StepFailure, as_failure
from worker_service.ranks.messages import (ALLOCATE, CONFIGURE, LORA_LOAD, LORA_UNLOAD, RESET,
                                           STEP, STOP, RankReply,
                                           decode_command, device_to_wire, encode_reply)
from worker_service.ranks.shm_ring import (RingClosed, RingError, RingHandle, RingTimeout,
                                           ShmBroadcastRing)
from worker_service.ranks.runner_keeper import RunnerKeeper

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
    threading.Thread(target=_exit_with_parent, args=(spec,), daemon=True,
                     name="parent-watch").start()
    commands = ShmBroadcastRing.attach(spec.command_ring, spec.local_rank)
    replies = ShmBroadcastRing.attach_writer(spec.reply_ring)
    corrupt = os.environ.get(CORRUPT_RANK_ENV, "") == str(spec.global_rank)
    stopped = False
    try:
        stopped = RankLoop(spec, replies, corrupt).serve(lambda: _next_command(spec, commands))
    finally:
        commands.close()
        replies.close()
    if stopped:  # a peer may be dead otherwise, and leaving could wait for it
        _leave_group()


def _exit_with_parent(spec: RankSpec) -> None:
    """End this process once its parent is gone, whatever the main thread is blocked in (the
    rings' own checks only run between commands)."""
    while os.getppid() == spec.parent_pid:
        time.sleep(spec.poll_s)
    log.warning("parent %d is gone while the rank was busy; exiting", spec.parent_pid)
    os._exit(1)


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


# -- the command loop -----------------------------------------------------------------------------

class RankLoop:
    """One rank's command handler. `corrupt` (test-only) damages the cached state once."""

    def __init__(self, spec: RankSpec, replies: ShmBroadcastRing, corrupt: bool = False):
        self.spec = spec
        self.replies = replies
        self.corrupt = corrupt
        self.keeper: RunnerKeeper | None = None

    def serve(self, next_command: Callable[[], bytes | None]) -> bool:
        """Answer commands until "stop" (returns True) or the end of input (False)."""
        while (data := next_command()) is not None:
            try:
                name, args = decode_command(data)
            except ValueError as e:
                name, args = "", [e]
            if name == STOP:
                self._send(RankReply())
                return True
            if not self._send(self._handle(name, args)):
                return False
        return False

    def _handle(self, name: str, args: list) -> RankReply:
        try:
            if name == CONFIGURE:
                return self._configure(*args)
            if name == ALLOCATE:
                self.keeper.allocate(int(args[0]))
                group = self.keeper.runner.window_group      # a hybrid model's split
                info = {"kv_cache_dtype": self.keeper.runner.cache_dtype_name}
                return RankReply(info=info if group is None else {
                    **info, "num_full_blocks": self.keeper.runner.diff_bounds.num_kv_blocks,
                    "window_group": [group.window, group.num_blocks]})
            if name == RESET:
                return RankReply(info={"dropped": self.keeper.drop_requests() if self.keeper else 0})
            if name == STEP:
                return self._step(*args)
            if name in (LORA_LOAD, LORA_UNLOAD):
                return self._lora(name, args)
            raise ValueError(f"bad rank command: {args[0] if args else name!r}")
        except Exception as e:  # reported to the worker as its kind
            failure = as_failure(e, at_init=name == CONFIGURE)
            if failure.kind == FailureKind.INTERNAL:
                log.exception("rank %d: %s failed", self.spec.global_rank, name)
            return RankReply(failure.kind.value, str(failure))

    def _lora(self, name: str, args: list) -> RankReply:
        """A LoRA adapter loaded into or freed from a slot (runner_keeper.py says how)."""
        if self.keeper is None:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the rank has no model or KV cache")
        if name == LORA_LOAD:
            lora_id, adapter_name, path = args
            self.keeper.load_lora(int(lora_id), str(adapter_name), str(path))
        else:
            self.keeper.unload_lora(int(args[0]))
        return RankReply()

    def _configure(self, config_wire: dict) -> RankReply:
        if self.keeper is None:
            self.keeper = RunnerKeeper(self.spec.device, join_group(self.spec))
        config = from_wire(RunnerConfig, {**config_wire, "device": self.spec.device})
        prepared = self.keeper.prepare(config)
        summary = self.keeper.model_summary()
        return RankReply(info={
            "num_kv_blocks": prepared.num_kv_blocks, "kv_block_bytes": prepared.kv_block_bytes,
            "model_reloaded": prepared.model_reloaded, "pid": os.getpid(),
            "sliding_window": prepared.sliding_window,
            "attention_backend": summary.attention_backend, "dtype": summary.dtype,
            "device": device_to_wire(describe_device(self.spec.device))})

    def _step(self, payload: bytes, verify: bool) -> RankReply:
        if self.keeper is None:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the rank has no model or KV cache")
        reply = self.keeper.run_step(payload, verify, self.spec.global_rank == 0,
                                     self._corrupt if self.corrupt else None)
        return RankReply(payload=reply.payload, digest=reply.digest,
                         info=reply.ranks[0].to_wire())

    def _corrupt(self, out: RunnerOutput) -> None:
        """Test-only: change the token this rank just sampled for one request, in its cache."""
        if not out.handles:
            return
        runner, handle = self.keeper.runner, out.handles[0]
        row = runner.batch.handle_to_row[handle]
        last = int(runner.batch.num_tokens[row]) - 1
        token = (int(runner.batch.token_ids[row, last]) + 1) % runner.vocab_size
        runner.batch.token_ids[row, last] = token      # a running request's ids live in its row
        self.corrupt = False
        log.warning("TEST ONLY: rank %d corrupted handle %d's last token (step %d)",
                    self.spec.global_rank, handle, out.step)

    def _send(self, reply: RankReply) -> bool:
        """Write one reply; False when the worker is gone (ring shut down, or parent dead)."""
        data = encode_reply(reply)
        while True:
            try:
                self.replies.write(data, timeout=self.spec.poll_s)
                return True
            except RingTimeout:
                if os.getppid() != self.spec.parent_pid:
                    return False
            except (RingClosed, RingError):
                return False
