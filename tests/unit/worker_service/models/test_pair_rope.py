"""models/pair_rope.py: reordering q/k rows turns transformers' interleaved-pair rope (GLM's,
Cohere's) into the rotate-half rope every kernel here runs, leaving q . k unchanged."""
from __future__ import annotations

import pytest
import torch

from worker_service.layers.rotary import RopeSettings, RotaryEmbedding
from worker_service.models.pair_rope import halves_order, pairs_to_halves


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                     theta: float) -> torch.Tensor:
    """transformers' modeling_glm / modeling_cohere rotation of x [T, H, D]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions[:, None].float() * inv_freq
    cos = freqs.cos().repeat_interleave(2, -1)[:, None]
    sin = freqs.sin().repeat_interleave(2, -1)[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def test_order_puts_even_dims_first_then_odd_then_the_rest():
    assert halves_order(8, 4).tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    assert halves_order(6, 6).tolist() == [0, 2, 4, 1, 3, 5]


@pytest.mark.parametrize("head_dim,factor", [(16, 1.0), (16, 0.5), (32, 0.75)])
def test_rotate_half_of_reordered_rows_is_the_interleaved_rope_reordered(head_dim, factor):
    torch.manual_seed(0)
    heads, hidden, tokens = 3, 10, 7
    weight = torch.randn(heads * head_dim, hidden)
    bias = torch.randn(heads * head_dim)
    x = torch.randn(tokens, hidden)
    positions = torch.tensor([0, 1, 5, 9, 30, 31, 100])
    settings = RopeSettings(theta=10000.0, partial_rotary_factor=factor)
    rotary_dim = settings.rotary_dim(head_dim)
    rope = RotaryEmbedding(head_dim, 128, settings)

    theirs = interleaved_rope((x @ weight.T + bias).reshape(tokens, heads, head_dim),
                              positions, rotary_dim, 10000.0)
    w2, b2 = pairs_to_halves(weight, head_dim, rotary_dim), pairs_to_halves(bias, head_dim,
                                                                              rotary_dim)
    ours = (x @ w2.T + b2).reshape(tokens, heads, head_dim)
    ours, _ = rope(positions, ours, ours.clone())
    order = halves_order(head_dim, rotary_dim)
    torch.testing.assert_close(ours, theirs[..., order], rtol=0, atol=1e-5)
    # q . k of the reordered rows equals the checkpoint's: the scores do not change
    scores_theirs = torch.einsum("thd,shd->hts", theirs, theirs)
    scores_ours = torch.einsum("thd,shd->hts", ours, ours)
    torch.testing.assert_close(scores_ours, scores_theirs, rtol=1e-5, atol=1e-4)
