"""One in-process run of bench/host_overhead.py, in its own process, printing one JSON line.

Runnable against any tree of this project (`PYTHONPATH=TREE python bench/host_overhead_child.py
...`): it uses only the offline `LLM` API, so the same measurement runs on an older commit for
a before/after comparison. Arguments: MODEL_DIR NUM_SEQS OUTPUT_LEN DEVICE_MS|none ASYNC(0/1).
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time

STEADY_SKIP = 8    # steps at each end left out of the steady state (prefill, the tail)


def main(argv: list[str]) -> int:
    import torch

    from deltaserve.llm import LLM
    # The tree's own classes: a tree from before engine_common was grouped (a4fd5a2, the
    # baseline) has them in engine_common.params, and its engine_common.request would be found in
    # this checkout's editable install instead.
    try:
        from engine_common.params import SamplingParams, StoppingParams
    except ImportError:
        from engine_common.request.params import SamplingParams, StoppingParams

    model_dir, num_seqs, output_len = argv[0], int(argv[1]), int(argv[2])
    device_ms = None if argv[3] == "none" else float(argv[3])
    torch.set_num_threads(1)
    kwargs = dict(dtype="float32", max_num_seqs=num_seqs, max_model_len=1024,
                  async_scheduling=argv[4] == "1", num_kv_blocks=num_seqs * 24)
    if device_ms is not None:
        kwargs["simulated_device_ms"] = device_ms
    llm = LLM(model_dir, **kwargs)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 48))]
               for _ in range(num_seqs)]
    stopping = StoppingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(), StoppingParams(max_tokens=4, ignore_eos=True))
    records = _observe(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(), stopping)
    wall = time.perf_counter() - start
    steady = records[STEADY_SKIP:-STEADY_SKIP] or records
    names = dict.fromkeys(name for r in steady for name in r)
    phases = {name: _spread([r[name] for r in steady if name in r]) for name in names}
    print(json.dumps({"tokens": sum(len(o.token_ids) for o in outs), "wall_s": wall,
                      "steps": len(records), "phases_ms": phases}))
    return 0


def _observe(llm) -> list[dict]:
    """Wrap the engine's step and output processing; one dict of ms per step."""
    engine, records = llm.engine, []
    step, process = engine.step, engine.output_processor.process
    spent = {"out": 0.0}

    def timed_process(updates):
        t = time.perf_counter()
        try:
            return process(updates)
        finally:
            spent["out"] += time.perf_counter() - t

    def timed_step():
        spent["out"] = 0.0
        t = time.perf_counter()
        outputs = step()
        whole = time.perf_counter() - t
        s = engine.core.last_step
        if s.num_reqs:
            rec = {"step": whole, "schedule+encode": s.schedule_s, "wait for runner":
                   s.round_trip_s, "decode+update": s.update_s, "output processing": spent["out"]}
            # The runner's last finished phases (with async scheduling another thread's clock,
            # read while it may be mid-step: a phase can be missing from a record).
            phases = dict(llm.runner.clock.phases)
            rec.update({f"runner {k}": v for k, v in phases.items()})
            # What is left of the step without the model and sampler: the host's work.
            rec["host work"] = whole - phases.get("forward", 0.0) - phases.get("sampling", 0.0)
            records.append({k: v * 1e3 for k, v in rec.items()})
        return outputs
    engine.step, engine.output_processor.process = timed_step, timed_process
    return records


def _spread(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
