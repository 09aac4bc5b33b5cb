"""The serving processes' GIL switch interval: set as asked, refused out of range by name."""
from __future__ import annotations

import sys

import pytest

from engine_common.runtime.gil_switch import (SERVING_SWITCH_INTERVAL_S,
                                              shorten_gil_switch_interval)


@pytest.fixture(autouse=True)
def _restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_serving_interval_is_set():
    shorten_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(SERVING_SWITCH_INTERVAL_S)
    assert SERVING_SWITCH_INTERVAL_S < 0.005      # shorter than Python's default


@pytest.mark.parametrize("seconds", [0.0, -1.0, 0.01])
def test_an_interval_out_of_range_is_refused_by_name(seconds):
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match=r"seconds=.* is invalid: must be in \(0, 0.005\]"):
        shorten_gil_switch_interval(seconds)
    assert sys.getswitchinterval() == before
