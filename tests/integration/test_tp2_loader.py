"""TP=2 against TP=1 on the same weights: two gloo rank processes load their slices and prefill
through a paged cache; every rank's logits equal the single rank's. Its own file in the
integration lane: it spawns processes and takes about 5 s on 2 quiet cores."""
from __future__ import annotations

import pytest

from tests.support.paged_prefill import assert_tp2_matches_tp1
from worker_service.models.tiny_model import make_tiny_model


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    """Two gloo ranks: split kv heads (qwen3, odd padded vocab), replicated kv head with
    o_proj/MLP biases (llama), q/k/v bias (qwen2)."""
    paths = [make_tiny_model(tmp_path / "q3", arch="qwen3", vocab_size=513),
             make_tiny_model(tmp_path / "ll", arch="llama", num_key_value_heads=1,
                             attention_bias=True, mlp_bias=True),
             make_tiny_model(tmp_path / "q2", arch="qwen2")]
    assert_tp2_matches_tp1(paths, tmp_path)
