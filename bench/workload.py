"""Benchmark workloads: random prompt token ids, input and output lengths each uniform, and the
named workloads `make bench` and `make bench-peers` share.

Every request ignores EOS and produces exactly its drawn output length, so the token count is
fixed by the seed and two engines run the same work. A shared-prefix workload puts one common
prompt (drawn first) in front of every request's own tokens.

    name            requests  prompt tokens           output tokens  model
    prefill-heavy   32        64-512                  64-128         the real model: --model, else
                                                                     the default SmolLM2-135M-
                                                                     Instruct (deltaserve/
                                                                     default_model.py)
    decode-heavy    256       16-64                   256-512        the real model
    shared-prefix   64        400 shared + 32-64 own  64-128         the real model
    step-overhead   256       16-32                   256            2 layers, 256 wide, the real
                                                                     model's tokenizer and vocab
    smoke           8         8-32                    8-16           --model, else the tiny preset
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import ParamError
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

    @property
    def max_total_len(self) -> int:
        """The longest prompt + output of any request (what max_model_len must hold)."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))


@dataclass(frozen=True)
class WorkloadShape:
    """How a workload is drawn: lengths are inclusive ranges; the shared prefix (if any) comes
    before each request's own input_lens tokens."""

    num_seqs: int
    input_lens: tuple[int, int]
    output_lens: tuple[int, int]
    shared_prefix_len: int = 0

    def __post_init__(self):
        if self.num_seqs < 1:
            raise ParamError("num_seqs", self.num_seqs, ">= 1")
        for name, (lo, hi) in (("input_len", self.input_lens), ("output_len", self.output_lens)):
            if lo < 1:
                raise ParamError(f"min_{name}", lo, ">= 1")
            if hi < lo:
                raise ParamError(f"max_{name}", hi, f">= min_{name} ({lo})")
        if self.shared_prefix_len < 0:
            raise ParamError("shared_prefix_len", self.shared_prefix_len, ">= 0")

    @property
    def max_total_len(self) -> int:
        return self.shared_prefix_len + self.input_lens[1] + self.output_lens[1]

    def describe(self) -> str:
        prefix = (f"a {self.shared_prefix_len}-token shared prefix + "
                  if self.shared_prefix_len else "")
        return (f"{self.num_seqs} requests, prompts {prefix}{_span(self.input_lens)} tokens, "
                f"outputs {_span(self.output_lens)} tokens")


def _span(lens: tuple[int, int]) -> str:
    return str(lens[0]) if lens[0] == lens[1] else f"{lens[0]}-{lens[1]}"


@dataclass(frozen=True)
class NamedWorkload:
    """A workload by name. model: "real" (--model, else the default real model), "smoke"
    (--model, else the tiny preset), or a preset name (it borrows the real model's tokenizer
    and vocabulary)."""

    name: str
    shape: WorkloadShape
    model: str = "real"
    summary: str = ""


NAMED_WORKLOADS: dict[str, NamedWorkload] = {w.name: w for w in (
    NamedWorkload("prefill-heavy", WorkloadShape(32, (64, 512), (64, 128)),
                  summary="prompt-dominated: the matmuls of prefill decide it"),
    NamedWorkload("decode-heavy", WorkloadShape(256, (16, 64), (256, 512)),
                  summary="long outputs at high concurrency: decode steps and KV reads"),
    NamedWorkload("shared-prefix", WorkloadShape(64, (32, 64), (64, 128), shared_prefix_len=400),
                  summary="one system prompt, prefix caching"),
    NamedWorkload("step-overhead", WorkloadShape(256, (16, 32), (256, 256)),
                  model="step-overhead",
                  summary="a 2-layer model: LM head, sampler, batch upkeep, output processing"),
    NamedWorkload("smoke", WorkloadShape(8, (8, 32), (8, 16)), model="smoke",
                  summary="a few short requests, to check the harness runs (CI)"),
)}


def draw_workload(shape: WorkloadShape, vocab_size: int, seed: int = 0) -> Workload:
    """The prompts and output lengths of `shape`, a pure function of (shape, vocab, seed)."""
    rng = random.Random(seed)
    id_limit = min(PROMPT_ID_LIMIT, vocab_size)
    prefix = [rng.randrange(id_limit) for _ in range(shape.shared_prefix_len)]
    prompts = [prefix + [rng.randrange(id_limit) for _ in range(rng.randint(*shape.input_lens))]
               for _ in range(shape.num_seqs)]
    output_lens = [rng.randint(*shape.output_lens) for _ in range(shape.num_seqs)]
    return Workload(prompts, output_lens, seed)


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab_size: int,
                  seed: int = 0) -> Workload:
    """`num_seqs` prompts with lengths and output lengths uniform in [min_len, max_len]."""
    if min_len < 1:
        raise ParamError("min_len", min_len, ">= 1")
    if max_len < min_len:
        raise ParamError("max_len", max_len, f">= min_len ({min_len})")
    return draw_workload(WorkloadShape(num_seqs, (min_len, max_len), (min_len, max_len)),
                         vocab_size, seed)


def warmup_workload(workload: Workload, vocab_size: int, num_seqs: int = 8,
                    max_output_len: int = 16) -> Workload:
    """A few short requests shaped like `workload`'s first ones but with other ids (so they
    leave no prefix-cache hits behind), for an untimed warm-up."""
    rng = random.Random(workload.seed + 1)
    id_limit = min(PROMPT_ID_LIMIT, vocab_size)
    chosen = workload.prompts[:num_seqs]
    prompts = [[rng.randrange(id_limit) for _ in p] for p in chosen]
    outputs = [min(n, max_output_len) for n in workload.output_lens[:num_seqs]]
    return Workload(prompts, outputs, workload.seed + 1)


