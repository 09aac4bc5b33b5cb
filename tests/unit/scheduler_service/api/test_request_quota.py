"""--max-requests-per-key: one API key holds at most N requests at once across both services of
the port (a VllmEngine Generate with n choices holds n); its next is RESOURCE_EXHAUSTED naming
the limit, while other keys are admitted. Without the bound one tenant could fill the shared
waiting queue (--max-waiting) and leave every other tenant refused (hostile run, session 36)."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from scheduler_service.api.api_keys import fingerprint
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.request_quota import RequestQuota
from scheduler_service.core.admission import QueueFull
from tests.support.sim_server import SimServer, make_sim_model_dir
from tests.support.vllm_sim import generate, rpc_code, wait_until

KEY_A, KEY_B = "quota-key-a-0123456789", "quota-key-b-0123456789"
BEARER_A, BEARER_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
CALLER_A, CALLER_B = fingerprint(f"Bearer {KEY_A}"), fingerprint(f"Bearer {KEY_B}")


def test_quota_holds_places_per_caller_and_gives_them_back():
    quota = RequestQuota(per_key=3)
    with quota.hold("a", "r1"), quota.hold("a", "r2", n=2):
        assert quota.live("a") == 3
        with pytest.raises(QueueFull, match=r"--max-requests-per-key"):
            with quota.hold("a", "r3"):
                pass
        with quota.hold("b", "r4", n=3):          # another key: its own places
            assert (quota.live("a"), quota.live("b")) == (3, 3)
    assert quota.live("a") == quota.live("b") == 0
    with pytest.raises(QueueFull):                  # n above the bound never fits
        with quota.hold("c", "r5", n=4):
            pass
    assert quota.live("c") == 0
    unbounded = RequestQuota()
    with unbounded.hold("a", "r", n=10_000):
        assert unbounded.live("a") == 10_000


@pytest.fixture
def keyed(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    srv = SimServer(make_sim_model_dir(tmp_path / "model"),
                    api=ApiOptions(api_key_file=str(keys), max_requests_per_key=2))
    with grpc.insecure_channel(srv.target) as channel:
        yield (srv, vllm_engine_pb2_grpc.VllmEngineStub(channel),
               generation_pb2_grpc.GenerationStub(channel))
    srv.release_steps()
    srv.close()


def _generation(request_id: str) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(request_id=request_id, token_ids=list(range(40, 53)),
                               stopping=gpb.StoppingCriteria(max_tokens=2, ignore_eos=True))


def test_a_key_at_its_bound_is_refused_on_both_services_and_others_are_not(keyed):
    server, vllm, generation = keyed
    server.hold_steps(after=0)
    held = [vllm.Generate(generate(request_id="a1", max_tokens=2), timeout=30, metadata=BEARER_A),
            generation.Generate(_generation("a2"), timeout=30, metadata=BEARER_A)]
    wait_until(lambda: server.quota.live(CALLER_A) == 2, "key A's two requests to be held")
    for call in (lambda: vllm.Generate(generate(request_id="a3", max_tokens=2), timeout=10,
                                       metadata=BEARER_A),
                 lambda: generation.Generate(_generation("a4"), timeout=10, metadata=BEARER_A)):
        code, details = rpc_code(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "requests in flight for this API key=3" in details
        assert "<= 2 (--max-requests-per-key)" in details
    # n choices hold n places: key B's n=3 never fits, its n=2 does
    code, details = rpc_code(lambda: vllm.Generate(generate(request_id="b1", n=3, max_tokens=2),
                                                   timeout=10, metadata=BEARER_B))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "=3" in details
    b_call = vllm.Generate(generate(request_id="b2", n=2, max_tokens=2), timeout=30,
                           metadata=BEARER_B)
    wait_until(lambda: server.quota.live(CALLER_B) == 2, "key B's two choices beside A's")
    server.release_steps()
    for call in held + [b_call]:
        assert list(call)
    # the places come back as the calls end (server side, just after their last message)
    wait_until(lambda: server.quota.live(CALLER_A) == server.quota.live(CALLER_B) == 0,
               "the ended calls' places to come back")
    assert rpc_code(lambda: vllm.Generate(generate(request_id="a5", max_tokens=2), timeout=10,
                                          metadata=BEARER_A)) == (grpc.StatusCode.OK, "")
    wait_until(lambda: server.quota.live(CALLER_A) == 0, "a5's place to come back")
    assert server.used_blocks() == 0


def test_a_key_at_its_bound_is_refused_before_its_prompt_is_tokenized(keyed):
    """A place is taken before the tokenizer pool is: a key at its bound used to have each
    further text prompt tokenized (queued behind its share of the threads, the message held)
    and only then refused, so one key could queue any number of calls, megabytes each, and
    keep its threads busy with work thrown away (hostile run, session 45). Key A's share of
    the pool is held here by jobs that wait: a call that reached the pool would wait too."""
    server, vllm, generation = keyed
    server.hold_steps(after=0)
    held = [generation.Generate(_generation(f"a{i}"), timeout=30, metadata=BEARER_A)
            for i in range(2)]
    wait_until(lambda: server.quota.live(CALLER_A) == 2, "key A's two requests to be held")
    release = threading.Event()
    blockers = [asyncio.run_coroutine_threadsafe(
        server.pool.run(release.wait, caller=CALLER_A), server._loop)
        for _ in range(server.pool.per_caller)]
    try:
        text_calls = (
            lambda: generation.Generate(gpb.GenerateRequest(request_id="a3", text="a b c",
                                                            stopping=gpb.StoppingCriteria(
                                                                max_tokens=2)),
                                        timeout=10, metadata=BEARER_A),
            lambda: vllm.Generate(vpb.GenerateRequest(request_id="a4", text="a b c",
                                                      sampling_params=vpb.SamplingParams(
                                                          max_tokens=2)),
                                  timeout=10, metadata=BEARER_A))
        for call in text_calls:
            code, details = rpc_code(call)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "<= 2 (--max-requests-per-key)" in details
    finally:
        release.set()
        for job in blockers:
            job.result(10)
        server.release_steps()
    for call in held:
        assert list(call)
    wait_until(lambda: server.quota.live(CALLER_A) == 0, "the places to come back")


def test_a_key_holds_at_most_its_bound_of_tokenize_calls(keyed):
    """Tokenize holds no place of the engine, but it waits for the key's share of the
    tokenizer threads holding its message (up to --max-request-mib): a key could queue any
    number of them (hostile run, session 45). Now at most --max-requests-per-key at once; the
    next is RESOURCE_EXHAUSTED naming the bound, another key's is served."""
    server, _, generation = keyed
    release = threading.Event()
    blockers = [asyncio.run_coroutine_threadsafe(
        server.pool.run(release.wait, caller=CALLER_A), server._loop)
        for _ in range(server.pool.per_caller)]
    tokenize = gpb.TokenizeRequest(text="a b c")
    try:
        queued = [generation.Tokenize.future(tokenize, timeout=30, metadata=BEARER_A)
                  for _ in range(2)]
        wait_until(lambda: server.pool.num_jobs(CALLER_A) == server.pool.per_caller + 2,
                   "key A's two Tokenize calls to wait for its threads")
        code, details = rpc_code(lambda: generation.Tokenize(tokenize, timeout=10,
                                                             metadata=BEARER_A))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert "Tokenize calls in progress for this API key=3 must be <= 2" in details
        assert generation.Tokenize(tokenize, timeout=10, metadata=BEARER_B).num_tokens > 0
    finally:
        release.set()
        for job in blockers:
            job.result(10)
    assert all(call.result().num_tokens > 0 for call in queued)
