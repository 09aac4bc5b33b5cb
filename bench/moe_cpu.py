"""The CPU mode of bench.moe_experts (`--cpu-kernels`): one Qwen3-MoE sparse block (router and
routed experts; `--gpt-oss`: GPT-OSS's, biases and the clamped SwiGLU) per token count T, three
ways on the same random weights and inputs:

    grouped       our SparseMoeBlock, experts on the grouped path (a host loop over the experts
                  with tokens: what the CPU ran before kernels/cpu/moe_experts.py, and what a
                  long prefill runs), each expert's GEMMs on the panels (CpuExperts.
                  expert_linear), as after the release of the stacked parameters
    unreleased    the grouped path over a dense copy of the experts' parameters, never packed
                  (F.linear on them: what a long prefill ran before the release); `--no-extra`
                  times only these two and packed
    packed        the same block after use_cpu_kernels(): experts on kernels/cpu/moe_experts.py
    transformers  transformers' Qwen3MoeSparseMoeBlock (GptOssMLP) forward (its own loop over
                  the experts)
    dense         a dense gated MLP of the same active width (top_k x moe_intermediate) on the
                  dense layers' CPU GEMMs: what a token costs without the routing (other
                  weights, so not checked)

in alternating rounds (each round times every path in turn, so all see the same machine): a
round's figure is the median of --iters calls after --warmup, and each path's line gives min /
median / max over --rounds rounds. packed and transformers are checked against grouped first
(relative L2 error; a failure exits 1).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from bench.kernel_timing import time_calls

CHECK_TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}


def make_blocks(args, dtype: torch.dtype):
    """(ours, transformers' forward x [T, H] -> [T, H]) with the same weights: std 0.02
    experts, std 0.5 router (routing far from ties, so both pick the same experts)."""
    import transformers as tf

    from worker_service.models.qwen_moe import MoeArgs, SparseMoeBlock
    from worker_service.parallel_state import single_rank_group

    cfg = tf.Qwen3MoeConfig(hidden_size=args.hidden, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, moe_intermediate_size=args.inter,
                            norm_topk_prob=True, num_attention_heads=max(1, args.hidden // 64),
                            num_key_value_heads=1)
    torch.manual_seed(0)
    theirs = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.normal_(0.0, 0.5)
        theirs.experts.gate_up_proj.normal_(0.0, 0.02)
        theirs.experts.down_proj.normal_(0.0, 0.02)
    theirs = theirs.to(dtype)
    ours = SparseMoeBlock(MoeArgs.from_hf(cfg.to_dict(), False), single_rank_group(), dtype)
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.experts.w13_weight.copy_(theirs.experts.gate_up_proj)   # [E, 2I, H]: gate, up
        ours.experts.w2_weight.copy_(theirs.experts.down_proj)
    return packed_keeping(ours), lambda x: theirs(x[None])[0]


def make_gpt_oss_blocks(args, dtype: torch.dtype):
    """(ours, transformers' forward) for GPT-OSS's block, the same weights: std 0.02 experts
    and biases, std 0.5 router; ours loaded through its checkpoint loaders (gate/up interleaved)."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from worker_service.layers.gpt_oss_moe import GptOssMoeBlock
    from worker_service.parallel_state import single_rank_group

    cfg = tf.GptOssConfig(hidden_size=args.hidden, num_local_experts=args.experts,
                          num_experts_per_tok=args.top_k, intermediate_size=args.inter,
                          num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=1)
    torch.manual_seed(0)
    theirs = GptOssMLP(cfg).eval().to(dtype)
    with torch.no_grad():
        theirs.router.weight.normal_(0.0, 0.5)
        for p in theirs.experts.parameters():
            p.normal_(0.0, 0.02)
    ours = GptOssMoeBlock(args.hidden, args.experts, args.top_k, args.inter,
                          single_rank_group(), dtype, cfg.swiglu_alpha, cfg.swiglu_limit)
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        ours.router.bias.copy_(theirs.router.bias)
    e, t = ours.experts, theirs.experts
    for param, loaded in ((e.w13_weight, t.gate_up_proj), (e.w13_bias, t.gate_up_proj_bias),
                          (e.w2_weight, t.down_proj), (e.w2_bias, t.down_proj_bias)):
        param.weight_loader(param, loaded.data)
    return packed_keeping(ours), lambda x: theirs(x[None])[0][0]


def packed(ours):
    """ours after use_cpu_kernels(); exits when the experts could not be packed."""
    from worker_service.layers.cpu_kernels import use_cpu_kernels

    use_cpu_kernels(ours)
    if ours.experts.cpu_experts is None:
        raise SystemExit("the deltaserve_cpu kernels did not load: no packed path to time")
    return ours


def packed_keeping(ours):
    """(ours packed, a copy of its experts never packed: their parameters stay dense)."""
    unreleased = copy.deepcopy(ours.experts)
    return packed(ours), unreleased


def dense_mlp(args, dtype: torch.dtype):
    """x -> down(silu(gate(x)) * up(x)) of width top_k * inter on kernels/cpu's GEMMs."""
    from kernels.cpu import extension, linear

    width = args.top_k * args.inter
    w13 = (0.02 * torch.randn(2 * width, args.hidden)).to(dtype)
    w2 = (0.02 * torch.randn(args.hidden, width)).to(dtype)
    gate_up, down, ops = linear.prepare(w13), linear.prepare(w2), extension.ops()
    return lambda x: down(ops.silu_and_mul(gate_up(x, w13)), w2)


def paths(blocks, theirs, dense, x: torch.Tensor, extra: bool = True) -> dict:
    ours, dense_experts = blocks
    packed = ours.experts.cpu_experts

    def grouped():                      # a row limit of 0: every step takes the grouped path
        kept, packed.max_mean_rows = packed.max_mean_rows, 0
        try:
            return ours(x)
        finally:
            packed.max_mean_rows = kept

    def unreleased():                   # the same block over the dense experts
        kept, ours.experts = ours.experts, dense_experts
        try:
            return ours(x)
        finally:
            ours.experts = kept

    calls = {"grouped": grouped, "unreleased": unreleased, "packed": lambda: ours(x)}
    if extra:
        calls.update(transformers=lambda: theirs(x), dense=lambda: dense(x))
    return calls


def run_one(ours, theirs, dense, num_tokens: int, args,
            dtype: torch.dtype) -> tuple[str, bool]:
    x = torch.randn(num_tokens, args.hidden).to(dtype)
    calls = paths(ours, theirs, dense, x, not args.no_extra)
    clock = time.thread_time if args.thread_time else time.perf_counter
    with torch.inference_mode():
        want = calls["grouped"]().float()
        for name in (n for n in calls if n not in ("grouped", "dense")):
            got = calls[name]().float()
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            if err > CHECK_TOL[args.dtype]:
                return f"T={num_tokens}: CHECK FAILED, {name}: relative L2 error {err:.3g}", False
        rounds = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                seconds = time_calls(call, "cpu", args.iters, args.warmup, clock)
                rounds[name].append(statistics.median(seconds) * 1e3)
    parts = ", ".join(f"{name} {min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f} ms"
                      for name, v in rounds.items())
    med = {name: statistics.median(v) for name, v in rounds.items()}
    # per round, unreleased / grouped: the speed of the grouped path over the panels relative
    # to the dense parameters (>= 1: no slower than before the release)
    kept = [a / b for a, b in zip(rounds["unreleased"], rounds["grouped"])]
    ratios = [f"unreleased / grouped {min(kept):.2f} / {statistics.median(kept):.2f} / "
              f"{max(kept):.2f}x", f"grouped / packed {med['grouped'] / med['packed']:.2f}x"]
    if "dense" in med:
        ratios += [f"transformers / packed {med['transformers'] / med['packed']:.2f}x",
                   f"packed / dense {med['packed'] / med['dense']:.2f}x"]
    return (f"T={num_tokens}: {parts} (min / median / max of {args.rounds} rounds); "
            f"{', '.join(ratios)}; {num_tokens * args.top_k / args.experts:g} rows an expert"
            ), True


def run(args, dtype: torch.dtype, sizes: str) -> tuple[list[str], bool]:
    """The report's lines and whether every check passed."""
    from bench.isa import describe_cpu

    ours, theirs = (make_gpt_oss_blocks if args.gpt_oss else make_blocks)(args, dtype)
    dense = dense_mlp(args, dtype)
    block = "GPT-OSS sparse block" if args.gpt_oss else "MoE sparse block"
    clock = "thread CPU time" if args.thread_time else "wall time"
    lines = [f"## {block} on the CPU ({torch.get_num_threads()} torch threads, {clock}): "
             f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.inter} {args.dtype}",
             "", f"- CPU: {describe_cpu()}"]
    ok = True
    for t in (int(s) for s in sizes.split(",")):
        line, good = run_one(ours, theirs, dense, t, args, dtype)
        lines.append(f"- {line}")
        ok = ok and good
    return lines, ok
