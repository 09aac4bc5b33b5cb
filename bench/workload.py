"""nano-vllm's offline workload: random prompt token ids, input and output lengths each uniform.

Every request ignores EOS and produces exactly its drawn output length, so the token count is
fixed by the seed and two engines run the same work.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine_common.model_dir import ModelInfo
from engine_common.params import ParamError
from bench.presets import PRESETS, preset_dir

# Prompt ids are drawn from [0, PROMPT_ID_LIMIT) (or the vocabulary, if smaller), as nano-vllm does.
PROMPT_ID_LIMIT = 10_000


@dataclass(frozen=True)
class Workload:
    """prompts[i] (token ids) is to be continued by exactly output_lens[i] tokens."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab_size: int,
                  seed: int = 0) -> Workload:
    """`num_seqs` prompts with lengths and output lengths uniform in [min_len, max_len]."""
    if num_seqs < 1:
        raise ParamError("num_seqs", num_seqs, ">= 1")
    if min_len < 1:
        raise ParamError("min_len", min_len, ">= 1")
    if max_len < min_len:
        raise ParamError("max_len", max_len, f">= min_len ({min_len})")
    rng = random.Random(seed)
    id_limit = min(PROMPT_ID_LIMIT, vocab_size)
    prompts = [[rng.randrange(id_limit) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(prompts, output_lens, seed)


def add_model_and_workload_flags(p, preset_default: str | None, num_seqs: int, min_len: int,
                                 max_len: int, workload_title: str = "workload"):
    """--preset/--model, --cache-dir and the workload flags shared by the benchmarks; returns
    the workload argument group so a benchmark can add its own."""
    src = p.add_mutually_exclusive_group()
    shown = preset_default or "qwen3-0.6b"
    src.add_argument("--preset", choices=sorted(PRESETS), default=preset_default,
                     help=f"random weights of a real shape, built once and cached "
                          f"(default: {shown})")
    src.add_argument("--model", default=None, help="a Hugging Face model directory instead")
    p.add_argument("--cache-dir", default=None,
                   help="where presets are built (default: ~/.cache/deltaserve/presets)")
    w = p.add_argument_group(workload_title)
    w.add_argument("--num-seqs", type=int, default=num_seqs, help=f"default: {num_seqs}")
    w.add_argument("--min-len", type=int, default=min_len,
                   help=f"shortest input and output length (default: {min_len})")
    w.add_argument("--max-len", type=int, default=max_len,
                   help=f"longest input and output length (default: {max_len})")
    w.add_argument("--seed", type=int, default=0, help="default: 0")
    return w


def add_fused_ops_flag(group) -> None:
    """--fused-ops, for benchmarks that build the engine (it becomes RunnerConfig.fused_ops)."""
    group.add_argument("--fused-ops", action="store_true",
                       help="Triton RMSNorm (+ residual) and rope kernels in the model "
                            "(kernels/fused_norm.py, kernels/fused_rope.py); on CPU they run "
                            "in Triton's interpreter (slow)")


def model_and_workload(args, preset: str, device: str) -> tuple[str, Workload, int]:
    """(model directory, workload, vocabulary size) from the model and workload flags: --model,
    else `preset` built for `device`. Prompt + output must fit the model (2 * --max-len)."""
    model_dir = str(args.model or preset_dir(preset, args.cache_dir, device))
    info = ModelInfo.from_dir(model_dir)
    if 2 * args.max_len > info.max_model_len:
        raise ParamError("max_len", args.max_len,
                         f"<= {info.max_model_len // 2} (half the model's max length)")
    workload = make_workload(args.num_seqs, args.min_len, args.max_len, info.vocab_size,
                             args.seed)
    return model_dir, workload, info.vocab_size
