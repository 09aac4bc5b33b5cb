"""--stream-send-timeout (scheduler_service/api/stream_sends.py): a Generate stream whose client
reads none of its output for the timeout is cut (the request aborted, its KV blocks freed, the
call ending RESOURCE_EXHAUSTED naming the flag once the client reads again, the
`deltaserve:streams_stalled` counter counting it), on both services; a client that reads,
however slowly, never is; another client's stream gets all its tokens meanwhile. Before
(session 45), a stalled stream's output waited until the client read it or the call ended.

Real gRPC on loopback (SimServer: the real scheduler and engine over a simulated worker). The
stalled client keeps a small HTTP/2 window (no BDP probing, 1 KiB of lookahead), so writes
wait after about a kilobyte; time is SimServer's clock, advanced by the test."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2_grpc
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.stream_sends import WINDOW_BYTES
from tests.support.sim_server import SimServer, make_sim_model_dir
from tests.support.vllm_sim import generate, wait_until

TIMEOUT_S = 60.0
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
PROMPT = list(range(40, 53))
LONG = 150            # the stalled request's tokens: it is cut long before its end


@pytest.fixture
def server(tmp_path):
    srv = SimServer(make_sim_model_dir(tmp_path / "model"), num_blocks=128,
                    api=ApiOptions(stream_send_timeout_s=TIMEOUT_S))
    yield srv
    srv.release_steps()
    srv.close()


def _generation(request_id: str, max_tokens: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(request_id=request_id, token_ids=PROMPT, logprobs=5,
                               stopping=gpb.StoppingCriteria(max_tokens=max_tokens,
                                                             ignore_eos=True))


def _open(service: str, channel: grpc.Channel, request_id: str, max_tokens: int):
    """A Generate stream of `service` (not read yet)."""
    if service == "generation":
        return generation_pb2_grpc.GenerationStub(channel).Generate(
            _generation(request_id, max_tokens), timeout=60)
    return vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
        generate(PROMPT, stream=True, request_id=request_id, max_tokens=max_tokens,
                 ignore_eos=True, logprobs=5), timeout=60)


def _tokens(service: str, msg) -> int:
    return len(msg.token_ids if service == "generation" else msg.chunk.token_ids)


def _wait_received(server: SimServer, n: int) -> None:
    wait_until(lambda: server.engine.counters.snapshot().received == n,
               f"{n} requests to reach the server")


def _advance_until_cut(server: SimServer) -> None:
    """Advance the clock past the timeout once each new write has begun, until a stream is
    cut: the stalled stream's last write begins after its earlier ones are through."""
    sends, seen = server.sends, [-1]

    def cut() -> bool:
        if sends.num_stalled:
            return True
        if sends.num_waiting and sends.num_started != seen[0]:
            seen[0] = sends.num_started
            server.clock.advance(TIMEOUT_S + 1)
        return False

    wait_until(cut, "the stalled stream to be cut", timeout=30)


@pytest.mark.parametrize("service", ["generation", "vllm"])
def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(server, service):
    server.hold_steps(after=0)
    with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as stalled_channel, \
            grpc.insecure_channel(server.target) as channel:
        stalled = _open(service, stalled_channel, "stalled", LONG)     # never read, for now
        _wait_received(server, 1)
        other = _open(service, channel, "other", 30)
        _wait_received(server, 2)
        server.hold_steps(after=40)             # both run from here on
        # another client's stream runs to its end beside the stalled one: no token held back
        assert sum(_tokens(service, m) for m in other) == 30
        assert server.gate.wait_held()          # 40 steps: the stalled request is running
        assert server.used_blocks() > 0 and server.sends.num_stalled == 0
        _advance_until_cut(server)
        server.release_steps()                  # the engine takes the abort between steps
        wait_until(lambda: server.used_blocks() == 0 and server.engine.stats.num_running == 0,
                   "the cut request's blocks to be freed")
        got = 0
        with pytest.raises(grpc.RpcError) as ended:
            for msg in stalled:                 # what grpc held for it, then the status
                got += _tokens(service, msg)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "stream_send_timeout=60 s is exceeded" in ended.value.details()
    assert "(--stream-send-timeout)" in ended.value.details()
    assert got < LONG
    counts = server.engine.counters.snapshot()
    # each request counted once: the cut one as aborted (before: as aborted and as an error)
    assert counts.stalled == 1
    assert counts.finished == {("length", ""): 1, ("abort", ""): 1}
    # the engine never produced the cut request's remaining tokens
    assert counts.generation_tokens < 30 + LONG



def test_a_stalled_stream_of_two_choices_aborts_both(server):
    """n = 2 on VllmEngine: the choices' engine streams are merged; the cut aborts both, frees
    all their blocks, and counts each choice once, as aborted (before: also as an error)."""
    server.hold_steps(after=0)
    with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as channel:
        stalled = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            generate(PROMPT, stream=True, request_id="two", max_tokens=LONG, ignore_eos=True,
                     logprobs=5, n=2), timeout=60)
        wait_until(lambda: server.engine.counters.snapshot().received == 2, "both choices")
        server.hold_steps(after=40)
        assert server.gate.wait_held()
        assert server.engine.stats.num_running == 2
        _advance_until_cut(server)
        server.release_steps()
        wait_until(lambda: server.used_blocks() == 0 and server.engine.stats.num_running == 0,
                   "both choices' blocks to be freed")
        with pytest.raises(grpc.RpcError) as ended:
            list(stalled)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    counts = server.engine.counters.snapshot()
    assert counts.stalled == 1 and counts.finished == {("abort", ""): 2}

