"""A key's `priority=LO..HI` holds on every API, not only where a request names a priority.

Session 48 (a hostile tenant): a key the operator held to priority=10..20 (served after the
default 0) sent its requests through VllmEngine's Generate, which carries no priority: they ran
at 0, ahead of (and able to preempt) every request of the default priority. A request that
names no priority now runs at the key's default: 0 moved into its range."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import vllm_engine_pb2_grpc
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.pooling import model_pooler_config
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api.api_keys import KeyPolicy
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.embeddings import embed_in_place
from scheduler_service.api.front_door import FrontDoor, ServedModel
from scheduler_service.errors import RequestFailed
from tests.support.classifier_models import make_classifier_model
from tests.support.sim_server import SimServer
from tests.support.vllm_sim import generate

LOW, HIGH, OPEN = "key-low-0123456789abc", "key-high-0123456789ab", "key-open-0123456789ab"


def bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def test_the_default_priority_is_zero_moved_into_the_keys_range():
    assert KeyPolicy(min_priority=10, max_priority=20).default_priority == 10
    assert KeyPolicy(min_priority=-9, max_priority=-3).default_priority == -3
    assert KeyPolicy(min_priority=-5, max_priority=5).default_priority == 0
    assert KeyPolicy().default_priority == 0


@pytest.fixture
def demoted(model_dir, tmp_path):
    """LOW may only be served after the default; HIGH only before it; OPEN as the default."""
    keys = tmp_path / "keys"
    keys.write_text(f"{LOW} priority=10..20\n{HIGH} priority=-9..-3\n{OPEN}\n")
    srv = SimServer(model_dir, api=ApiOptions(api_key_file=str(keys)))
    seen: list[int] = []
    real_generate = srv.engine.generate

    def recording(request):          # the real engine; what reached it is recorded
        seen.append(request.priority)
        return real_generate(request)
    srv.engine.generate = recording
    with grpc.insecure_channel(srv.target) as channel:
        yield channel, seen
    srv.close()


def test_a_request_without_a_priority_runs_at_its_keys_default(demoted):
    channel, seen = demoted
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    for key, expected in ((LOW, 10), (HIGH, -3), (OPEN, 0)):
        seen.clear()
        (done,) = vllm.Generate(generate(max_tokens=2, ignore_eos=True, n=1), timeout=30,
                                metadata=bearer(key))
        assert done.complete.finish_reason == "length"
        assert seen == [expected], key
    seen.clear()
    list(vllm.Generate(generate(max_tokens=1, ignore_eos=True, n=2, request_id="n2"),
                       timeout=30, metadata=bearer(LOW)))
    assert seen == [10, 10]              # every choice
    # Generation's Generate names its priority, checked against the range as before
    generation = generation_pb2_grpc.GenerationStub(channel)
    seen.clear()
    *_, last = generation.Generate(gpb.GenerateRequest(
        token_ids=[5, 6, 7], priority=12,
        stopping=gpb.StoppingCriteria(max_tokens=1, ignore_eos=True)), timeout=30,
        metadata=bearer(LOW))
    assert last.usage.completion_tokens == 1 and seen == [12]


class _RecordingEngine:
    """The engine's seam as embed_in_place sees it: records each Request, then ends its
    stream without a vector (the call fails after the request is built)."""

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return
        yield


def test_pooling_requests_run_at_their_keys_default(tmp_path):
    """Embed, Classify and Score build their requests in embed_in_place: the key's salt and
    default priority, never 0 for a key held to 10..20."""
    model = str(make_classifier_model(tmp_path / "bert", "bert", 1))
    served = ServedModel(ModelInfo.from_dir(model), Tokenizer.from_dir(model), block_size=16,
                         pooler=model_pooler_config(model))
    engine, low = _RecordingEngine(), KeyPolicy(salt="key:low", min_priority=10,
                                                max_priority=20)
    with pytest.raises(RequestFailed, match="ended without a vector"):
        asyncio.run(embed_in_place(engine, FrontDoor(served, ApiOptions()), "low", "e1",
                                   [5, 6, 7], low))
    (request,) = engine.requests
    assert request.priority == 10 and request.cache_salt == "key:low"
