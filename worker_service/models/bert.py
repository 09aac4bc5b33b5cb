"""Encoder embedding models: BERT (BertModel, BertForMaskedLM checkpoints) and RoBERTa / XLM-R
(RobertaModel, XLMRobertaModel and their MaskedLM checkpoints), as transformers' BertModel and
XLMRobertaModel compute `last_hidden_state`:

    embeddings  x = LayerNorm(word[id] + token_type[t] + position[p])
    each layer  x = LayerNorm(x + dense(attention(x)))          post-LN
                x = LayerNorm(x + out(act(intermediate(x))))

t is 0, or 1 from a sentence pair's second text on (`token_type_ids`, given only for a step
with pairs); p is the position in the prompt for BERT; RoBERTa numbers its non-pad ids from
pad_token_id + 1 (transformers' create_position_ids_from_input_ids).
Attention is bidirectional within each request: the scheduler computes an encoder's prompt in
one step (WHOLE_PROMPT, engine_common/request/pooling.py), so a request's rows of the step are
its whole prompt and it attends over them (torch SDPA per request, no mask). Nothing is written
to a KV cache: the model asks for none (`needs_kv_cache`), and the runner keeps only the block
bookkeeping. There is no LM head: pooling rows never sample, and compute_logits refuses.

Tensor parallel as the decoders: q/k/v and the intermediate projection column-parallel, the two
output projections row-parallel (bias once, after the all-reduce); the embeddings' position and
token-type tables and the LayerNorms are replicated. Checkpoint names are transformers' (with or
without the `bert.` / `roberta.` prefix; old `gamma` / `beta` LayerNorm names too); the pooler
and MaskedLM head tensors are skipped (sentence-transformers does not use them).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.embedding import VocabParallelEmbedding
from worker_service.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)
from worker_service.layers.sharding import default_weight_loader, new_param
from worker_service.parallel_state import TPGroup

# config.json hidden_act -> the activation (transformers' ACT2FN names that are plain GELU/ReLU)
_ACTIVATIONS = MappingProxyType({
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
})
# Checkpoint tensors an embedding never reads: BertModel's pooler, the MaskedLM heads.
_SKIPPED_PREFIXES = ("pooler.", "cls.", "lm_head.")
_MODEL_PREFIXES = ("bert.", "roberta.")


@dataclass(frozen=True)
class EncoderArgs:
    """The shape of a BERT-style encoder, read from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_positions: int
    type_vocab_size: int
    hidden_act: str
    pad_token_id: int         # RoBERTa numbers positions after it

    @classmethod
    def from_hf(cls, cfg: dict) -> "EncoderArgs":
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"config.json: hidden_act={act!r} is not supported: must be one of "
                             f"{sorted(_ACTIVATIONS)}")
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"config.json: position_embedding_type={kind!r} is not supported: "
                             "must be 'absolute'")
        return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                   intermediate_size=int(cfg["intermediate_size"]),
                   num_layers=int(cfg["num_hidden_layers"]),
                   num_heads=int(cfg["num_attention_heads"]),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                   max_positions=int(cfg.get("max_position_embeddings", 512)),
                   type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                   hidden_act=act, pad_token_id=_int_or(cfg.get("pad_token_id"), 1))


def _int_or(value, default: int) -> int:
    return default if value is None else int(value)


class LayerNorm(nn.Module):
    """torch's LayerNorm with a replicated weight and bias (every rank holds all of it)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((size,), dtype, default_weight_loader)
        self.bias = new_param((size,), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class EncoderEmbeddings(nn.Module):
    """Token, position and token-type embeddings, summed and normalised."""

    def __init__(self, args: EncoderArgs, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp,
                                                      dtype)
        self.position_embeddings = _table(args.max_positions, args.hidden_size, dtype)
        self.token_type_embeddings = _table(args.type_vocab_size, args.hidden_size, dtype)
        self.LayerNorm = LayerNorm(args.hidden_size, args.layer_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """positions: each row's index into the position table; token_type_ids: each row's
        type (None: all 0)."""
        types = self.token_type_embeddings.weight
        x = self.word_embeddings(input_ids) + (
            types[0] if token_type_ids is None else F.embedding(token_type_ids, types))
        x = x + F.embedding(positions, self.position_embeddings.weight)
        return self.LayerNorm(x)


def _table(rows: int, width: int, dtype: torch.dtype) -> nn.Module:
    """A replicated lookup table (`.weight` [rows, width])."""
    table = nn.Module()
    table.weight = new_param((rows, width), dtype, default_weight_loader)
    return table


class EncoderSelfAttention(nn.Module):
    """q/k/v (one column-parallel matmul), each request attending over its own rows."""

    def __init__(self, args: EncoderArgs, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        head_dim = args.hidden_size // args.num_heads
        self.qkv_proj = QKVParallelLinear(args.hidden_size, head_dim, args.num_heads,
                                          args.num_heads, True, tp, dtype)
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, head_dim
        self.size = self.num_heads * head_dim

    def forward(self, hidden: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """starts: each request's first row in `hidden`, then the end of the last."""
        t = hidden.shape[0]
        # [1, heads, T, head_dim] views: 4-D inputs take torch's flash kernel on the CPU too
        q, k, v = (x.view(1, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for x in self.qkv_proj(hidden).split([self.size] * 3, dim=-1))
        out = hidden.new_zeros(t, self.size) if starts[-1] < t else hidden.new_empty(
            t, self.size)                                    # padding rows stay zero
        for a, b in zip(starts, starts[1:]):
            o = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
            out[a:b] = o[0].transpose(0, 1).reshape(b - a, self.size)
        return out


class EncoderLayer(nn.Module):
    """transformers' BertLayer, named as its checkpoint (attention.self / attention.output /
    intermediate / output)."""

    def __init__(self, args: EncoderArgs, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter, eps = args.hidden_size, args.intermediate_size, args.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = EncoderSelfAttention(args, tp, dtype)
        self.attention.output = nn.Module()
        self.attention.output.dense = RowParallelLinear(h, h, True, tp, dtype)
        self.attention.output.LayerNorm = LayerNorm(h, eps, dtype)
        self.intermediate = nn.Module()
        self.intermediate.dense = ColumnParallelLinear(h, inter, True, tp, dtype)
        self.output = nn.Module()
        self.output.dense = RowParallelLinear(inter, h, True, tp, dtype)
        self.output.LayerNorm = LayerNorm(h, eps, dtype)
        self.act = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor, starts: list[int]) -> torch.Tensor:
        att = self.attention
        x = att.output.LayerNorm(x + att.output.dense(att.self(x, starts)))
        y = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + y)