def test_a_client_that_reads_slowly_is_never_cut(server):
    """The client reads nothing while 12 steps' output piles up, then reads it all, 10 times
    over; the clock moves 0.75 timeouts each time one of its writes goes through: far more
    than the timeout in all, and far more output waiting than its window, yet no write waits
    a whole timeout, so the stream runs to its end."""
    server.hold_steps(after=0)
    advanced, sent = 0.0, [server.sends.num_sent]
    with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as channel:
        stream = _open("generation", channel, "slow", 120)
        got = 0
        for phase in range(10):
            server.gate.hold_after(12)
            assert server.gate.wait_held()
            while got < 12 * (phase + 1):
                msg = next(stream)
                got += len(msg.token_ids)
                if server.sends.num_sent != sent[0]:
                    sent[0] = server.sends.num_sent
                    server.clock.advance(0.75 * TIMEOUT_S)
                    advanced += 0.75 * TIMEOUT_S
        server.release_steps()
        rest = list(stream)
    assert got + sum(len(m.token_ids) for m in rest) == 120
    assert (rest or [msg])[-1].finish_reason == gpb.LENGTH
    assert advanced > 3 * TIMEOUT_S
    assert server.sends.num_stalled == 0 and server.engine.counters.snapshot().stalled == 0


def test_zero_turns_the_limit_off(tmp_path):
    srv = SimServer(make_sim_model_dir(tmp_path / "model"),
                    api=ApiOptions(stream_send_timeout_s=0))
    try:
        srv.hold_steps(after=30)
        with grpc.insecure_channel(srv.target, options=SMALL_WINDOW) as channel:
            stream = _open("generation", channel, "stalled", 60)
            assert srv.gate.wait_held()
            srv.clock.advance(10 * TIMEOUT_S)
            srv.release_steps()
            assert sum(len(m.token_ids) for m in stream) == 60
        assert srv.sends.num_stalled == 0
    finally:
        srv.release_steps()
        srv.close()


def test_the_flag_refuses_a_negative_timeout():
    with pytest.raises(ValueError, match=r"stream_send_timeout_s=-1 is invalid: must be a "
                                         r"number >= 0"):
        ApiOptions(stream_send_timeout_s=-1)



LONG_ANSWER = 2000      # tokens: with 20 logprobs each, a message of over 3 windows


@pytest.fixture
def long_server(tmp_path):
    srv = SimServer(make_sim_model_dir(tmp_path / "model", max_position=2048), num_blocks=1024,
                    max_model_len=2048, api=ApiOptions(stream_send_timeout_s=TIMEOUT_S))
    yield srv
    srv.release_steps()
    srv.close()


def _big_answer(channel: grpc.Channel):
    """A non-streamed VllmEngine answer (one message) with 20 logprobs a token, not read yet:
    its write waits until the whole message has passed the client's window."""
    return vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
        generate(PROMPT, stream=False, request_id="big", max_tokens=LONG_ANSWER,
                 ignore_eos=True, logprobs=20), timeout=60)


def _advance_and_check(server: SimServer, seconds: float) -> None:
    """Advance the clock while the answer's write waits, and wait for a check after it."""
    wait_until(lambda: server.sends.num_waiting == 1, "the answer's write to wait")
    checks = server.sends.num_checks
    server.clock.advance(seconds)
    wait_until(lambda: server.sends.num_checks > checks, "a check after the advance")


def test_a_slow_reader_of_one_large_message_gets_time_in_proportion_to_its_size(long_server):
    """A non-streamed answer is one message: on a slow link it passes a window at a time, so a
    client that keeps taking it may take longer for the whole than the timeout. Before, a write
    of any size was cut after the timeout: a legitimate slow client of a long answer lost it."""
    with grpc.insecure_channel(long_server.target, options=SMALL_WINDOW) as channel:
        answer = _big_answer(channel)
        _advance_and_check(long_server, 2 * TIMEOUT_S + 1)
        assert long_server.sends.num_stalled == 0
        msgs = list(answer)
    assert msgs[0].complete.ByteSize() > 3 * WINDOW_BYTES     # 4 timeouts allowed
    assert [len(m.complete.output_ids) for m in msgs] == [LONG_ANSWER]
    assert long_server.engine.counters.snapshot().stalled == 0


def test_a_large_message_nobody_reads_is_cut_after_its_allowance(long_server):
    with grpc.insecure_channel(long_server.target, options=SMALL_WINDOW) as channel:
        answer = _big_answer(channel)
        _advance_and_check(long_server, 4 * TIMEOUT_S + 1)
        wait_until(lambda: long_server.sends.num_stalled == 1, "the answer's write to be cut")
        with pytest.raises(grpc.RpcError) as ended:
            list(answer)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("one message of this stream waited 240 s for the client (the timeout per 64 KiB "
            "of it)") in ended.value.details()
    counts = long_server.engine.counters.snapshot()
    # the request had finished before the cut: counted once, as it finished (before: also
    # as an error)
    assert counts.stalled == 1 and counts.finished == {("length", ""): 1}
    assert long_server.used_blocks() == 0
