"""freeze_heap keeps the collector off what is alive, and lets go of what it froze before."""
from __future__ import annotations

import gc
import weakref

from engine_common.runtime.gc_heap import YOUNG_THRESHOLD, freeze_heap


class _Node:
    pass


def test_a_frozen_cycle_is_kept_until_the_next_freeze_collects_it():
    node = _Node()
    node.me = node                        # a cycle: only the cyclic collector frees it
    alive = weakref.ref(node)
    try:
        assert freeze_heap() == gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None        # frozen: collections never walk it
        freeze_heap()
        assert alive() is None            # unfrozen and collected before freezing again
    finally:
        gc.unfreeze()


def test_the_young_threshold_is_raised_and_a_larger_one_or_0_kept():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        freeze_heap()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        gc.set_threshold(YOUNG_THRESHOLD * 3, 5, 7)
        freeze_heap()
        assert gc.get_threshold() == (YOUNG_THRESHOLD * 3, 5, 7)
        gc.set_threshold(0)
        freeze_heap()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)