def add_model_and_workload_flags(p, preset_default: str | None, num_seqs: int, min_len: int,
                                 max_len: int, workload_title: str = "workload"):
    """--preset/--model, --cache-dir and the workload flags shared by the benchmarks; returns
    the workload argument group so a benchmark can add its own. The numbers given are the
    defaults when no --workload is named."""
    src = p.add_mutually_exclusive_group()
    shown = preset_default or "qwen3-0.6b"
    src.add_argument("--preset", choices=sorted(PRESETS), default=preset_default,
                     help=f"random weights of a real shape, built once and cached "
                          f"(default: {shown})")
    src.add_argument("--model", default=None,
                     help="a Hugging Face model directory instead (named workloads: the real "
                          "model, default SmolLM2-135M-Instruct from the cache; step-overhead "
                          "borrows its tokenizer and vocabulary)")
    p.add_argument("--cache-dir", default=None,
                   help="where presets are built (default: ~/.cache/deltaserve/presets)")
    w = p.add_argument_group(workload_title)
    w.add_argument("--workload", choices=sorted(NAMED_WORKLOADS), default=None,
                   help="a named workload (its shape and model; the flags below override its "
                        "numbers)")
    w.set_defaults(default_shape=WorkloadShape(num_seqs, (min_len, max_len), (min_len, max_len)))
    w.add_argument("--num-seqs", type=int, default=None, help=f"default: {num_seqs}")
    w.add_argument("--min-len", type=int, default=None,
                   help=f"shortest input and output length (default: {min_len})")
    w.add_argument("--max-len", type=int, default=None,
                   help=f"longest input and output length (default: {max_len})")
    for which in ("input", "output"):
        w.add_argument(f"--min-{which}-len", type=int, default=None,
                       help=f"shortest {which} length (overrides --min-len)")
        w.add_argument(f"--max-{which}-len", type=int, default=None,
                       help=f"longest {which} length (overrides --max-len)")
    w.add_argument("--shared-prefix-len", type=int, default=None,
                   help="tokens of one prompt prefix every request shares (default: 0, or the "
                        "named workload's)")
    w.add_argument("--seed", type=int, default=0, help="default: 0")
    return w


def workload_shape(args: argparse.Namespace) -> WorkloadShape:
    """The shape the flags ask for: the named workload's (or the benchmark's default), with
    --min-len/--max-len setting both ranges and the per-side flags overriding them."""
    base = NAMED_WORKLOADS[args.workload].shape if args.workload else args.default_shape
    both_lo, both_hi = args.min_len, args.max_len

    def pick(side: str, lens: tuple[int, int]) -> tuple[int, int]:
        lo = _first(getattr(args, f"min_{side}_len"), both_lo, lens[0])
        hi = _first(getattr(args, f"max_{side}_len"), both_hi, lens[1])
        return lo, hi
    return replace(base, num_seqs=_first(args.num_seqs, base.num_seqs),
                   input_lens=pick("input", base.input_lens),
                   output_lens=pick("output", base.output_lens),
                   shared_prefix_len=_first(args.shared_prefix_len, base.shared_prefix_len))


def _first(*values):
    return next(v for v in values if v is not None)


def model_dir_for(args: argparse.Namespace, preset: str, device: str) -> str:
    """The model a benchmark runs: a named workload's model (the real model: --model, else the
    default one, fetched and converted on first use; or its preset), else --model, else `preset`
    built for `device`."""
    named = NAMED_WORKLOADS.get(args.workload) if args.workload else None
    if named is None or (named.model == "smoke" and args.model):
        return str(args.model or preset_dir(args.preset or preset, args.cache_dir, device))
    if named.model == "smoke":
        return str(preset_dir("tiny", args.cache_dir, device))
    real = args.model
    if not real:
        # imported here: its GGUF conversion imports the worker (torch), and `deltaserve`'s
        # parser imports this module in the torch-free scheduler image
        from deltaserve.default_model import ensure_default_model
        real = ensure_default_model()
    real = str(real)
    if named.model == "real":
        return real
    return str(preset_dir(named.model, args.cache_dir, device, tokenizer_dir=real))


def model_and_workload(args, preset: str, device: str) -> tuple[str, Workload, int]:
    """(model directory, workload, vocabulary size) from the model and workload flags.
    Prompt + output must fit the model's max length."""
    model_dir = model_dir_for(args, preset, device)
    info = ModelInfo.from_dir(model_dir)
    shape = workload_shape(args)
    if shape.max_total_len > info.max_model_len:
        raise ParamError("max_input_len + max_output_len", shape.max_total_len,
                         f"<= {info.max_model_len} (the model's max length, shared prefix "
                         f"included)")
    return model_dir, draw_workload(shape, info.vocab_size, args.seed), info.vocab_size


def add_fused_ops_flag(group) -> None:
    """--fused-ops, for benchmarks that build the engine (it becomes RunnerConfig.fused_ops)."""
    group.add_argument("--fused-ops", action="store_true",
                       help="Triton RMSNorm (+ residual) and rope kernels in the model "
                            "(kernels/fused_norm.py, kernels/fused_rope.py); on CPU they run "
                            "in Triton's interpreter (slow)")
