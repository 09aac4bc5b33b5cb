"""One engine's side of `python -m bench.peers.embed`: load the model for embeddings, warm up,
embed the whole workload once (timed), write the vectors and the seconds.

    python -m bench.peers.embed_child {deltaserve|vllm} WORKLOAD_JSON OUT_JSON

Imports only the engine it runs (vLLM's virtualenv has our `bench` package on its path and
nothing else of ours). Both: the workload's dtype (fp32 by default), runner "pooling" with the
model's default pooler (LAST, normalised), prefix caching off, the same max_model_len.
"""
from __future__ import annotations

import json
import sys
import time


def _deltaserve(work: dict):
    import torch

    from deltaserve.llm import LLM

    torch.set_num_threads(work["threads"])
    llm = LLM(work["model"], runner="pooling", dtype=work.get("dtype", "float32"),
              max_model_len=work["max_model_len"], enable_prefix_caching=False)
    return lambda prompts: [o.embedding for o in llm.embed(prompts)]


def _vllm(work: dict):
    from vllm import LLM

    # gpu_memory_utilization: on the CPU backend the share of RAM vLLM insists is free at start
    # (0.92 by default fails on a shared machine); the KV cache is VLLM_CPU_KVCACHE_SPACE.
    llm = LLM(work["model"], runner="pooling", dtype=work.get("dtype", "float32"),
              max_model_len=work["max_model_len"], enable_prefix_caching=False,
              gpu_memory_utilization=0.3, seed=0)
    return lambda prompts: [list(o.outputs.embedding) for o in llm.embed(
        [{"prompt_token_ids": p} for p in prompts])]


def main() -> int:
    engine, workload_path, out_path = sys.argv[1:4]
    with open(workload_path) as f:
        work = json.load(f)
    embed = {"deltaserve": _deltaserve, "vllm": _vllm}[engine](work)
    embed(work["prompts"][:4])                      # warm-up, untimed
    start = time.perf_counter()
    vectors = embed(work["prompts"])
    seconds = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump({"seconds": seconds, "vectors": vectors}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
