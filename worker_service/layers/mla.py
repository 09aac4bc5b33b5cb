"""Multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi-K2, Moonlight), over the latent KV
cache, computing what transformers' DeepseekV2Attention / DeepseekV3Attention compute.

Per token the layer projects
    q     = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))  (q_lora_rank null: V2-Lite)
            -> per head [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)]
    kv_a  = kv_a_proj_with_mqa(x) -> [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]
    c     = kv_a_layernorm(c)           the compressed key/value every head shares
and transformers expands c through kv_b_proj = per head [W_UK (nope rows) | W_UV (v rows)]:
    k_h = [W_UK_h c | k_pe],  v_h = W_UV_h c,  score_h = (q_nope_h . W_UK_h c + q_pe_h . k_pe)
We never expand. The cache holds one "head" per token, the latent itself, as both K and V
(the paged backends take one head size for both; MQA with one kv head), in memory once (the
model's kv_values_are_keys: its cache's value half is its key half, loader.new_kv_cache):

    kv_cache[0 or 1, block, row, 0, :] = [ c (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim) ]

and the query is absorbed through W_UK, the output through W_UV:
    q'_h = [q_nope_h W_UK_h | rope(q_pe_h)]       (score_h = q'_h . [c | k_pe], unchanged)
    o_h  = (attention over the cached latents)[:kv_lora_rank] W_UV_h^T   -> v_head_dim
so a token costs kv_lora_rank + qk_rope_head_dim elements per layer (DeepSeek-V3: 576)
instead of 2 * heads * (nope + rope) (128 heads: 2 * 24,576).

Rope covers the rope dims only. DeepSeek checkpoints keep those dims in interleaved pairs
(x0, x1), (x2, x3), ...: V2 always (its complex rope), V3 when rope_interleave (default true).
They are de-interleaved into halves first, which makes the pairwise rotation the "rotate half"
rotation of layers/rotary.py; q and k get the same permutation, so their dot product is
transformers'. The softmax scale is qk_head_dim ** -0.5, times mscale(factor,
mscale_all_dim) ** 2 for a scaled rope with mscale_all_dim (transformers' yarn_apply_mscale).

Tensor parallelism splits the heads (q_b_proj / q_proj, kv_b_proj rows, o_proj columns); the
latent projections are replicated, so every rank caches the same latents.

The C++ CPU kernel takes head sizes 16..128 and the released latent (576, its value the first
512 dims of the same row: the attention layer's v_head_dim), up to 128 query heads per kv head:
the runner's `auto` picks it when it fits and the torch backend for a latent it cannot take
(another size, or a 576 whose kv_lora_rank is past 512); the cpu backend named for one is refused by name (check_mla_backend), never
swapped for another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import cpu_paged
from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.attention import Attention
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import RopeSettings, RotaryEmbedding
from worker_service.layers.sharding import divide
from worker_service.layers.yarn_rope import yarn_mscale
from worker_service.parallel_state import TPGroup, single_rank_group

LATENT_NORM_EPS = 1e-6     # transformers builds q_a_layernorm / kv_a_layernorm with the default


@dataclass(frozen=True)
class MlaArgs:
    """The attention fields of a DeepSeek config.json."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int           # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    scale: float               # the softmax scale

    @property
    def latent_dim(self) -> int:
        """The cached head size: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_softmax_scale(qk_head_dim: int, rope: RopeSettings) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 where a scaled rope sets mscale_all_dim (its
    factor required, as transformers, DeepSeek's code and vLLM require it: the rope's
    max_position_embeddings / original_max_position_embeddings fallback is not theirs)."""
    scale = qk_head_dim ** -0.5
    mscale_all_dim = rope.scaling.get("mscale_all_dim") or 0
    if rope.rope_type == "default" or not mscale_all_dim:
        return scale
    if rope.scaling.get("factor") is None:
        raise ValueError(f"config.json: rope_scaling.factor is absent with rope_type="
                         f"{rope.rope_type!r} and mscale_all_dim={mscale_all_dim}: must be set "
                         "(the attention's softmax scale is computed from it)")
    return scale * yarn_mscale(float(rope.scaling["factor"]), mscale_all_dim) ** 2


def replicated_linear(in_size: int, out_size: int, bias: bool,
                      dtype: torch.dtype) -> ColumnParallelLinear:
    """A linear layer every rank holds whole."""
    return ColumnParallelLinear(in_size, out_size, bias, single_rank_group(), dtype)


class LatentUpProjection(ColumnParallelLinear):
    """kv_b_proj: this rank's heads' [W_UK; W_UV] rows, read as matrices (never run as a
    linear layer, so never packed for the CPU GEMM)."""

    def use_cpu_kernels(self) -> bool:
        return False


def check_mla_backend(backend: AttentionBackend, mla: MlaArgs, heads: int,
                      dtype: torch.dtype) -> None:
    """ValueError naming what the CPU kernel cannot take when `backend` is it (`heads`: query
    heads per rank, all on the one latent head; the value: its first kv_lora_rank dims).
    Refused rather than attended on another backend, so the backend the runner reports is the
    one that runs."""
    if getattr(backend, "name", None) == "cpu":
        cpu_paged.check_layout(mla.latent_dim, dtype, heads, value_dim=mla.kv_lora_rank)


class MLAAttention(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] through the latent cache (module docstring).
    `backend` must take the latent head (check_mla_backend)."""

    def __init__(self, mla: MlaArgs, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = divide(mla.num_heads, tp.world_size, "num_attention_heads")
        qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q_out = mla.num_heads * qk_head
        if mla.q_lora_rank:
            self.q_a_proj = replicated_linear(mla.hidden_size, mla.q_lora_rank,
                                              mla.attention_bias, dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, fused_ops)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_out, False, tp, dtype)
        else:
            self.q_proj = ColumnParallelLinear(mla.hidden_size, q_out, False, tp, dtype)
        self.kv_a_proj_with_mqa = replicated_linear(mla.hidden_size, mla.latent_dim,
                                                    mla.attention_bias, dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, fused_ops)
        self.kv_b_proj = LatentUpProjection(
            mla.kv_lora_rank, mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), False,
            tp, dtype)
        self.o_proj = RowParallelLinear(mla.num_heads * mla.v_head_dim, mla.hidden_size,
                                        mla.attention_bias, tp, dtype)
        self.rotary_emb = rotary_emb
        self.num_kv_heads = 1
        # the value is the latent: the cached row's first kv_lora_rank dims
        self.attn = Attention(self.num_heads, 1, mla.latent_dim, mla.scale, backend,
                              v_head_dim=mla.kv_lora_rank)

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        return q.view(hidden.shape[0], self.num_heads, -1)

    def _rope_dims(self, x: torch.Tensor) -> torch.Tensor:
        """The rope dims in halves (de-interleaved when the checkpoint pairs them)."""
        if self.mla.rope_interleave:
            return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return x.contiguous()

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, kv_lora_rank], W_UV [heads, v, kv_lora_rank]), views."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        m, num_tokens = self.mla, hidden.shape[0]
        q_nope, q_pe = self._query(hidden).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank,
                                                              m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, self._rope_dims(q_pe),
                                     self._rope_dims(k_pe).unsqueeze(1))
        w_uk, w_uv = self._up_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)   # [T, H, kv_lora]
        query = torch.cat((q_latent, q_pe), dim=-1)
        key = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)                # [T, 1, latent]
        out = self.attn(query, key, key, kv_cache, meta)
        out = out.view(num_tokens, self.num_heads, m.kv_lora_rank)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))          # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))
