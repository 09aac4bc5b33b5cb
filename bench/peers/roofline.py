"""The workload's floor on this machine: matmul FLOPs at the measured GEMM rate, plus the bytes
decode steps must read at the measured copy bandwidth.

    floor_s = matmul_flops / gemm_flops_per_s + decode_bytes / copy_bytes_per_s

    matmul_flops  every token a forward pass must process (prompt tokens, the shared prefix once
                  when prefix caching is on, and every output token but the last), through the
                  decoder's linear layers (2 x params each), plus attention (QK^T and PV:
                  4 x context x heads x head_dim per layer), plus the LM head for each output token
    decode_bytes  decode steps x all weights (LM head included) + every decoded token's
                  context x KV bytes per position (keys and values, all layers)
    decode steps  (longest output - 1) x waves, a wave being max_num_seqs requests at once

The GEMM rate is torch's F.linear over the model's own projection shapes at 512 rows, in the
dtype; for bfloat16 / float16 also after widening to float32 (exact for the inputs, the same
float32 accumulation), since a CPU without native half-precision matmul does that faster. The
best is used and named. An engine's fraction = floor_s / its time (1.0 = at the floor).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

GEMM_ROWS = 512
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelShape":
        heads = int(cfg["num_attention_heads"])
        return cls(hidden=int(cfg["hidden_size"]), intermediate=int(cfg["intermediate_size"]),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   vocab=int(cfg["vocab_size"]),
                   tied=bool(cfg.get("tie_word_embeddings", False)))

    def projections(self) -> list[tuple[int, int]]:
        """(out, in) of one layer's matmuls: qkv, o, gate_up, down."""
        h, q, kv = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(q + 2 * kv, h), (h, q), (2 * self.intermediate, h), (h, self.intermediate)]

    @property
    def layer_params(self) -> int:
        return sum(o * i for o, i in self.projections())

    def weight_params(self) -> int:
        """Every weight a decode step reads (the input embedding only when tied to the head)."""
        norms = (2 * self.num_layers + 1) * self.hidden
        return self.num_layers * self.layer_params + self.vocab * self.hidden + norms

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Floor:
    matmul_flops: float
    decode_bytes: float
    gemm_flops_per_s: float
    copy_bytes_per_s: float
    gemm_how: str

    @property
    def compute_s(self) -> float:
        return self.matmul_flops / self.gemm_flops_per_s

    @property
    def memory_s(self) -> float:
        return self.decode_bytes / self.copy_bytes_per_s

    @property
    def seconds(self) -> float:
        return self.compute_s + self.memory_s


def best_floor(a: Floor, b: Floor) -> Floor:
    """The same workload's floor from two measurements, each rate at its best."""
    rate, how = max((a.gemm_flops_per_s, a.gemm_how), (b.gemm_flops_per_s, b.gemm_how))
    return Floor(a.matmul_flops, a.decode_bytes, rate, max(a.copy_bytes_per_s,
                                                           b.copy_bytes_per_s), how)


def workload_cost(shape: ModelShape, prompts: list[list[int]], output_lens: list[int],
                  dtype: str, shared_prefix_len: int = 0, prefix_caching: bool = True,
                  max_num_seqs: int = 256) -> tuple[float, float]:
    """(matmul FLOPs, decode bytes) of a workload, as the module docstring defines them."""
    per_token = 2 * shape.num_layers * shape.layer_params
    attn_per_ctx = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    skip = shared_prefix_len if prefix_caching else 0
    flops = 0.0
    for i, (prompt, n_out) in enumerate(zip(prompts, output_lens)):
        first = skip if i > 0 else 0            # positions computed for this request
        last = len(prompt) + n_out - 1          # the last output token is never fed back
        n = last - first
        flops += n * per_token + attn_per_ctx * (last * (last + 1) - first * (first + 1)) / 2
        flops += n_out * 2 * shape.hidden * shape.vocab
    elem = _DTYPE_BYTES[dtype]
    waves = -(-len(prompts) // max_num_seqs)
    steps = waves * max(max(output_lens) - 1, 0)
    kv_positions = sum(len(p) * (n - 1) + (n - 1) * n / 2 for p, n in zip(prompts, output_lens))
    nbytes = steps * shape.weight_params() * elem + kv_positions * shape.kv_bytes_per_token(elem)
    return flops, nbytes


def measure_gemm_rate(shape: ModelShape, dtype: str, threads: int) -> tuple[float, str]:
    """(FLOP/s, how) of the best way found to run the model's projections at GEMM_ROWS rows."""
    import torch

    torch.set_num_threads(threads)
    target = getattr(torch, dtype)
    best = (_time_linears(shape, target, target), f"F.linear in {dtype}")
    if target != torch.float32:
        widened = _time_linears(shape, target, torch.float32)
        if widened > best[0]:
            best = (widened, f"F.linear in float32 on {dtype} inputs widened")
    return best


def _time_linears(shape: ModelShape, dtype, compute_dtype, repeats: int = 3) -> float:
    import torch
    import torch.nn.functional as F

    mats = [(torch.randn(GEMM_ROWS, i).to(dtype), torch.randn(o, i).to(dtype))
            for o, i in shape.projections()]
    flops = sum(2 * GEMM_ROWS * o * i for o, i in shape.projections())
    best = float("inf")
    for _ in range(repeats + 1):            # the first pass warms up
        t0 = time.perf_counter()
        for x, w in mats:
            F.linear(x.to(compute_dtype), w.to(compute_dtype))
        best = min(best, time.perf_counter() - t0)
    return flops / best


def measure_floor(hf_config: dict, prompts, output_lens, dtype: str, threads: int,
                  shared_prefix_len: int, prefix_caching: bool, max_num_seqs: int) -> Floor:
    """Measure this machine (GEMM rate, copy bandwidth) and compute the workload's floor."""
    import torch

    from bench.bandwidth import measure_copy_bandwidth

    shape = ModelShape.from_hf(hf_config)
    rate, how = measure_gemm_rate(shape, dtype, threads)
    torch.set_num_threads(threads)
    bandwidth = measure_copy_bandwidth("cpu")
    flops, nbytes = workload_cost(shape, prompts, output_lens, dtype, shared_prefix_len,
                                  prefix_caching, max_num_seqs)
    return Floor(flops, nbytes, rate, bandwidth, how)
