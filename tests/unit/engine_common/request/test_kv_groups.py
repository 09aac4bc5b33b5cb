"""engine_common/request/kv_groups.py: which models get a hybrid KV cache and how a budget
splits between its groups."""
from __future__ import annotations

import pytest

from engine_common.request.kv_groups import (WindowGroup, hybrid_window, split_kv_blocks,
                                             window_pool_bound)


@pytest.mark.parametrize("windows,expected", [
    ((), (0, "")),                          # no cache layers
    ((0, 0, 0), (0, "")),                   # no window
    ((8, 8, 8), (0, "")),                   # every layer: one pool that frees (sliding_window.py)
    ((8, 0, 8, 0), (8, "")),                # Gemma 2, GPT-OSS
    ((512,) * 5 + (0,), (512, "")),         # Gemma 3
])
def test_hybrid_window(windows, expected):
    assert hybrid_window(windows) == expected


def test_windowed_layers_with_different_windows_keep_one_pool_with_a_reason():
    window, why = hybrid_window((8, 0, 16, 0))
    assert window == 0 and "2 different windows ([8, 16])" in why


def test_the_window_pool_is_the_bound_and_the_full_group_gets_the_rest_of_the_bytes():
    bound = window_pool_bound(8, 4, 2, 16)
    assert bound == 2 * (2 + 3) + 2 * 4
    full, group = split_kv_blocks(40, 4, 2, 8, 4, 2, 16)           # Gemma 2's 1:1
    assert group == WindowGroup(8, bound) and full == (40 * 4 - bound * 2) // 2
    full, group = split_kv_blocks(40, 6, 5, 8, 4, 2, 16)           # Gemma 3's 5:1
    assert full == 40 * 6 - bound * 5 and full * 1 + bound * 5 <= 40 * 6


def test_a_budget_below_the_bound_or_no_mix_keeps_one_pool():
    assert split_kv_blocks(17, 4, 2, 8, 4, 2, 16) == (17, None)
    assert split_kv_blocks(400, 4, 0, 8, 4, 2, 16) == (400, None)
    assert split_kv_blocks(400, 4, 4, 8, 4, 2, 16) == (400, None)
    assert split_kv_blocks(400, 4, 2, 0, 4, 2, 16) == (400, None)


@pytest.mark.parametrize("field,value", [("window", 0), ("num_blocks", -1), ("window", True)])
def test_a_bad_window_group_is_refused_naming_the_field(field, value):
    args = {"window": 8, "num_blocks": 10, field: value}
    with pytest.raises(ValueError, match=rf"WindowGroup.{field}={value!r} is invalid: must be "
                                         r"an int >= 1"):
        WindowGroup(**args)
