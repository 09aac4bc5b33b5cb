"""Workers must agree on the bytes of a KV block (init_messages.shared_kv_block_bytes): a node
that ignored --kv-cache-dtype (an older build drops the unknown Init field) would cache in
another precision than its tensor-parallel peers, so Init is refused naming what each said."""
from __future__ import annotations

import pytest

from scheduler_service.workers.init_messages import shared_kv_block_bytes


def test_agreeing_workers_give_their_block_bytes():
    assert shared_kv_block_bytes([92160, 92160]) == 92160


def test_a_worker_that_disagrees_is_refused_naming_each_value():
    with pytest.raises(ValueError, match=r"\[92160, 184320\].*kv_cache_dtype"):
        shared_kv_block_bytes([92160, 184320])
