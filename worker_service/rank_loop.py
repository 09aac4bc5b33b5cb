"""Inside a rank process: answer each ring command with one reply (see rank_messages.py).

Every rank applies the same diffs and samples the same tokens, so the replies differ only in
who carries the RunnerOutput: the output rank (global rank 0) does, the others send b"".
With verify_symmetry every rank also sends `ModelRunner.state_digest`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

from engine_common.codec import encode_runner_output
from engine_common.diff import RunnerOutput
from worker_service.device_info import describe_device
from worker_service.node_worker import FailureKind, StepFailure
from worker_service.rank_messages import (ALLOCATE, CONFIGURE, RESET, STEP, STOP, RankReply,
                                          config_from_wire, decode_command, device_to_wire,
                                          encode_reply)
from worker_service.rank_process import RankSpec, join_group
from worker_service.runner_host import RunnerHost
from worker_service.shm_ring import RingClosed, RingError, RingTimeout, ShmBroadcastRing

log = logging.getLogger(__name__)


def exception_kind(e: BaseException) -> str:
    """The family of an Init-time exception, so the worker can re-raise it with the same gRPC
    meaning (servicer.status_for): ValueError, MemoryError, NotImplementedError or RuntimeError."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return "MemoryError"
    for family in (ValueError, NotImplementedError):
        if isinstance(e, family):
            return family.__name__
    return "RuntimeError"


class RankLoop:
    """One rank's command handler. `corrupt` (test-only) damages the cached state once."""

    def __init__(self, spec: RankSpec, replies: ShmBroadcastRing, corrupt: bool = False):
        self.spec = spec
        self.replies = replies
        self.corrupt = corrupt
        self.host: RunnerHost | None = None

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
                self.host.allocate(int(args[0]))
                return RankReply()
            if name == RESET:
                return RankReply(info={"dropped": self.host.reset() if self.host else 0})
            if name == STEP:
                return self._step(*args)
            raise ValueError(f"bad rank command: {args[0] if args else name!r}")
        except StepFailure as e:
            return RankReply(e.kind.value, str(e))
        except Exception as e:  # reported to the worker, which decides what it means
            log.exception("rank %d: %s failed", self.spec.global_rank, name)
            return RankReply(FailureKind.INTERNAL.value, f"{type(e).__name__}: {e}",
                             info={"exception": exception_kind(e)})

    def _configure(self, config_wire: dict, gpu_memory_utilization: float | None) -> RankReply:
        if self.host is None:
            self.host = RunnerHost(self.spec.device, join_group(self.spec))
        config = dataclasses.replace(config_from_wire(config_wire), device=self.spec.device)
        prepared = self.host.prepare(config, gpu_memory_utilization)
        summary = self.host.summary()
        return RankReply(info={
            "num_kv_blocks": prepared.num_kv_blocks, "kv_block_bytes": prepared.kv_block_bytes,
            "model_reloaded": prepared.model_reloaded, "pid": os.getpid(),
            "attention_backend": summary.attention_backend, "dtype": summary.dtype,
            "device": device_to_wire(describe_device(self.spec.device))})

    def _step(self, payload: bytes, verify: bool) -> RankReply:
        if self.host is None or not self.host.ready:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the rank has no model or KV cache")
        out = self.host.execute(payload)
        if self.corrupt:
            self._corrupt(out)
        digest = self.host.runner.state_digest(out) if verify else None
        data = encode_runner_output(out) if self.spec.global_rank == 0 else b""
        return RankReply(payload=data, digest=digest)

    def _corrupt(self, out: RunnerOutput) -> None:
        """Test-only: change the token this rank just sampled for one request, in its cache."""
        if not out.handles:
            return
        runner, handle = self.host.runner, out.handles[0]
        row = runner.batch.handle_to_row[handle]
        last = int(runner.batch.num_tokens[row]) - 1
        token = (int(runner.batch.token_ids[row, last]) + 1) % runner.vocab_size
        runner.batch.token_ids[row, last] = token
        runner.requests[handle].output_token_ids[-1] = token
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
