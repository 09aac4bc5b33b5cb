"""The persistent batch keeps rows consistent through add/remove/condense, and the vectorised
step inputs equal a plain per-token computation."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from worker_service.batch.input_batch import CachedRequestState, InputBatch
from worker_service.failures import StepProtocolError
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
    assert inp.input_ids.dtype == inp.positions.dtype == inp.slot_mapping.dtype == np.int64
    assert inp.positions.tolist() == pos
    assert inp.slot_mapping.tolist() == slots
    assert inp.rows.tolist() == [i for i in range(6) if sched[i] > 0]
    assert inp.sample_mask.all()  # every scheduled row reaches its last known token
    assert inp.logits_indices.tolist() == (np.cumsum(sched[sched > 0]) - 1).tolist()


def _decode_ready(batch: InputBatch, states: list[CachedRequestState]) -> None:
    """Every row one token short of its known ones, but row 1 three short (a prefill chunk)."""
    for i, s in enumerate(states):
        row = batch.handle_to_row[s.handle]
        batch.num_computed[row] = s.num_tokens - (3 if i == 1 else 1)


def _decoding_batch(seed: int, num_reqs: int) -> tuple[InputBatch, list[CachedRequestState]]:
    rng = random.Random(seed)
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_blocks_per_req=16)
    states = [_state(h, rng) for h in range(num_reqs)]
    for s in states:
        batch.add(s)
    _decode_ready(batch, states)
    return batch, states


def test_the_one_token_step_equals_the_general_one():
    """prepare_step_inputs(None) (every row one token) gives the arrays the counted path gives;
    a row still in its prefill computes one token and does not sample."""
    batch, _ = _decoding_batch(1, 6)
    fast = prepare_step_inputs(batch, None, BS)
    slow = prepare_step_inputs(batch, np.ones(6, dtype=np.int32), BS)
    for name in ("rows", "num_scheduled", "input_ids", "positions", "slot_mapping",
                 "query_start_loc", "seq_lens", "block_table", "sample_mask", "logits_indices"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert fast.sample_mask.tolist() == [True, False, True, True, True, True]


def test_the_one_token_step_refuses_what_the_general_one_refuses():
    batch, states = _decoding_batch(2, 3)
    batch.num_computed[2] = batch.num_tokens[2]          # nothing left to compute
    with pytest.raises(StepProtocolError, match="handle 2: scheduled past its known tokens"):
        prepare_step_inputs(batch, None, BS)
    _decode_ready(batch, states)
    batch.num_blocks[0] = 0
    with pytest.raises(StepProtocolError, match="handle 0: not enough KV blocks"):
        prepare_step_inputs(batch, None, BS)


def test_no_row_samples_past_max_model_len():
    """A row that holds max_model_len tokens has no room for another: a step that would
    sample one is refused (the token was written past the row's end: IndexError)."""
    batch = InputBatch(max_num_reqs=2, max_model_len=8, max_blocks_per_req=2)
    for handle, prompt in ((0, [1, 2, 3]), (1, [4] * 8)):
        batch.add(CachedRequestState(handle, prompt, WorkerSamplingParams(SamplingParams(),
                                                                          seed=0), [0, 1], 0))
    batch.num_computed[:2] = (2, 7)         # handle 1: its last token, then it would sample
    message = (r"handle 1: has 8 tokens, so it must not sample another: a request holds at "
               r"most max_model_len \(8\)")
    with pytest.raises(StepProtocolError, match=message):
        prepare_step_inputs(batch, None, BS)
    with pytest.raises(StepProtocolError, match=message):
        prepare_step_inputs(batch, np.array([1, 1], dtype=np.int32), BS)
    batch.num_computed[1] = 6               # one before its last: computes, samples nothing
    assert prepare_step_inputs(batch, None, BS).sample_mask.tolist() == [True, False]


def _with(handle: int, **knobs) -> CachedRequestState:
    extra = {k: knobs.pop(k) for k in ("min_tokens", "stop_ids") if k in knobs}
    logprobs = knobs.pop("num_logprobs", 0)
    return CachedRequestState(handle, [1, 2, 3], WorkerSamplingParams(
        SamplingParams(**knobs), seed=handle, **extra), [handle], 0, logprobs)


def test_rows_setting_a_feature_are_counted_through_add_remove_and_condense():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4)
    batch.add(_with(0))
    batch.add(_with(1, temperature=0.7, top_k=5, logit_bias={3: 1.0}))
    batch.add(_with(2, top_p=0.9, allowed_token_ids=[4, 5], min_tokens=2, stop_ids=(7,),
                    num_logprobs=3))
    batch.add(_with(3, top_k=-1, min_tokens=2))       # top_k -1 is off; no stop ids to mask
    on = {name for name, n in batch.num_rows_setting.items() if n}
    assert on == {"temperature", "top_k", "logit_bias", "top_p", "allowed_token_ids",
                  "min_tokens", "num_logprobs"}
    batch.remove(1)
    batch.condense()                                  # row 3 moves into row 1's place
    assert batch.num_rows_setting["temperature"] == batch.num_rows_setting["top_k"] == 0
    assert batch.num_rows_setting["top_p"] == 1
    batch.remove(2)
    assert not any(batch.num_rows_setting.values())


