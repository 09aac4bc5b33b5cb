"""An autouse fixture, imported by the test modules that want it: every test runs with the
runner's pipelining off (serial, as the CPU runs) and on (as CUDA runs:
deltaserve.llm_executor.RunnerPipeline)."""
from __future__ import annotations

import pytest

from worker_service.runner.model_runner import ModelRunner


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "pipelined"])
def pipelined(request, monkeypatch):
    """Force the runner's pipelining on or off (a CPU runner has it off by default)."""
    init = ModelRunner.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pipelined = request.param
    monkeypatch.setattr(ModelRunner, "__init__", patched)
    return request.param
