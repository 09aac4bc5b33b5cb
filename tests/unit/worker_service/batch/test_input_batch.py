"""The persistent batch keeps rows consistent through add/remove/condense, and the vectorised
step inputs equal a plain per-token computation."""
from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from worker_service.batch.input_batch import CachedRequestState, InputBatch
from worker_service.step.step_inputs import prepare_step_inputs

BS = 4


def _state(handle: int, rng: random.Random) -> CachedRequestState:
    n_prompt = rng.randint(1, 20)
    n_out = rng.randint(0, 5)
    n = n_prompt + n_out
    blocks = rng.sample(range(1000), -(-n // BS))
    st_ = CachedRequestState(handle, [rng.randrange(500) for _ in range(n_prompt)],
                             WorkerSamplingParams(SamplingParams(temperature=handle / 10),
                                                  seed=handle),
                             blocks, rng.randint(0, n - 1))
    st_.output_token_ids = [rng.randrange(500) for _ in range(n_out)]
    return st_


def _check_rows(batch: InputBatch, live: dict[int, CachedRequestState]) -> None:
    assert set(batch.handle_to_row) == set(live)
    for handle, state in live.items():
        row = batch.handle_to_row[handle]
        assert batch.handles[row] == handle
        n = state.num_tokens
        assert batch.num_tokens[row] == n
        assert batch.token_ids[row, :n].tolist() == state.prompt_token_ids + state.output_token_ids
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == state.block_ids
        assert batch.seeds[row] == handle
        assert np.isclose(batch.temperature[row], handle / 10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), min_size=1, max_size=60),
       st.integers(0, 2**16))
def test_add_remove_condense_keeps_rows_consistent(ops, seed):
    rng = random.Random(seed)
    batch = InputBatch(max_num_reqs=32, max_model_len=64, max_blocks_per_req=16)
    live: dict[int, CachedRequestState] = {}
    for add, handle in ops:
        if add and handle not in live and len(live) < 32:
            live[handle] = _state(handle, rng)
            batch.add(live[handle])
        elif not add and live:
            victim = rng.choice(sorted(live))
            batch.remove(victim)
            del live[victim]
        if rng.random() < 0.5:
            batch.condense()
            assert batch.num_reqs == len(live)
            assert all(h is not None for h in batch.handles[:batch.num_reqs])
        _check_rows(batch, live)


def test_step_inputs_match_a_per_token_loop():
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_blocks_per_req=16)
    states = [_state(h, rng) for h in range(6)]
    for s in states:
        batch.add(s)
    sched = np.array([s.num_tokens - s.num_computed_tokens if i % 3 else 0
                      for i, s in enumerate(states)], dtype=np.int32)
    inp = prepare_step_inputs(batch, sched, BS)
    ids, pos, slots = [], [], []
    for i, s in enumerate(states):
        toks = s.prompt_token_ids + s.output_token_ids
        for p in range(s.num_computed_tokens, s.num_computed_tokens + int(sched[i])):
            ids.append(toks[p])
            pos.append(p)
            slots.append(s.block_ids[p // BS] * BS + p % BS)
    assert inp.input_ids.tolist() == ids
    assert inp.positions.tolist() == pos
    assert inp.slot_mapping.tolist() == slots
    assert inp.rows.tolist() == [i for i in range(6) if sched[i] > 0]
    assert inp.sample_mask.all()  # every scheduled row reaches its last known token
    assert inp.logits_indices.tolist() == (np.cumsum(sched[sched > 0]) - 1).tolist()
