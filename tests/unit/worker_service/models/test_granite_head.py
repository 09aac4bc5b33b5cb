"""Granite's LM head (models/granite.py ScaledLMHead) on the CPU kernels, with a vocabulary large
enough for the fused greedy head (kernels/cpu/linear.py TILED_FROM_N): logits_scaling divides
the logits, and a scale other than 1 turns the fused greedy off, whose logprobs would be those
of the unscaled logits."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension
from kernels.cpu.linear import TILED_FROM_N
from worker_service.models.granite import ScaledLMHead
from worker_service.parallel_state import single_rank_group


@pytest.fixture
def head():
    if not extension.load():
        pytest.skip(extension.status())
    torch.manual_seed(0)
    head = ScaledLMHead(TILED_FROM_N, 64, single_rank_group(), torch.float32)
    head.weight.data.normal_()
    assert head.use_cpu_kernels()
    return head


def test_the_logits_are_divided_by_logits_scaling(head):
    hidden = torch.randn(3, 64)
    plain = hidden @ head.weight.T
    head.logits_scaling = 2.5
    torch.testing.assert_close(head(hidden), plain / 2.5, rtol=1e-5, atol=1e-4)


def test_a_scale_other_than_one_turns_the_fused_greedy_off(head):
    hidden = torch.randn(3, 64)
    ids, logprobs = head.greedy(hidden)          # scale 1: the fused head answers
    torch.testing.assert_close(logprobs, torch.log_softmax(head(hidden), -1).gather(
        1, ids[:, None])[:, 0], rtol=0, atol=1e-4)
    head.logits_scaling = 2.5
    assert head.greedy(hidden) is None and head.greedy(hidden, logprobs=False) is None
