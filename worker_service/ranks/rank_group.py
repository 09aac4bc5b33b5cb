"""One node's G rank processes as the node worker's Ranks (rank_api.py), for tp_size > 1.

    Init:  spawn the ranks unless they can be kept; "configure" on every rank (the first one
           joins the process group, then each loads or keeps the model and measures its KV
           blocks); "allocate" the minimum block count over the node's ranks on every rank.
    Step:  the diff goes to every rank through the shared-memory ring, once per node; every
           rank replies; node 0 returns global rank 0's RunnerOutput, other nodes b"". With
           verify_symmetry the ranks' digests must all be equal; the node returns that digest.

When ranks are kept. A later Init (new epoch) keeps the rank processes, their process group and
(when its load key is unchanged) the model, if the ranks are healthy and the group is the same:
on one node always; across nodes only when layout.group_id is non-empty and equal to the one the
group was formed with, and the rendezvous address is unchanged. Otherwise (another group id, a
rank that died, ranks left out of step by a failed or interrupted step, a symmetry divergence)
every rank is killed and a fresh set is spawned: a process group cannot be re-formed inside a
process reliably, and a rank stuck in a collective can only be killed.

Single node: the ranks rendezvous on a free loopback port picked here (no address needed).
Even G = 1 runs in a rank process when tp_size > 1 (several nodes), for the same reason.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field

from typing import Callable

from engine_common.configuration.settings import to_wire
from engine_common.request.kv_groups import WindowGroup
from worker_service.config import NodeLayout, RunnerConfig, rank_device
from worker_service.device_info import DeviceDescription, describe_device
from worker_service.failures import FailureKind, StepFailure
from worker_service.ranks.messages import (ALLOCATE, CONFIGURE, LORA_LOAD, LORA_UNLOAD, RESET,
                                           RankReply,
                                           device_from_wire, encode_command, encode_step)
from worker_service.ranks.rank_process import RankSpec
from worker_service.ranks.rank_set import RankSet, RankSetOptions
from worker_service.ranks.rank_api import (InitOutcome, ModelSummary, RankStepStats, StepReply,
                                          node_kv_cache_dtype)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankGroupOptions:
    """Timeouts (seconds) of the rank processes; all configurable, none hidden."""

    dist_timeout_s: float = 600.0     # rendezvous and every collective (torch.distributed)
    init_timeout_s: float = 900.0     # one "configure": rendezvous plus model load
    step_timeout_s: float = 600.0     # one step on every rank
    control_timeout_s: float = 60.0   # "allocate" and "reset"
    rank_set: RankSetOptions = field(default_factory=RankSetOptions)


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """`layout.num_local_ranks` rank processes on `device`; see the module docstring."""

    def __init__(self, device: str, layout: NodeLayout,
                 options: RankGroupOptions = RankGroupOptions()):
        if layout.tp_size != layout.num_nodes * layout.num_local_ranks:
            raise ValueError(f"tp_size={layout.tp_size} is invalid: must equal num_nodes "
                             f"({layout.num_nodes}) * num_local_ranks ({layout.num_local_ranks})")
        if ":" in device and layout.num_local_ranks > 1:
            raise ValueError(f"device={device!r} is invalid with {layout.num_local_ranks} local "
                             "ranks: name the kind only ('cuda'); rank r uses cuda:r")
        self.device = device
        self.started_layout = layout
        self.layout = layout
        self.options = options
        self.num_model_loads = 0
        self.rank_set: RankSet | None = None
        self._group_key: tuple[str, str] | None = None
        self._abort = threading.Event()
        self._ready = False
        self._summary: ModelSummary | None = None
        self._devices: list[DeviceDescription] | None = None
        self._failure_listener: Callable[[str], None] = lambda reason: None

    # -- lifecycle ------------------------------------------------------------------------------

    def interrupt(self) -> None:
        self._abort.set()

    def set_failure_listener(self, listener: Callable[[str], None]) -> None:
        self._failure_listener = listener

    def load(self, config: RunnerConfig, layout: NodeLayout) -> InitOutcome:
        self._abort.clear()
        self._ready = False
        self.layout = layout
        if not self._can_keep_ranks(layout):
            self._respawn(layout)
        command = encode_command(CONFIGURE, to_wire(config))
        replies = self._call(command, self.options.init_timeout_s)
        num_blocks = min(r.info["num_kv_blocks"] for r in replies)
        allocated = self._call(encode_command(ALLOCATE, num_blocks),
                               self.options.control_timeout_s)
        cache_dtype = node_kv_cache_dtype([r.info["kv_cache_dtype"] for r in allocated])
        first = replies[0].info
        self._summary = ModelSummary(config.model_dir, first["attention_backend"], first["dtype"])
        self._devices = [device_from_wire(r.info["device"]) for r in replies]
        reloaded = any(r.info["model_reloaded"] for r in replies)
        self.num_model_loads += reloaded
        self._ready = True
        log.info("ranks %s ready: %d KV blocks each (pids %s)", self._global_ranks(layout),
                 num_blocks, [r.info["pid"] for r in replies])
        # every rank loads the same model; were one to disagree, the window that frees least
        windows = [r.info.get("sliding_window", 0) for r in replies]
        window = max(windows) if all(windows) else 0
        group = allocated[0].info.get("window_group")     # every rank splits the same budget
        return InitOutcome(allocated[0].info.get("num_full_blocks", num_blocks),
                           max(r.info["kv_block_bytes"] for r in replies), reloaded, window,
                           None if group is None else WindowGroup(*group),
                           cache_dtype)

    def drop_requests(self) -> int:
        self._abort.clear()
        if self.rank_set is None or not self._ready:
            return 0
        return self._call(encode_command(RESET), self.options.control_timeout_s)[0].info["dropped"]

    def close(self) -> None:
        self._close_ranks()

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """LoadLora on every rank; when any rank refuses, the slot is freed on all of them
        again, so no rank keeps a half-loaded adapter (the refusal is raised)."""
        self._check_ready()
        try:
            self._call(encode_command(LORA_LOAD, lora_id, name, path),
                       self.options.control_timeout_s)
        except StepFailure:
            try:
                self._call(encode_command(LORA_UNLOAD, lora_id), self.options.control_timeout_s)
            except StepFailure as e:     # the ranks are out of step: the next Init respawns
                self.rank_set.dirty = True
                log.error("freeing LoRA slot %d after a refused load failed: %s", lora_id, e)
            raise

    def unload_lora(self, lora_id: int) -> None:
        """UnloadLora on every rank."""
        self._check_ready()
        self._call(encode_command(LORA_UNLOAD, lora_id), self.options.control_timeout_s)

    def _check_ready(self) -> None:
        if self.rank_set is None or not self._ready:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the ranks have no model")

    def _can_keep_ranks(self, layout: NodeLayout) -> bool:
        ranks = self.rank_set
        if ranks is None or not ranks.healthy:
            return False
        if layout.num_nodes == 1:
            return True
        return bool(layout.group_id) and self._group_key == (layout.rendezvous_address,
                                                             layout.group_id)

    def _respawn(self, layout: NodeLayout) -> None:
        self._close_ranks()
        init_method = self._init_method(layout)
        opts = self.options
        threads = max(1, (os.cpu_count() or 1) // layout.num_local_ranks)

        def make_spec(local_rank, command_ring, reply_ring) -> RankSpec:
            return RankSpec(
                local_rank=local_rank, global_rank=layout.global_rank(local_rank),
                world_size=layout.tp_size, device=self._rank_device(local_rank),
                init_method=init_method, dist_timeout_s=opts.dist_timeout_s,
                command_ring=command_ring, reply_ring=reply_ring, parent_pid=os.getpid(),
                poll_s=opts.rank_set.poll_s, cpu_threads=threads,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))

        self.rank_set = RankSet.spawn(make_spec, layout.num_local_ranks, opts.rank_set,
                                    self._rank_died)
        self._group_key = (layout.rendezvous_address, layout.group_id)

    def _close_ranks(self) -> None:
        if self.rank_set is not None:
            self.rank_set.close()
        self.rank_set, self._group_key, self._ready = None, None, False

    def _init_method(self, layout: NodeLayout) -> str:
        if layout.num_nodes == 1:
            return f"tcp://127.0.0.1:{free_loopback_port()}"
        if not layout.rendezvous_address:
            raise ValueError("layout.rendezvous_address='' is invalid with num_nodes="
                             f"{layout.num_nodes}: must be node 0's HOST:PORT")
        return f"tcp://{layout.rendezvous_address}"

    def _rank_device(self, local_rank: int) -> str:
        return rank_device(self.device, local_rank)

    def _rank_died(self, reason: str) -> None:
        self._ready = False
        self._failure_listener(reason)

    # -- steps ----------------------------------------------------------------------------------

    def run_step(self, payload: bytes, verify: bool, output_rank: bool) -> StepReply:
        replies = self._call(encode_step(payload, verify), self.options.step_timeout_s)
        digest = self._agreed_digest(replies) if verify else None
        stats = tuple(RankStepStats.from_wire(r.info) for r in replies if r.info)
        return StepReply(replies[0].payload if output_rank else b"", digest, stats)

    def _agreed_digest(self, replies: list[RankReply]) -> bytes:
        digests = [r.digest for r in replies]
        if len(set(digests)) == 1 and digests[0] is not None:
            return digests[0]
        self.rank_set.dirty = True  # a diverged rank must not serve the next epoch
        ranks = self._global_ranks(self.layout)
        listed = ", ".join(f"rank {g}: {d.hex() if d else None}" for g, d in zip(ranks, digests))
        raise StepFailure(FailureKind.SYMMETRY_DIVERGENCE,
                          f"local ranks disagree on their sampled ids or cached state ({listed})")

    def _call(self, command: bytes, timeout: float) -> list[RankReply]:
        """Send `command` to every rank; raise the first rank's error, if any."""
        replies = self.rank_set.call(command, timeout, self._abort)
        for local, reply in enumerate(replies):
            if reply is None or reply.ok:
                continue
            kind = FailureKind(reply.kind)
            if kind in (FailureKind.INTERNAL, FailureKind.OUT_OF_MEMORY):
                self.rank_set.dirty = True  # a collective may have been left half done
            raise StepFailure(kind, f"rank {self.started_layout.global_rank(local)}: "
                                    f"{reply.message}")
        missing = [self.started_layout.global_rank(r) for r, x in enumerate(replies) if x is None]
        if missing:  # only reachable if the rank set returned early: never report a success
            self.rank_set.dirty = True
            raise StepFailure(FailureKind.RANK_FAILED, f"ranks {missing} did not reply")
        return replies

    def _global_ranks(self, layout: NodeLayout) -> list[int]:
        return [layout.global_rank(r) for r in range(layout.num_local_ranks)]

    # -- introspection (no lock) ----------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        ranks = self.rank_set
        if ranks is not None and ranks.failure:
            return False, ranks.failure
        if ranks is None or not self._ready:
            return False, "not initialized"
        if not ranks.healthy:
            return False, "the ranks are out of step after a failed step: Init again"
        return True, ""

    def describe_devices(self) -> list[DeviceDescription]:
        """Measured now on CPU; on CUDA as the ranks measured them at Init (so this process never
        touches the GPUs), or measured here before the first Init."""
        if self.device.startswith("cuda") and self._devices:
            return list(self._devices)
        return [describe_device(self._rank_device(r))
                for r in range(self.started_layout.num_local_ranks)]

    def model_summary(self) -> ModelSummary | None:
        return self._summary if self._ready else None

    def pids(self) -> list[int]:
        ranks = self.rank_set
        return ranks.pids if ranks is not None else []

    @property
    def group_id(self) -> str:
        ranks = self.rank_set
        healthy = ranks is not None and ranks.healthy and self._ready
        return self.layout.group_id if healthy else ""
