"""Where each worker sits in the tensor-parallel group, decided by the scheduler before Init.

Torch-free. Inputs: the worker addresses in --workers order (position = node rank) and each
worker's Info (how it was started: --node-rank, --nodes, --local-ranks; the group it is in now).

    tp_size             = number of workers * local ranks per worker (equal on every worker)
    rendezvous_address  = node 0's host (from its address) : dist_port, or the explicit override;
                          only sent when there is more than one node
    group_id            = the id every worker already reports (they keep their ranks), or a new
                          random one when they differ, any is empty, or a re-form is forced
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from engine_common.wire.protos import worker_pb2
from scheduler_service.errors import WorkerFailure


@dataclass(frozen=True)
class GroupPlan:
    num_nodes: int
    num_local_ranks: int
    rendezvous_address: str     # "" with one node
    group_id: str

    @property
    def tp_size(self) -> int:
        return self.num_nodes * self.num_local_ranks

    def layout_pb(self, node_rank: int) -> worker_pb2.ParallelLayout:
        return worker_pb2.ParallelLayout(
            tp_size=self.tp_size, node_rank=node_rank, num_nodes=self.num_nodes,
            num_local_ranks=self.num_local_ranks, rendezvous_address=self.rendezvous_address,
            group_id=self.group_id)


def rendezvous_host(address: str) -> str:
    """The host part of a HOST:PORT worker address (IPv6 in brackets stays bracketed)."""
    if "/" in address or address.startswith("unix:") or ":" not in address:
        raise WorkerFailure(f"cannot derive a rendezvous host from worker address {address!r}: "
                            "give node 0's rendezvous HOST:PORT explicitly")
    return address.rsplit(":", 1)[0]


def plan_group(addresses: list[str], infos: list, *, num_local_ranks: int = 0,
               rendezvous_address: str = "", dist_port: int, force_new: bool = False
               ) -> GroupPlan:
    """The layout every worker gets in Init; WorkerFailure when the workers do not fit together.

    `infos` are the workers' InfoResponses in address order; `num_local_ranks` 0 accepts what
    they report, any other value must match it.
    """
    num_nodes = len(addresses)
    local = [info.layout.num_local_ranks or 1 for info in infos]
    if len(set(local)) > 1:
        listed = ", ".join(f"{a}: {n}" for a, n in zip(addresses, local))
        raise WorkerFailure(f"workers run different numbers of local ranks ({listed}): start "
                            "every node with the same --local-ranks")
    if num_local_ranks and num_local_ranks != local[0]:
        raise WorkerFailure(f"num_local_ranks={num_local_ranks} does not match the workers' "
                            f"--local-ranks {local[0]}")
    for node, (address, info) in enumerate(zip(addresses, infos)):
        started = (info.layout.node_rank, info.layout.num_nodes or 1)
        if started != (node, num_nodes):
            raise WorkerFailure(
                f"worker {address} was started as node {started[0]} of {started[1]} "
                f"(--node-rank/--nodes) but is number {node} of {num_nodes} in the scheduler's "
                "worker list: list node 0 first and start each worker with its position")
    rendezvous = ""
    if num_nodes > 1:
        rendezvous = rendezvous_address or f"{rendezvous_host(addresses[0])}:{dist_port}"
    ids = {info.group_id for info in infos}
    keep = len(ids) == 1 and "" not in ids and not force_new
    group_id = ids.pop() if keep else secrets.token_hex(8)
    return GroupPlan(num_nodes, local[0], rendezvous, group_id)
