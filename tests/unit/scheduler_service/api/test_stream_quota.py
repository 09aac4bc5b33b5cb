"""--max-requests-per-key bounds the streams a key may keep open as long as it likes, as it
bounds its requests: health Watch, VllmEngine GetTokenizer and SubscribeKvEvents, at most N of
each per key at once, the next RESOURCE_EXHAUSTED at once naming the bound; other keys are not
affected, and a stream that ends gives its place back. Real gRPC on loopback, the real
interceptors and servicers over a simulated worker.

Before (session 48's review), these streams held no place: one key could open any number of
Watch streams (about 21 KB each, held for as long as the client kept them)."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from scheduler_service.api.api_keys import fingerprint
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.request_quota import GET_TOKENIZER, SUBSCRIBE_KV_EVENTS
from tests.support.sim_server import SimServer, make_sim_model_dir
from tests.support.vllm_sim import wait_until

KEY_A, KEY_B = "stream-key-a-0123456789", "stream-key-b-0123456789"
BEARER_A, BEARER_B = f"Bearer {KEY_A}", f"Bearer {KEY_B}"
BOUND = 2
SERVING = health_pb2.HealthCheckResponse.SERVING
WATCH_ALL = health_pb2.HealthCheckRequest(service="")


@pytest.fixture
def keyed(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} admin\n{KEY_B} admin\n")
    srv = SimServer(make_sim_model_dir(tmp_path / "model"),
                    api=ApiOptions(api_key_file=str(keys), max_requests_per_key=BOUND))
    with grpc.insecure_channel(srv.target) as channel:
        yield srv, channel
    srv.close()


def _md(bearer: str):
    return (("authorization", bearer),)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        next(call)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return refused.value


def test_a_key_holds_at_most_its_bound_of_watch_streams(keyed):
    srv, channel = keyed
    health = health_pb2_grpc.HealthStub(channel)
    held = [health.Watch(WATCH_ALL, timeout=60, metadata=_md(BEARER_A)) for _ in range(BOUND)]
    assert all(next(w).status == SERVING for w in held)       # each handler holds its place
    refused = _refused(health.Watch(WATCH_ALL, timeout=60, metadata=_md(BEARER_A)))
    assert "Watch calls in progress for this API key" in refused.details()
    assert f"<= {BOUND} (--max-requests-per-key)" in refused.details()
    other = health.Watch(WATCH_ALL, timeout=60, metadata=_md(BEARER_B))
    assert next(other).status == SERVING                      # another key is not affected
    assert health.Check(WATCH_ALL, timeout=10).status == SERVING     # probes: no key, no bound
    held[0].cancel()                                          # its place comes back
    wait_until(lambda: srv.quota.calls(fingerprint(BEARER_A), "Watch") == BOUND - 1,
               "the cancelled Watch's place back")
    again = health.Watch(WATCH_ALL, timeout=60, metadata=_md(BEARER_A))
    assert next(again).status == SERVING
    for call in (held[1], other, again):
        call.cancel()
    wait_until(lambda: not srv.quota.calls(fingerprint(BEARER_A), "Watch"), "every place back")


def _hold(srv: SimServer, caller: str, kind: str, n: int) -> list:
    """n places of `caller`'s `kind` taken on the server's loop, as n open streams hold them."""
    async def take():
        held = [srv.quota.call(caller, "", kind) for _ in range(n)]
        for cm in held:
            cm.__enter__()
        return held

    async def give_back(held):
        for cm in held:
            cm.__exit__(None, None, None)
    held = srv._call(take())
    return lambda: srv._call(give_back(held))


def test_get_tokenizer_is_bounded_per_key_and_gives_its_place_back(keyed):
    srv, channel = keyed
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    whole = list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30, metadata=_md(BEARER_A)))
    assert whole[-1].sha256
    assert not srv.quota.calls(fingerprint(BEARER_A), GET_TOKENIZER)   # ended: place back
    release = _hold(srv, fingerprint(BEARER_A), GET_TOKENIZER, BOUND)
    refused = _refused(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30,
                                         metadata=_md(BEARER_A)))
    assert "GetTokenizer calls in progress" in refused.details()
    assert "--max-requests-per-key" in refused.details()
    assert list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30,
                                  metadata=_md(BEARER_B))) == whole
    release()
    assert list(stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=30,
                                  metadata=_md(BEARER_A))) == whole


def test_subscribe_kv_events_is_bounded_per_key(keyed):
    srv, channel = keyed
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    release = _hold(srv, fingerprint(BEARER_A), SUBSCRIBE_KV_EVENTS, BOUND)
    refused = _refused(stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=30,
                                              metadata=_md(BEARER_A)))
    assert "SubscribeKvEvents calls in progress" in refused.details()
    release()
    live = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=30,
                                  metadata=_md(BEARER_A))
    wait_until(lambda: srv.quota.calls(fingerprint(BEARER_A), SUBSCRIBE_KV_EVENTS) == 1,
               "the subscription's place taken")
    live.cancel()
    wait_until(lambda: not srv.quota.calls(fingerprint(BEARER_A), SUBSCRIBE_KV_EVENTS),
               "the cancelled subscription's place back")
