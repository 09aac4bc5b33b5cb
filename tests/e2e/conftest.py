"""Tensor-parallel clusters shared by the e2e tests: real worker services on loopback with spawned
rank processes (gloo on CPU). Module-scoped: each test module starts its own cluster once (a test
that kills ranks leaves no trace in another module)."""
from __future__ import annotations

import pytest

from tests.support.tp_harness import Cluster


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """One worker service with 2 local ranks."""
    c = Cluster.start(tmp_path_factory.mktemp("tp2"), nodes=1, local_ranks=2)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tp2_two_nodes(tmp_path_factory):
    """Two worker services (nodes) of one rank each."""
    c = Cluster.start(tmp_path_factory.mktemp("tp2-nodes"), nodes=2, local_ranks=1)
    yield c
    c.close()