def _recount(batch: InputBatch) -> dict[str, int]:
    """num_rows_setting from the live rows' arrays, as the batch counted before it kept each
    row's features (a column as stored off its neutral value, a list with entries, ...)."""
    from engine_common.request.params import COLUMN_KNOBS
    counts = dict.fromkeys(batch.num_rows_setting, 0)
    for row in batch.handle_to_row.values():
        for k in COLUMN_KNOBS:
            counts[k.name] += bool(getattr(batch, k.name)[row] != k.column_neutral)
        for name, entries in batch.num_entries.items():
            counts[name] += bool(entries[row])
        counts["min_tokens"] += bool(batch.min_tokens[row] and batch.stop_ids[row])
        counts["num_logprobs"] += bool(batch.num_logprobs[row])
    return counts


def test_feature_counts_equal_a_recount_of_the_rows_through_random_changes():
    rng = random.Random(3)
    kinds = [{}, dict(temperature=0.7), dict(top_k=-1), dict(top_k=3, min_p=0.2),
             dict(min_p=1e-50),                       # 0 once stored as float32: not on
             dict(repetition_penalty=1.2, logit_bias={2: -1.0}),
             dict(allowed_token_ids=[1, 2], min_tokens=3, stop_ids=(9,)),
             dict(min_tokens=3), dict(num_logprobs=-1), dict(num_logprobs=2)]
    batch = InputBatch(max_num_reqs=6, max_model_len=16, max_blocks_per_req=4)
    for handle in range(200):
        live = sorted(batch.handle_to_row)
        if live and (len(live) == 6 or rng.random() < 0.4):
            batch.remove(rng.choice(live))
            if rng.random() < 0.5:
                batch.condense()          # moves rows: their counts go with them
        else:
            batch.add(_with(handle, **dict(rng.choice(kinds))))
        assert batch.num_rows_setting == _recount(batch), handle


def test_the_row_cache_keeps_no_params_with_many_ids():
    """Rows of params with hundreds of token ids are filled without the per-params cache (its
    key would keep the ids alive); the usual params are cached, and both fill the same row."""
    from worker_service.batch import input_batch

    input_batch._sampling_row.cache_clear()
    batch = InputBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=4)
    many = _with(0, temperature=0.5, logit_bias={j: 1.0 for j in range(512)},
                 allowed_token_ids=range(512))
    batch.add(many)
    assert input_batch._sampling_row.cache_info().currsize == 0
    assert many.sampling.sampling not in input_batch._ROWS_BY_ID
    assert batch.num_rows_setting["logit_bias"] == batch.num_rows_setting["temperature"] == 1
    batch.add(_with(1, temperature=0.5))
    assert input_batch._sampling_row.cache_info().currsize == 1
    assert batch.temperature[0] == batch.temperature[1] and batch.num_rows_setting[
        "temperature"] == 2


def test_rows_of_shared_params_are_found_by_identity_and_equal_the_hashed_ones():
    """One SamplingParams object shared by many rows (a decoded prefill diff's) is looked up
    by identity after its first row; an equal object of its own fills the same columns, and
    the identity cache stays bounded."""
    from worker_service.batch import input_batch

    input_batch._ROWS_BY_ID.clear()
    shared = WorkerSamplingParams(SamplingParams(temperature=0.3, top_k=7), seed=0)
    batch = InputBatch(max_num_reqs=3, max_model_len=16, max_blocks_per_req=4)
    for handle in range(2):
        batch.add(CachedRequestState(handle, [1, 2], shared, [handle], 0))
    assert shared.sampling in input_batch._ROWS_BY_ID
    own = WorkerSamplingParams(SamplingParams(temperature=0.3, top_k=7), seed=0)
    batch.add(CachedRequestState(2, [1, 2], own, [2], 0))
    assert batch.temperature[:3].tolist() == [batch.temperature[0]] * 3
    assert batch.top_k[:3].tolist() == [7, 7, 7] and batch.num_rows_setting["top_k"] == 3
    for t in range(input_batch.MAX_ROWS_BY_ID + 5):
        input_batch._row_of(SamplingParams(temperature=0.01 * (t + 1)))
    assert len(input_batch._ROWS_BY_ID) <= input_batch.MAX_ROWS_BY_ID
