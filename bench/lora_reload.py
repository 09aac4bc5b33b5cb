"""What an adapter switch costs under --max-cpu-loras (docs/lora.md, "Adapters the workers
keep"), in-process, CPU fp32.

    python -m bench.lora_reload [--model DIR] [--rounds 5] [--rank 16]

Two random rank-r PEFT adapters on q/k/v/o/gate/up/down of the model (bench.lora_decode's),
served with --max-loras 1 --max-cpu-loras 1: a one-token request of the same adapter again (no
reload) against one of the other adapter (the one loaded evicted, the other read again from
disk and the stacks rebuilt), and the LoadLora call alone (the runner's read and rebuild)."""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.lora_decode import write_adapter
from deltaserve.default_model import default_model_dir
from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams

PROMPT = [[11, 40, 7, 93, 5, 120, 64, 3]]


def one_token(llm: LLM, name: str) -> float:
    start = time.perf_counter()
    llm.generate(PROMPT, SamplingParams(), StoppingParams(max_tokens=1, ignore_eos=True),
                 lora_request=name)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lora_reload")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    model = a.model or default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {n: write_adapter(model, Path(tmp) / n, r=a.rank) for n in "ab"}
        size = os.path.getsize(paths["a"] / "adapter_model.safetensors")
        print(f"{model.name} fp32 on {platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads; rank-{a.rank} adapter on every projection: "
              f"{size / 2**20:.1f} MiB of safetensors")
        llm = LLM(str(model), dtype="float32", num_kv_blocks=64, enable_lora=True,
                  lora_modules=" ".join(f"{n}={p}" for n, p in paths.items()),
                  max_lora_rank=a.rank, max_loras=1, max_cpu_loras=1)
        one_token(llm, "a"), one_token(llm, "b")                         # warm-up
        ops, rows = llm._lora.ops, []
        for i in range(a.rounds):
            name = "ab"[i % 2]                       # the other one is loaded: a switch
            switch = one_token(llm, name)
            same = one_token(llm, name)              # held now: no reload
            start = time.perf_counter()
            lora_id = 1 + "ab".index(name)
            ops.unload_lora(lora_id)
            ops.load_lora(lora_id, name, str(paths[name]))     # the same slot, read again
            rows.append((same, switch, (time.perf_counter() - start) * 1e3))
            print(f"round {i}: one token, same adapter {same:6.1f} ms | after a switch "
                  f"{switch:6.1f} ms | UnloadLora + LoadLora {rows[-1][2]:6.1f} ms")
        med = [statistics.median(col) for col in zip(*rows)]
        print(f"median: same adapter {med[0]:6.1f} ms | after a switch {med[1]:6.1f} ms | "
              f"UnloadLora + LoadLora {med[2]:6.1f} ms")

if __name__ == "__main__":
    main()
