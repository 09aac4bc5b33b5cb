"""The scheduler's tensor-parallel planning (torch-free): layout, rendezvous, group reuse, and
the errors that stop a misconfigured cluster before any rank waits in a rendezvous."""
from __future__ import annotations

import pytest

from engine_common.configuration.config import WorkerConfig
from engine_common.request.params import ParamError
from engine_common.wire.protos import worker_pb2
from scheduler_service.errors import WorkerFailure
from scheduler_service.workers.group_plan import plan_group, rendezvous_host
from scheduler_service.workers.worker_client import DEFAULT_DIST_PORT, InitSpec

ADDRS = ["10.0.0.1:50061", "10.0.0.2:50061"]


def info(node_rank=0, nodes=2, local=2, group_id=""):
    return worker_pb2.InfoResponse(group_id=group_id, layout=worker_pb2.ParallelLayout(
        node_rank=node_rank, num_nodes=nodes, num_local_ranks=local, tp_size=nodes * local))


def test_two_nodes_of_two_ranks():
    plan = plan_group(ADDRS, [info(0), info(1)], dist_port=29555)
    assert (plan.tp_size, plan.num_nodes, plan.num_local_ranks) == (4, 2, 2)
    assert plan.rendezvous_address == "10.0.0.1:29555"
    layout = plan.layout_pb(1)
    assert (layout.node_rank, layout.tp_size, layout.group_id) == (1, 4, plan.group_id)
    assert len(plan.group_id) == 16


def test_single_node_needs_no_rendezvous_and_explicit_address_wins():
    plan = plan_group(ADDRS[:1], [info(0, nodes=1)], dist_port=DEFAULT_DIST_PORT)
    assert plan.rendezvous_address == "" and plan.tp_size == 2
    plan = plan_group(ADDRS, [info(0), info(1)], dist_port=1,
                      rendezvous_address="node0.internal:40000")
    assert plan.rendezvous_address == "node0.internal:40000"
    assert rendezvous_host("[::1]:50061") == "[::1]"
    with pytest.raises(WorkerFailure, match="rendezvous"):
        rendezvous_host("unix:/tmp/worker.sock")


def test_group_id_is_kept_only_when_every_worker_reports_it():
    same = [info(0, group_id="abc"), info(1, group_id="abc")]
    assert plan_group(ADDRS, same, dist_port=1).group_id == "abc"
    assert plan_group(ADDRS, same, dist_port=1, force_new=True).group_id != "abc"
    restarted = [info(0, group_id="abc"), info(1, group_id="")]
    assert plan_group(ADDRS, restarted, dist_port=1).group_id not in ("abc", "")


def test_misconfigured_workers_are_refused():
    with pytest.raises(WorkerFailure, match="different numbers of local ranks"):
        plan_group(ADDRS, [info(0, local=2), info(1, local=1)], dist_port=1)
    with pytest.raises(WorkerFailure, match="started as node 1 of 2.*number 0 of 2"):
        plan_group(ADDRS, [info(1), info(0)], dist_port=1)
    with pytest.raises(WorkerFailure, match="started as node 0 of 1"):
        plan_group(ADDRS, [info(0), info(0, nodes=1)], dist_port=1)
    with pytest.raises(WorkerFailure, match="num_local_ranks=4"):
        plan_group(ADDRS, [info(0), info(1)], dist_port=1, num_local_ranks=4)


def test_init_spec_checks_the_new_fields():
    config = WorkerConfig(model_dir="/m")
    assert InitSpec(config).num_local_ranks == 0
    assert InitSpec(config).dist_port == DEFAULT_DIST_PORT
    with pytest.raises(ParamError, match="dist_port"):
        InitSpec(config, dist_port=70000)
    with pytest.raises(ParamError, match="num_local_ranks"):
        InitSpec(config, num_local_ranks=-1)
