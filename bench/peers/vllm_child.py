"""The vLLM engine process of the peer harness: `LLM.generate` on token-id prompts, greedy,
ignore_eos. Runs with vLLM's own interpreter (its virtualenv), so it imports nothing of ours but
the stdlib-only protocol module.

    V/bin/python -m bench.peers.vllm_child WORKLOAD_JSON SETTINGS_JSON

The harness sets the environment: VLLM_CPU_OMP_THREADS_BIND (the model thread's cores),
VLLM_CPU_KVCACHE_SPACE (GiB), VLLM_USE_AOT_COMPILE=0 (its compile cache then works across starts),
and under --isa avx2 the variables of bench/isa.py (see hide_wider_than_avx2).
vLLM's engine core is a spawned process, hence the __main__ guard.
"""
from __future__ import annotations

import json
import os
import sys
import time

from bench.peers.protocol import load_workload, serve

# torch.cpu's checks of what the CPU itself has: vLLM picks its kernel library (_C_AVX2,
# _C_AVX512, _C) and its bf16 paths by them, which ATEN_CPU_CAPABILITY does not reach
_WIDER_THAN_AVX2 = ("_is_avx512_supported", "_is_avx512_vnni_supported",
                    "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                    "_is_amx_fp16_supported")


def hide_wider_than_avx2() -> list[str]:
    """Under --isa avx2 (ATEN_CPU_CAPABILITY=avx2), make torch.cpu's checks answer as an AVX2
    CPU's would, in this process and in vLLM's spawned engine core (spawn imports this module
    again there), so vLLM loads its AVX2 kernels. Returns the checks it changed."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        return []
    import torch

    changed = [name for name in _WIDER_THAN_AVX2 if hasattr(torch.cpu, name)]
    for name in changed:
        setattr(torch.cpu, name, lambda: False)
    return changed


hide_wider_than_avx2()


def loaded_kernel_libraries(maps: str = "/proc/self/maps") -> str:
    """vLLM's kernel libraries mapped into this process (_C_AVX2, _C_AVX512, _C): their import
    fails by design after loading (the module inside is named _C), so sys.modules misses them."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            names = {line.rsplit("/", 1)[-1].split(".")[0] for line in f
                     if "/vllm/_C" in line and ".so" in line}
    except OSError:
        return ""
    return ", ".join(f"vllm.{n}" for n in sorted(names))


def start(workload: dict, settings: dict):
    from vllm import LLM

    kwargs = dict(model=settings["model"], dtype=settings["dtype"],
                  max_model_len=settings["max_model_len"],
                  max_num_seqs=settings["max_num_seqs"],
                  enable_prefix_caching=settings["prefix_caching"], seed=0)
    if settings.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = settings["max_num_batched_tokens"]
    kwargs.update(settings.get("options") or {})
    llm = LLM(**kwargs)
    _generate(llm, workload["warmup"])
    sched = llm.llm_engine.vllm_config.scheduler_config
    import torch
    import vllm

    kernels = loaded_kernel_libraries() or "no vllm._C*"
    description = (f"vLLM {vllm.__version__} LLM.generate, {settings['dtype']}, torch CPU "
                   f"capability {torch.backends.cpu.get_cpu_capability()}, {kernels} "
                   f"kernels in this process, max_num_seqs "
                   f"{sched.max_num_seqs}, max_num_batched_tokens "
                   f"{sched.max_num_batched_tokens}, prefix caching "
                   f"{'on, emptied before each run' if settings['prefix_caching'] else 'off'}")
    return llm, description


def _generate(llm, part: dict) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in part["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in part["output_lens"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    workload, settings = load_workload(sys.argv[1]), json.loads(sys.argv[2])

    def run_one(llm, tag):
        if settings["prefix_caching"]:
            llm.reset_prefix_cache()    # every round prefills its prompts (see the harness)
        t0 = time.perf_counter()
        ids = _generate(llm, workload)
        return time.perf_counter() - t0, ids, {}
    return serve("vLLM", lambda: start(workload, settings), run_one)


if __name__ == "__main__":
    sys.exit(main())