class BertModel(nn.Module):
    """An encoder embedding model over the step's flattened rows.

    forward(input_ids [T] int64, positions [T] int64, kv_caches (unused, empty), meta,
            token_type_ids [T] int64 or None) -> last_hidden_state rows [T, hidden_size]
    Every request in the step must be a whole prompt (positions 0..n-1); ValueError otherwise.
    """

    needs_kv_cache = False
    lm_head_is_tied = False
    packed_modules = MappingProxyType({
        "query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")})

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__()
        self.args = args = EncoderArgs.from_hf(hf_config)
        self.dtype = dtype
        self.embeddings = EncoderEmbeddings(args, tp, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(EncoderLayer(args, tp, dtype)
                                           for _ in range(args.num_layers))
        self.num_layers = args.num_layers
        self.num_kv_heads = self.encoder.layer[0].attention.self.num_heads   # per rank
        self.head_dim = args.hidden_size // args.num_heads

    def tie_lm_head(self) -> None:
        """No LM head to tie (the loader calls this when a checkpoint has none)."""

    def split_checkpoint_tensor(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """A checkpoint tensor under our name: the model prefix dropped, old LayerNorm names
        renamed, the pooler / MaskedLM head / position_ids buffer skipped ([])."""
        for prefix in _MODEL_PREFIXES:
            name = name.removeprefix(prefix)
        if name.startswith(_SKIPPED_PREFIXES) or name.endswith("position_ids"):
            return []
        if ".LayerNorm." in name:
            name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
        return [(name, tensor)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        starts = whole_prompt_starts(meta)
        x = self.embeddings(input_ids, self.table_positions(input_ids, positions, starts),
                            token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, starts)
        return x

    def table_positions(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        starts: list[int]) -> torch.Tensor:
        """Each row's position-table index: BERT's is its position in the prompt."""
        return positions

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is an encoder embedding model without an LM "
                         "head: it serves pooling requests only")


def whole_prompt_starts(meta: AttentionMetadata) -> list[int]:
    """The requests' first rows (and the end) from the host copies; ValueError when a request
    is not its whole prompt in this step (bidirectional attention needs every position)."""
    starts = meta.query_start_loc_cpu[:meta.num_reqs + 1].tolist()
    seq_lens = meta.seq_lens_cpu[:meta.num_reqs].tolist()
    for i, n in enumerate(seq_lens):
        if starts[i + 1] - starts[i] != n:
            raise ValueError(f"request {i} of the step computes {starts[i + 1] - starts[i]} of "
                             f"its {n} tokens: an encoder model needs a whole prompt per step")
    return starts


class RobertaModel(BertModel):
    """RoBERTa / XLM-R: BERT's layers; positions numbered from pad_token_id + 1."""

    def table_positions(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        starts: list[int]) -> torch.Tensor:
        """As transformers' create_position_ids_from_input_ids: pad + the count of non-pad
        ids up to and including the row, per request; a pad id itself takes pad (vLLM only
        adds pad + 1, which differs for a pad id inside a prompt)."""
        pad = self.args.pad_token_id
        real = (input_ids != pad).to(positions.dtype)
        out = torch.full_like(positions, pad)           # padding rows: a valid index
        for a, b in zip(starts, starts[1:]):
            out[a:b] = torch.cumsum(real[a:b], 0) * real[a:b] + pad
        return out
