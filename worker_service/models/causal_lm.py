"""What every decoder-only model class shares once it holds `self.model` (the decoder: ids,
positions, KV caches, metadata -> hidden) and `self.lm_head` (a ParallelLMHead)."""
from __future__ import annotations

import torch

from kernels.attention.backend import AttentionMetadata


class CausalLMHeadMixin:
    """forward -> hidden [T, hidden_size]; compute_logits -> float32 [N, vocab_size]."""

    @property
    def lm_head_is_tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def tie_lm_head(self) -> None:
        """Make the LM head share the input embedding's weight."""
        self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


SUPPORTED_ACTIVATION = "silu"


def refuse_activation(hf_config: dict, arch: str) -> None:
    """ValueError naming config.json's hidden_act unless it is the SiLU our gated MLP runs."""
    act = hf_config.get("hidden_act", SUPPORTED_ACTIVATION)
    if act != SUPPORTED_ACTIVATION:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported for {arch}: must "
                         f"be {SUPPORTED_ACTIVATION!r}")
