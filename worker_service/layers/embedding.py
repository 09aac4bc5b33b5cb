"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the group size and split into equal contiguous
ranges; rank r owns token ids [r * V_r, (r + 1) * V_r). Padding rows are zero and their logits
are trimmed away after the gather, so callers always see exactly vocab_size columns.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.layers.cpu_gemm import CpuGemm
from worker_service.layers.sharding import loaded_shape, new_param, read_rows
from worker_service.parallel_state import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] -> embeddings [T, hidden]; each rank looks up the ids it owns."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_per_rank = -(-vocab_size // tp.world_size)          # ceil division
        self.vocab_start = tp.rank * self.num_per_rank
        self.vocab_end = min(self.vocab_start + self.num_per_rank, vocab_size)
        self.weight = new_param((self.num_per_rank, hidden_size), dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """Copy this rank's vocabulary rows; padding rows become zero."""
        rows = loaded_shape(loaded)[0]
        if rows != self.vocab_size:
            raise ValueError(f"embedding has {rows} rows in the checkpoint, config says "
                             f"vocab_size={self.vocab_size}")
        num_real = max(self.vocab_end - self.vocab_start, 0)
        param.data.zero_()
        if num_real:
            param.data[:num_real].copy_(read_rows(loaded, 0, self.vocab_start, num_real))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * owned[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(CpuGemm, VocabParallelEmbedding):
    """Hidden states [N, hidden] -> float32 logits [N, vocab_size], gathered from all ranks.

    With tied embeddings the head reuses the embedding's (identically sharded) weight.
    """

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight parameter (same sharding, so no re-slicing needed)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie lm_head {tuple(self.weight.shape)} to embedding "
                             f"{tuple(embedding.weight.shape)}")
        self.weight = embedding.weight

    def asks_greedy(self) -> bool:
        """greedy() takes the CPU kernels on one rank only (below)."""
        return self.tp.world_size == 1

    def greedy(self, hidden: torch.Tensor, logprobs: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(argmax token of each row, its logprob) from the hidden states without float32
        logits, when this head can; else None. On the CPU the fused head never materialises
        the logits (kernels/cpu/linear.py); on CUDA one Triton pass reads them in the model's
        dtype (kernels/greedy_sample.py; widening to float32 is exact, so the ids are those of
        the float32 logits and the logprobs agree to float32 rounding), without a [N, vocab]
        float32 copy and with half the reads (0.05 ms of greedy kernels a step at ~244 rows of a
        152K vocabulary on an H100).
        logprobs False: the argmax alone, with an empty logprob tensor (CPU)."""
        if hidden.is_cuda and hidden.dim() == 2:
            from kernels.greedy_sample import greedy_sample
            return greedy_sample(self._model_dtype_logits(hidden))
        lin = self.cpu_linear
        if (lin is None or not lin.fuses_greedy or self.tp.world_size != 1
                or hidden.dtype != torch.float32 or hidden.dim() != 2):
            return None
        return lin.greedy(hidden, logprobs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model_dtype_logits(hidden).float()

    def _model_dtype_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab_size] logits in the model dtype, gathered from all ranks (a view whose rows
        may be padded: unit stride along the vocabulary only)."""
        logits = self.matmul(hidden)                           # [N, V_r] in the model dtype
        logits = self.tp.all_gather(logits, dim=-1)            # [N, V_r * world]
        return logits[:, :self.vocab_size]
