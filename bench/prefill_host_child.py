"""One run of bench/prefill_host.py in its own process, printing one JSON line.

Runnable against any tree of this project (`PYTHONPATH=TREE python bench/prefill_host_child.py
...`): it uses only the offline `LLM` API and bench/workload.py, so the same measurement runs on
an older commit for a before/after comparison. Arguments: MODEL_DIR NUM_SEQS MAX_TOKENS
ASYNC(0/1).

The device is simulated with 0 ms per step, so every second of a step is host work: scheduling
and encoding the diff, the runner's decode, check, apply and step inputs, the reply and the
output processing. A warm-up run of the same shape (other ids: no prefix-cache hits) comes
first, so the timed run meets warm buffers and pools.
"""
from __future__ import annotations

import json
import sys
import time

MIN_PROMPT, MAX_PROMPT = 100, 1024        # nano-vllm's prompt lengths
MAX_NUM_BATCHED_TOKENS = 16384
BLOCK_SIZE = 16


def main(argv: list[str]) -> int:
    import torch

    from deltaserve.llm import LLM
    from engine_common.request.params import SamplingParams, StoppingParams
    from bench.workload import WorkloadShape, draw_workload, warmup_workload

    model_dir, num_seqs, max_tokens = argv[0], int(argv[1]), int(argv[2])
    async_scheduling = argv[3] == "1"
    torch.set_num_threads(1)
    max_model_len = MAX_PROMPT + max_tokens + 1
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, async_scheduling=async_scheduling,
              num_kv_blocks=num_seqs * blocks_per_seq + 16, simulated_device_ms=0.0)
    vocab = llm.model_info.vocab_size
    shape = WorkloadShape(num_seqs, (MIN_PROMPT, MAX_PROMPT), (max_tokens, max_tokens))
    workload = draw_workload(shape, vocab, seed=0)
    warm = warmup_workload(workload, vocab, num_seqs=num_seqs, max_output_len=max_tokens)
    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(warm.prompts, SamplingParams(), stopping)
    records = _observe(llm)
    start, cpu_start = time.perf_counter(), time.process_time()
    llm.generate(workload.prompts, SamplingParams(), stopping)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    prefill = [r for r in records if r["new"]]
    # A prefill step: a scheduled step that admitted new requests (an async step() call can
    # schedule two steps: its first call after an idle spell only submits).
    print(json.dumps({
        "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "steps": len(records),
        "prefill_steps": sum(r["admitting"] for r in records),
        "new_requests": sum(r["new"] for r in records),
        "prompt_tokens": workload.num_prompt_tokens, "vocab_size": vocab,
        "prefill_step_ms": [r["step"] for r in prefill],   # engine step() calls
        "phases_ms": {k: sum(r[k] for r in records) for k in records[0]
                      if k not in ("new", "admitting")}}))
    return 0


def _observe(llm) -> list[dict]:
    """Wrap the engine's step and the scheduler's schedule(): per step, its ms by phase and how
    many new requests the schedule() calls inside it admitted."""
    engine, records = llm.engine, []
    step, schedule = engine.step, engine.core.scheduler.schedule
    admitted = {"new": 0, "admitting": 0}

    def counted_schedule():
        out = schedule()
        admitted["new"] += len(out.new_requests)
        admitted["admitting"] += bool(out.new_requests)
        return out

    def timed_step():
        admitted["new"] = admitted["admitting"] = 0
        t = time.perf_counter()
        outputs = step()
        whole = time.perf_counter() - t
        s = engine.core.last_step
        records.append({"new": admitted["new"], "admitting": admitted["admitting"],
                        "step": whole * 1e3,
                        "schedule+encode": s.schedule_s * 1e3,
                        "wait for runner": s.round_trip_s * 1e3,
                        "decode+update": s.update_s * 1e3})
        return outputs
    engine.step, engine.core.scheduler.schedule = timed_step, counted_schedule
    return records


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
