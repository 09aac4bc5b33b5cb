"""The Worker protocol's Init messages on the scheduler's side: the request each worker gets and
what its response says (devices, the sliding window). Torch-free."""
from __future__ import annotations

from engine_common.configuration.settings import to_proto
from engine_common.request.kv_groups import WindowGroup
from engine_common.wire.protos import worker_pb2
from scheduler_service.workers.worker_spec import InitSpec, WorkerDevice


def init_request(spec: InitSpec, epoch: int, layout: worker_pb2.ParallelLayout,
                 scheduler_id: str) -> worker_pb2.InitRequest:
    """The Init a worker gets: the epoch, its place in the group, the settings."""
    req = worker_pb2.InitRequest(epoch=epoch, layout=layout, scheduler_id=scheduler_id)
    to_proto(spec.config, req.config)
    return req


def worker_device(d, address: str, node_rank: int) -> WorkerDevice:
    """One rank's device as a worker's InitResponse describes it."""
    return WorkerDevice(address=address, node_rank=node_rank, local_rank=d.local_rank,
                        global_rank=d.global_rank, kind=d.device_kind, name=d.device_name,
                        total_memory_bytes=d.total_memory_bytes,
                        free_memory_bytes=d.free_memory_bytes, num_kv_blocks=d.num_kv_blocks)


def shared_window(windows: list[int]) -> int:
    """The window the scheduler frees KV blocks by, from each worker's: none when one has
    none (an older worker says 0), else the largest (it frees least)."""
    return max(windows) if all(windows) else 0


def shared_kv_block_bytes(block_bytes: list[int]) -> int:
    """The bytes of one KV block on a rank, which every worker must agree on: the same Init
    (kv_cache_dtype, the model) gives the same; a worker that differs (one that dropped
    --kv-cache-dtype, an older build) would attend in another precision than its peers:
    ValueError naming what each said."""
    if len(set(block_bytes)) > 1:
        raise ValueError(f"workers disagree on the bytes of a KV block (per node, in order: "
                         f"{block_bytes}): every node must run the same kv_cache_dtype and "
                         "model; is one an older build that does not know --kv-cache-dtype?")
    return block_bytes[0]


FP8_NAMES = ("fp8_e4m3", "fp8_e5m2")     # what `fp8` resolves to (a device's choice)


def allocated_kv_cache_dtype(asked: str, echoes: list[tuple[str, str]]) -> str:
    """The KV cache dtype every worker allocated, from (address, InitResponse.kv_cache_dtype)
    of each, when each is what `asked` (the kv_cache_dtype sent in Init) allows: itself, or
    for `fp8` either fp8 type, the same on every worker. An empty echo is a build before it,
    which ignores Init's kv_cache_dtype and caches in the model dtype ("auto"): refused unless
    auto was asked, since the scheduler would report fp8 while that worker ran auto.
    ValueError naming the worker, the asked and the echoed dtype."""
    for address, echo in echoes:
        got = echo or "auto"
        if got == asked or (asked == "fp8" and got in FP8_NAMES):
            continue
        older = ("" if echo else " (it echoed none: a build before --kv-cache-dtype, which "
                 "caches in the model dtype)")
        raise ValueError(f"worker {address} allocated a kv_cache_dtype={got!r} KV cache, but "
                         f"kv_cache_dtype={asked!r} was asked{older}; run the same build on "
                         "every node")
    kinds = sorted({echo or "auto" for _, echo in echoes})
    if len(kinds) > 1:
        raise ValueError(f"workers resolved kv_cache_dtype={asked!r} differently: "
                         f"{', '.join(f'{a} {e!r}' for a, e in echoes)}; give every node the "
                         "same device kind, or name fp8_e4m3 or fp8_e5m2")
    return kinds[0]


def shared_window_group(groups: list[tuple[int, int]]) -> WindowGroup | None:
    """The window group of a hybrid model (engine_common/request/kv_groups.py) from each
    worker's (window, blocks) as InitResponse says them (0, 0: none): the smallest pool when
    every worker has one of the same window, None when none has. Workers that disagree (one
    split its cache and another not: a budget below the split's bound) cannot serve one
    scheduler: ValueError naming what they said."""
    if not any(window for window, _ in groups):
        return None
    if len({window for window, _ in groups}) != 1 or not all(n for _, n in groups):
        raise ValueError(f"workers disagree on the hybrid KV cache's window group: (window, "
                         f"blocks) {groups}; give each worker the same KV budget")
    return WindowGroup(groups[0][0], min(n for _, n in groups))
