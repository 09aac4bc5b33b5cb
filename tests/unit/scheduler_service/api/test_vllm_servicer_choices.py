"""VllmEngine Generate with n > 1, not streamed: the choices' `complete` messages come in index
order whichever choice finishes first. The Shepherd Model Gateway numbers a non-streamed
answer's choices by arrival, not by `complete.index` (smg's processor.rs: "Arrival order, not
`complete.index()`"), as vLLM's own servicer sends them in index order; seeded n > 1 answers
came back shuffled through `deltaserve serve` before."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.sim_server import SimServer, make_sim_model_dir
from tests.support.vllm_sim import generate, wait_until


# `server` and `stub`: conftest.py (a fresh SimServer per test)


def _streamed_choices(stub, n: int, seed: int, max_tokens: int) -> dict[int, list[int]]:
    msgs = list(stub.Generate(generate(request_id=f"s{seed}", stream=True, n=n, seed=seed,
                                       temperature=1.0, max_tokens=max_tokens,
                                       ignore_eos=True), timeout=10))
    return {i: [t for m in msgs if m.HasField("chunk") and m.chunk.index == i
                for t in m.chunk.token_ids] for i in range(n)}


def _early_choice_two(stub) -> tuple[int, int, dict[int, list[int]]]:
    """(seed, stop id, the choices without it): a seed whose choice 2 samples, second, an id that
    choices 0 and 1 never sample, so with that id as a stop token choice 2 ends first."""
    for seed in range(1, 50):
        outs = _streamed_choices(stub, 3, seed, 6)
        stop = outs[2][1]
        if stop not in outs[0] and stop not in outs[1] and stop != outs[2][0]:
            return seed, stop, outs
    raise AssertionError("no seed makes choice 2 stop early")


def test_unstreamed_choices_come_in_index_order_when_a_later_one_finishes_first(server, stub):
    seed, stop, outs = _early_choice_two(stub)
    server.hold_steps(after=0)
    call = stub.Generate(generate(request_id="u", n=3, seed=seed, temperature=1.0,
                                  max_tokens=6, ignore_eos=True, stop_token_ids=[stop]),
                         timeout=30)
    # Step by step until choice 2 has stopped and the others still run: its output reaches
    # the servicer while theirs cannot.
    try:
        for _ in range(4):
            if server.engine.stats.num_running == 2:
                break
            server.step_once()
        wait_until(lambda: server.engine.stats.num_running == 2, "choice 2 to stop first")
    finally:
        server.release_steps()
    msgs = list(call)
    assert all(m.HasField("complete") for m in msgs)
    assert [m.complete.index for m in msgs] == [0, 1, 2]
    assert [list(m.complete.output_ids) for m in msgs] == [outs[0], outs[1], outs[2][:2]]
    assert [m.complete.finish_reason for m in msgs] == ["length", "length", "stop"]
    assert msgs[2].complete.matched_token_id == stop
    assert server.used_blocks() == 0


def test_n_above_max_waiting_is_refused_by_name(tmp_path):
    """The n choices queue together: n above the waiting queue's bound could never be admitted
    (RESOURCE_EXHAUSTED, which an OpenAI client retries forever); it is INVALID_ARGUMENT naming
    n, the value and the bound. n at the bound runs."""
    srv = SimServer(make_sim_model_dir(tmp_path), max_waiting=2)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(generate(request_id="big", n=3, max_tokens=2), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling_params.n=3" in err.value.details()
            assert "<= max_waiting (2)" in err.value.details()
            msgs = list(stub.Generate(generate(request_id="two", n=2, max_tokens=2), timeout=10))
            assert sorted(m.complete.index for m in msgs) == [0, 1]
        assert srv.used_blocks() == 0
    finally:
        srv.close()
