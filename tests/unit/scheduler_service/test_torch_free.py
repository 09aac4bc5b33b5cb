"""The scheduler side runs where torch cannot even be imported (layering rule)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from tests.support.paths import REPO

ROOT = REPO

SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, random, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, NoTorch())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker did not work")

    import engine_common
    for mod in pkgutil.iter_modules(engine_common.__path__):
        importlib.import_module(f"engine_common.{mod.name}")

    from engine_common.wire.codec import decode_scheduler_output, encode_scheduler_output
    from engine_common.configuration.config import SchedulerConfig
    from engine_common.wire.diff import RunnerOutput
    from engine_common.request.params import SamplingParams, StoppingParams
    from scheduler_service.core.request import Request, RequestStatus
    from scheduler_service.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                                      max_model_len=2048),
                      num_blocks=16, rng=random.Random(0))
    for i in range(3):
        sched.add_request(Request(f"r{i}", list(range(3, 9 + i)), SamplingParams(),
                                  StoppingParams(max_tokens=3)))
    # The fake model: a token for every request whose prompt is now fully computed.
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        out = decode_scheduler_output(encode_scheduler_output(sched.schedule()))
        handles = [r.handle for r in sched.running
                   if r.num_computed_tokens == r.num_tokens]
        sched.update_from_output(out, RunnerOutput(out.step, handles, [42] * len(handles),
                                                   [0.0] * len(handles)))
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == sched.num_total_blocks
    assert "torch" not in sys.modules
    print("torch-free OK")
""")


def test_scheduler_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "torch-free OK" in proc.stdout
