"""One timed run of bench/cpu_tree_ab.py in its own process, printing one JSON line.

Runnable against any tree of this project (`PYTHONPATH=TREE python bench/cpu_tree_ab_child.py
...`): it uses only the offline `LLM` API and bench/workload.py, so the same run measures an
older commit. Arguments: WORKLOAD NUM_SEQS MAX_OUTPUT DTYPE MAX_NUM_BATCHED_TOKENS (NUM_SEQS 0:
the workload's own count; MAX_OUTPUT 0: its own output lengths, else each capped there).

The real default model (SmolLM2-135M-Instruct, deltaserve/default_model.py), one torch thread,
the CPU device, greedy, ignore_eos, prefix caching on and emptied before the timed run; a
warm-up of the workload's first four requests comes first.
"""
from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import torch

    from bench.workload import NAMED_WORKLOADS, draw_workload
    from deltaserve.default_model import default_model_dir
    from deltaserve.llm import LLM
    from engine_common.model_files.model_dir import ModelInfo
    from engine_common.request.params import SamplingParams, StoppingParams

    name, num_seqs, max_output, dtype, batched = argv
    torch.set_num_threads(1)
    model = str(default_model_dir())
    work = draw_workload(NAMED_WORKLOADS[name].shape, ModelInfo.from_dir(model).vocab_size)
    count = int(num_seqs) or len(work.prompts)
    cap = int(max_output) or max(work.output_lens)
    prompts = work.prompts[:count]
    stops = [StoppingParams(max_tokens=min(n, cap), ignore_eos=True)
             for n in work.output_lens[:count]]
    llm = LLM(model, device="cpu", dtype=dtype, max_num_seqs=256, max_model_len=2048,
              kv_cache_bytes=1 << 30, enable_prefix_caching=True,
              max_num_batched_tokens=int(batched))
    greedy = SamplingParams(temperature=0.0)
    llm.generate(prompts[:4], greedy, stops[:4])
    llm.reset_prefix_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    out = llm.generate(prompts, greedy, stops)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "requests": len(out),
                      "tokens": sum(len(c.token_ids) for c in out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
