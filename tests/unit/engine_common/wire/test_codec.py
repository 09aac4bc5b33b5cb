"""engine_common.wire.codec: every diff and reply survives the round trip; malformed bytes raise
CodecError (never another exception, never a silently wrong object)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_common.wire.codec import (CodecError, decode_runner_output, decode_scheduler_output,
                                 encode_runner_output, encode_scheduler_output)
from engine_common.constraints.constraint import Constraint
from engine_common.wire.diff import (NewRequestData, PromptLogprobs, ResumedRequestData,
                                     RunnerOutput, SchedulerOutput)
from engine_common.wire.new_blocks import pack_new_blocks, unpack_new_blocks
from engine_common.request.params import SamplingParams, WorkerSamplingParams

u32 = st.integers(0, 2**32 - 1)
handle = st.integers(0, 4096)
block_ids = st.lists(st.integers(0, 2**20), max_size=6)
# What the pool mostly hands out: runs of consecutive ids, sometimes several per handle.
block_runs = st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 5)), max_size=3).map(
    lambda runs: [b for start, n in runs for b in range(start, start + n)])
grown_blocks = st.dictionaries(st.integers(0, 2**40), block_ids | block_runs, max_size=20)
f32 = st.floats(width=32, allow_nan=False)

sampling = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]), top_p=st.sampled_from([1.0, 0.9]),
    top_k=st.integers(-1, 50), min_p=st.sampled_from([0.0, 0.05]),
    repetition_penalty=st.sampled_from([1.0, 1.1]), presence_penalty=st.sampled_from([0.0, -0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    seed=st.none() | st.integers(0, 2**63 - 1))
worker_sampling = st.builds(WorkerSamplingParams, sampling, st.integers(0, 2**63 - 1),
                            st.integers(0, 100), st.lists(u32, max_size=3).map(tuple))
text = st.text(min_size=1, max_size=30)
constraint = st.none() | st.one_of(
    st.builds(Constraint, st.sampled_from(["json_schema", "regex", "grammar"]), text),
    st.just(Constraint("json_object", True)),
    st.builds(Constraint, st.just("choice"), st.lists(text, min_size=1, max_size=4)))
# prompt logprobs (-1: none), pooling (-1: none; else a type 0..2, plus 4 to normalise) and
# the LoRA adapter's id (0: none)
new_request = st.builds(NewRequestData, handle, st.lists(u32, min_size=1, max_size=20),
                        worker_sampling, block_ids, st.integers(0, 4096), st.integers(0, 20),
                        constraint, st.integers(-1, 5),
                        st.sampled_from([-1, 0, 1, 2, 4, 5, 6]), st.integers(0, 3))
resumed_request = st.builds(ResumedRequestData, handle, block_ids, st.integers(0, 4096))
scheduler_output = st.builds(
    SchedulerOutput, st.integers(0, 2**40), st.lists(new_request, max_size=3),
    st.lists(resumed_request, max_size=3), st.dictionaries(handle, block_ids | block_runs,
                                                            max_size=4),
    st.dictionaries(handle, st.integers(0, 8192), max_size=4), st.lists(handle, max_size=4),
    st.lists(handle, max_size=4))


@st.composite
def runner_output(draw):
    handles = draw(st.lists(u32, max_size=6))
    n = len(handles)
    ids = draw(st.lists(u32, min_size=n, max_size=n))
    lps = draw(st.lists(f32, min_size=n, max_size=n))
    top = {}        # k alternatives per token of the handle (speculative runs: several)
    for h in draw(st.sets(st.sampled_from(handles), max_size=3)) if handles else ():
        size = draw(st.integers(0, 4)) * handles.count(h)
        top[h] = (draw(st.lists(u32, min_size=size, max_size=size)),
                  draw(st.lists(f32, min_size=size, max_size=size)))
    prompt = draw(st.dictionaries(u32, st.tuples(st.integers(0, 5), st.integers(0, 3)).flatmap(
        lambda nk: st.tuples(*(st.lists(e, min_size=size, max_size=size) for e, size in (
            (f32, nk[0]), (u32, nk[0]), (u32, nk[0] * nk[1]), (f32, nk[0] * nk[1]))))),
        max_size=2))
    pooled = draw(st.dictionaries(u32, st.lists(f32, min_size=1, max_size=8), max_size=2))
    return RunnerOutput(draw(st.integers(0, 2**40)), handles, ids, lps, top,
                        prompt_logprobs={h: PromptLogprobs(*p) for h, p in prompt.items()},
                        pooled=pooled)


@settings(max_examples=150, deadline=None)
@given(scheduler_output)
def test_scheduler_output_round_trip(out):
    assert decode_scheduler_output(encode_scheduler_output(out)) == out


@settings(max_examples=150, deadline=None)
@given(runner_output())
def test_runner_output_round_trip(out):
    assert decode_runner_output(encode_runner_output(out)) == out


@pytest.mark.parametrize("pooling", [3, 7, 11, 19, 99])
def test_a_pooling_code_no_config_makes_raises(pooling):
    new = [1, np.arange(3, dtype=np.uint32).tobytes(), [b"", 0, 0, []], [], 0, 0, None, -1,
           pooling]
    with pytest.raises(CodecError, match="pooling code"):
        decode_scheduler_output(msgpack.packb([1, [new], [], None, {}, [], []]))


def test_steady_state_diff_is_tiny():
    assert len(encode_scheduler_output(SchedulerOutput(step=123456))) < 16


@settings(max_examples=300, deadline=None)
@given(grown_blocks)
def test_new_blocks_round_trip(new_block_ids):
    assert unpack_new_blocks(pack_new_blocks(new_block_ids)) == new_block_ids


@settings(max_examples=200, deadline=None)
@given(grown_blocks.filter(bool), st.data())
def test_truncated_or_extended_new_blocks_raise(new_block_ids, data):
    packed = pack_new_blocks(new_block_ids)
    cut = data.draw(st.integers(0, len(packed) - 1))
    for bad in (packed[:cut], packed + data.draw(st.binary(min_size=1, max_size=4))):
        with pytest.raises(CodecError):
            decode_scheduler_output(msgpack.packb([1, [], [], bad, {}, [], []]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=48))
def test_garbage_new_blocks_raise_codec_error_or_round_trip(data):
    try:
        out = decode_scheduler_output(msgpack.packb([1, [], [], data, {}, [], []]))
    except CodecError:
        return
    assert decode_scheduler_output(encode_scheduler_output(out)) == out


def test_new_blocks_layout():
    """The example in engine_common/wire/new_blocks.py: 3 handles, one run of 3 blocks."""
    packed = pack_new_blocks({9: [702], 3: [700], 4: [701]})
    # zigzag(700) << 1 | 1 = 2801 = 0xF1 0x15 as a varint; then length 3 - 2 = 1.
    assert packed == bytes([3, 3 << 1, 0, 4 << 1, 0xF1, 0x15, 1])
    # Counts other than 1 follow their gap: handle 0 takes 2 blocks, handle 2 none.
    assert pack_new_blocks({0: [5, 6], 2: []}) == bytes([2, 1, 2, 3, 0, 10 << 1 | 1, 0])


def test_growth_of_16_requests_is_a_few_bytes():
    """About num_requests / 16 requests of a decoding batch take a block each step; the pool
    hands them consecutive ids."""
    grown = {h: [4000 + i] for i, h in enumerate(range(5, 256, 16))}
    steady = len(encode_scheduler_output(SchedulerOutput(step=1000)))
    size = len(encode_scheduler_output(SchedulerOutput(step=1000, new_block_ids=grown)))
    # The steady-state diff with a bin8 header (2 bytes) in place of nil (1), the handle count,
    # a byte per handle, and one run: zigzag(4000) << 1 | 1 in 2 bytes and its length in 1.
    assert size == steady - 1 + 2 + 1 + len(grown) + 3 == 31


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_codec_error(data):
    """Garbage either raises CodecError (nothing else) or is a well-formed message: one that
    survives its own round trip unchanged."""
    for decode, encode in ((decode_scheduler_output, encode_scheduler_output),
                           (decode_runner_output, encode_runner_output)):
        try:
            message = decode(data)
        except CodecError:
            continue
        assert decode(encode(message)) == message


@settings(max_examples=100, deadline=None)
@given(scheduler_output, st.data())
def test_truncated_scheduler_output_raises(out, data):
    payload = encode_scheduler_output(out)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(CodecError):
        decode_scheduler_output(payload[:cut])


_GOOD_SCHED = [1, [], [], None, {}, [], []]
_GOOD_NEW = [0, b"\x01\x00\x00\x00", [b"", 7, 0, []], [0], 0, 0, None]


@pytest.mark.parametrize("fields", [
    [1, [], [], {}, {}, []],                               # 6 fields, not 7
    ["1", [], [], {}, {}, [], []],                         # step not an int
    [1, [], [], 5, {}, [], []],                            # new_block_ids not a map
    [1, [], [], {0: [1, 2]}, {}, [], []],                  # new blocks as a map, not bytes
    [1, [], [], [0, 1], {}, [], []],                       # new blocks as a list
    [1, [], [], b"", {}, [], []],                          # empty bytes: no handle count
    [1, [], [], b"\x01\x00", {}, [], []],                  # 1 handle, no block run
    [1, [], [], b"\x01\x00\x03", {}, [], []],              # a run starting at -2
    [1, [], [], b"\x01\x00\x01\x05", {}, [], []],          # run of 7 blocks for 1 slot
    [1, [], [], b"\x01\x01\xff\xff\xff\x7f", {}, [], []],  # more blocks than allowed
    [1, [], [], b"\x01\x00" + b"\x80" * 10 + b"\x00", {}, [], []],  # 11-byte varint
    [1, [], [], {}, {0: -1}, [], []],                      # negative token count
    [1, [], [], {}, {"a": 1}, [], []],                     # handle not an int
    [1, [], [], {}, {}, [None], []],                       # finished handle not an int
    [1, [], [], {}, {}, [], 3],                            # preempted not a list
    [1, [[0, b"\x01\x00\x00", [b"", 7, 0, []], [0], 0, 0, None]], [], {}, {}, [], []],  # 3-byte ids
    [1, [[0, [-1], [b"", 7, 0, []], [0], 0, 0, None]], [], {}, {}, [], []],  # ids as negative list
    [1, [[0, b"", [b"\x11" + b"\x00" * 6 + b"\x14@", 7, 0, []], [0], 0, 0, None]], [], {}, {},
     [], []],                                              # bad param (top_p 5.0)
    [1, [[0, b"", [b"\xf8\x06\x01", 7, 0, []], [0], 0, 0, None]], [], {}, {}, [], []],  # unknown
    [1, [[0, b"", [{"top_p": 0.5}, 7, 0, []], [0], 0, 0, None]], [], {}, {}, [], []],  # a map
    [1, [[0, b"", [b"", -7, 0, []], [0], 0, 0, None]], [], {}, {}, [], []],  # negative seed
    [1, [_GOOD_NEW[:6]], [], {}, {}, [], []],              # new request missing a field
    [1, [_GOOD_NEW[:6] + [["regex"]]], [], {}, {}, [], []],         # constraint not a pair
    [1, [_GOOD_NEW[:6] + [["sql", "x"]]], [], {}, {}, [], []],      # unknown constraint kind
    [1, [_GOOD_NEW[:6] + [["choice", []]]], [], {}, {}, [], []],    # no choices
    [1, [_GOOD_NEW[:6] + [["json_object", 1]]], [], {}, {}, [], []],  # json_object not true
    [1, [], [[0, [1], "x"]], {}, {}, [], []],              # resumed num_computed not an int
    [1, [_GOOD_NEW[:3] + [[0, True]] + _GOOD_NEW[4:]], [], None, {}, [], []],  # a bool block id
    [1, [_GOOD_NEW[:3] + [[4, 1.0]] + _GOOD_NEW[4:]], [], None, {}, [], []],   # a float one
    [1, [], [], None, {}, [3, -1], []],                    # a negative finished handle
])
def test_wrong_layout_raises(fields):
    with pytest.raises(CodecError):
        decode_scheduler_output(msgpack.packb(fields, use_bin_type=True))


def test_good_layout_decodes():
    out = decode_scheduler_output(msgpack.packb([1, [_GOOD_NEW], [], b"\x01\x00\x1c", {},
                                                 [], []], use_bin_type=True))
    assert out.new_requests[0].prompt_token_ids == [1]
    assert out.new_block_ids == {0: [7]}
    assert decode_scheduler_output(msgpack.packb(_GOOD_SCHED)) == SchedulerOutput(step=1)


@pytest.mark.parametrize("fields", [
    [1, b"", b"", b""],                                    # 4 fields, not 5
    [1, b"", b"", b"", {}, b"", b""],                      # request errors not a map
    [1, b"", b"", b"", {}, b"", {0: 5}],                   # an error message not a string
    [1, b"", b"", b"", {}, b"", {0: "x" * 1001}],          # an error message too long
    [1, b"", b"", b"", {}, b"", {}, {}, {}, {}],           # 10 fields, not 5 to 9
    [1, b"", b"", b"", {}, b"", {}, {}, {0: 5}],           # a pooled vector not bytes
    [1, b"", b"", b"", {}, b"", {}, {}, {0: b""}],         # an empty pooled vector
    [1, b"", b"", b"", {}, b"", {}, {}, {0: b"\x00" * 6}],  # not whole float32s
    [1, b"", b"", b"", {}, b"", {}, {0: [b"", b""]}],      # prompt entry not 4 arrays
    [1, b"", b"", b"", {}, b"", {}, {0: [b"\x00" * 4, b"", b"", b""]}],  # 1 logprob, 0 ranks
    [1, b"", b"", b"", {}, b"", {}, {0: [b"\x00" * 8, b"\x00" * 8, b"\x00" * 12,
                                         b"\x00" * 12]}],  # 3 top entries for 2 positions
    [1, b"", b"", b"", {}, b"\x00"],                       # 1-byte compiled handles
    [1, b"\x00\x00\x00\x00", b"", b"", {}],                # 1 handle, 0 sampled ids
    [1, b"\x00\x00", b"", b"", {}],                        # 2-byte handle array
    [1, b"", b"", b"", {0: [b"\x00\x00\x00\x00", b""]}],     # top ids / logprobs differ
    [1, b"", b"", b"", {0: 5}],                            # top entry not a pair
    [1.5, b"", b"", b"", {}],                              # step not an int
])
def test_wrong_runner_layout_raises(fields):
    with pytest.raises(CodecError):
        decode_runner_output(msgpack.packb(fields, use_bin_type=True))


def test_a_garbage_field_is_quoted_clipped():
    """Issue 23: a 70 KB string where the step number goes came back quoted whole."""
    payload = msgpack.packb(["x" * 70_000, [], [], None, {}, [], []], use_bin_type=True)
    with pytest.raises(CodecError) as e:
        decode_scheduler_output(payload)
    assert len(str(e.value)) < 400 and "(70002 characters)" in str(e.value)


def test_compiled_handles_travel_only_when_there_are_any():
    """Issue 23 item 4: the handles whose grammar compiled, a trailing field absent when empty
    (a steady step's reply is unchanged)."""
    plain = RunnerOutput(3, [1], [7], [-0.5])
    assert len(msgpack.unpackb(encode_runner_output(plain))) == 5
    assert decode_runner_output(encode_runner_output(plain)) == plain
    with_compiled = RunnerOutput(3, [1], [7], [-0.5], compiled_handles=[4, 9])
    encoded = encode_runner_output(with_compiled)
    assert decode_runner_output(encoded) == with_compiled
    assert len(encoded) == len(encode_runner_output(plain)) + 10   # bin header + two uint32


def test_request_errors_travel_after_the_compiled_handles_only_when_there_are_any():
    """A request that failed on the output rank (its grammar): handle -> message, a trailing
    field; the compiled handles before it are sent (empty) too. Long messages are cut."""
    failed = RunnerOutput(3, [1, 2], [7, 8], [-0.5, -0.25], request_errors={2: "grammar broke"})
    fields = msgpack.unpackb(encode_runner_output(failed), strict_map_key=False)
    assert len(fields) == 7 and fields[5] == b"" and fields[6] == {2: "grammar broke"}
    assert decode_runner_output(encode_runner_output(failed)) == failed
    both = RunnerOutput(3, compiled_handles=[4], request_errors={9: "e" * 5000})
    back = decode_runner_output(encode_runner_output(both))
    assert back.compiled_handles == [4] and back.request_errors == {9: "e" * 1000}
    assert len(msgpack.unpackb(encode_runner_output(RunnerOutput(3, compiled_handles=[4])))) == 6


@settings(max_examples=100, deadline=None)
@given(runner_output())
def test_runner_output_from_numpy_arrays_encodes_like_lists(out):
    """The model runner hands over its sampled ids, logprobs, top alternatives and pooled vectors
    as numpy arrays (int64 / float32, as it makes them): the wire bytes are those of the lists."""
    as_arrays = RunnerOutput(
        out.step, np.asarray(out.handles, np.int64), np.asarray(out.sampled_token_ids, np.int64),
        np.asarray(out.logprobs, np.float32),
        {h: (np.asarray(ids, np.int64), np.asarray(lps, np.float32))
         for h, (ids, lps) in out.top_logprobs.items()},
        out.compiled_handles, prompt_logprobs={h: PromptLogprobs(
            np.asarray(p.logprobs, np.float32), np.asarray(p.ranks, np.int64),
            np.asarray(p.top_ids, np.int64), np.asarray(p.top_logprobs, np.float32))
            for h, p in out.prompt_logprobs.items()},
        pooled={h: np.asarray(v, np.float32) for h, v in out.pooled.items()})
    assert encode_runner_output(as_arrays) == encode_runner_output(out)
    assert decode_runner_output(encode_runner_output(as_arrays)) == out


def test_a_decoded_prompt_is_a_read_only_uint32_array_equal_to_its_ids():
    sampling = WorkerSamplingParams(SamplingParams(), seed=0)
    sent = NewRequestData(3, [0, 5, 2**32 - 1], sampling, [1], 0)
    got = decode_scheduler_output(encode_scheduler_output(
        SchedulerOutput(step=1, new_requests=[sent]))).new_requests[0]
    ids = got.prompt_token_ids
    assert isinstance(ids, np.ndarray) and ids.dtype == np.uint32 and not ids.flags.writeable
    assert ids.tolist() == [0, 5, 2**32 - 1]
    assert got == sent and sent == got
    assert got != NewRequestData(3, [0, 5, 2**32 - 2], sampling, [1], 0)
    assert got != NewRequestData(3, [0, 5], sampling, [1], 0)


def test_a_bad_block_id_is_named_among_good_ones():
    fields = [1, [_GOOD_NEW[:3] + [[5, 6, -2, 7]] + _GOOD_NEW[4:]], [], None, {}, [], []]
    with pytest.raises(CodecError, match=r"block_ids=-2: expected an integer >= 0"):
        decode_scheduler_output(msgpack.packb(fields, use_bin_type=True))
    fields[1][0][3] = [5, 6, 2, 7]
    assert decode_scheduler_output(msgpack.packb(fields)).new_requests[0].block_ids == \
        [5, 6, 2, 7]


def test_the_sampling_cache_keeps_no_large_message():
    """A hostile client's requests, each with its own 1024 logit_bias entries and 1024 allowed
    ids, must not be pinned by the per-message cache (~140 KB each, 1024 of them per rank);
    small messages (every scalar knob) are still parsed once."""
    from engine_common.wire import sampling_wire

    def step(sp: SamplingParams) -> NewRequestData:
        new = NewRequestData(0, [1], WorkerSamplingParams(sp, seed=0), [0], 0)
        payload = encode_scheduler_output(SchedulerOutput(step=1, new_requests=[new]))
        return decode_scheduler_output(payload).new_requests[0]

    sampling_wire._cached_sampling_from_wire.cache_clear()
    for i in range(3):
        big = SamplingParams(logit_bias={j: float(i) for j in range(1024)},
                             allowed_token_ids=range(i, i + 1024))
        assert step(big).sampling.sampling == big
    assert sampling_wire._cached_sampling_from_wire.cache_info().currsize == 0
    small = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05,
                           repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
    first, second = step(small), step(small)
    assert first.sampling.sampling is second.sampling.sampling == small


def test_the_usual_new_request_path_equals_the_checked_one_and_defers_anything_else():
    """A well-formed new request without a constraint decodes on the inline path to what the
    checked path gives; a constrained or malformed one is left (None) to the checked path,
    which decodes or refuses it naming the field."""
    from engine_common.wire.codec import _checked_new_request, _usual_new_request
    from engine_common.wire.diff import NO_LOGPROBS

    sampling = WorkerSamplingParams(SamplingParams(top_k=4), seed=7, min_tokens=2,
                                    stop_ids=(3, 9))
    out = SchedulerOutput(step=1, new_requests=[
        NewRequestData(3, [0, 5, 2**32 - 1], sampling, [1, 8], 2, NO_LOGPROBS),
        NewRequestData(4, [1], sampling, [2], 0, 0, Constraint("regex", "a+"))])
    plain, constrained = msgpack.unpackb(encode_scheduler_output(out), raw=False,
                                         strict_map_key=False)[1]
    fast = _usual_new_request(plain)
    assert fast == _checked_new_request(plain) == out.new_requests[0]
    assert fast.prompt_token_ids.dtype == np.uint32 and not fast.prompt_token_ids.flags.writeable
    assert _usual_new_request(constrained) is None
    assert _checked_new_request(constrained) == out.new_requests[1]
    for i, bad in ((0, -1), (0, True), (1, b"abc"), (3, [1, -2]), (4, -1), (5, -2)):
        broken = list(plain)
        broken[i] = bad
        assert _usual_new_request(broken) is None, (i, bad)
        with pytest.raises(CodecError):
            decode_scheduler_output(msgpack.packb(
                [1, [broken], [], None, {}, [], []], use_bin_type=True))
    assert _usual_new_request([*plain[:2], [plain[2][0], -1, 2, []], *plain[3:]]) is None


def test_top_alternatives_must_be_k_per_token_of_their_handle():
    """A handle that produced 2 tokens (an accepted draft and one more) carries 2 * k
    alternatives; a count that is no multiple, or alternatives of a handle with no token, are
    refused naming the handle."""
    run = RunnerOutput(3, [5, 5, 6], [7, 8, 9], [-0.5, -0.125, -0.25],
                       {5: ([1, 2, 3, 4], [-0.125, -0.25, -0.375, -0.75]),
                        6: ([1, 2], [-0.125, -0.25])})
    assert decode_runner_output(encode_runner_output(run)) == run
    for top in ({5: ([1, 2, 3], [-0.125, -0.25, -0.375])}, {8: ([1], [-0.125])}):
        bad = RunnerOutput(3, [5, 5, 6], [7, 8, 9], [-0.5, -0.125, -0.25], top)
        with pytest.raises(CodecError, match=r"top_logprobs\[\d\]: \d alternatives is invalid"):
            decode_runner_output(encode_runner_output(bad))
