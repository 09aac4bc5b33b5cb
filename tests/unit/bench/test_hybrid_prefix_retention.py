"""bench/hybrid_prefix_retention.py: the hit rates it prints come from the real scheduler."""
from __future__ import annotations

from bench.hybrid_prefix_retention import SHAPES, documents, hit_rate, system_prompt


def test_documents_asked_twice_hit_on_the_second_round_in_both_layouts():
    shape = SHAPES["gpt-oss W=128 (12/24 windowed)"]
    waves = documents(3, 512)
    assert hit_rate(shape, 600, False, 256, waves) == hit_rate(shape, 600, True, 256, waves)
    assert 0.45 < hit_rate(shape, 600, True, 256, waves) < 0.5    # all but the last block


def test_a_shared_system_prompt_hits_from_the_second_request():
    rate = hit_rate(SHAPES["gemma-3 W=1024 (22/26 windowed)"], 2000, True, 512,
                    system_prompt(1024, 256, 3))
    assert 2 * 1024 / (3 * 1280) - 0.02 < rate < 2 * 1024 / (3 * 1280) + 0.02
