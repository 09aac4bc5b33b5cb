"""The .proto contracts and their generated modules: fresh, named as the issue says, documented,
loadable by the grpcio we deploy against, and working over a real loopback channel."""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import google.protobuf
import grpc
import pytest
from google.protobuf import descriptor_pb2, json_format
from google.protobuf.descriptor import FieldDescriptor as FD

from engine_common.wire import gen_protos
from engine_common.wire.protos import (GENERATION_SERVICE, VLLM_ENGINE_SERVICE, WORKER_SERVICE,
                                  documented_file_descriptors, generation_pb2, generation_pb2_grpc,
                                  smg_common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc, worker_pb2,
                                  worker_pb2_grpc)
from tests.support.paths import REPO



# -- (1) the committed generated files are what the pinned protoc produces -------------------

def test_generated_modules_are_not_stale(tmp_path):
    found = gen_protos.installed_grpc_tools_version()
    if found != gen_protos.GRPC_TOOLS_VERSION:
        pytest.skip(f"grpcio-tools=={gen_protos.GRPC_TOOLS_VERSION} is needed to regenerate the "
                    f"stubs byte for byte; found {found}")
    written = gen_protos.generate(tmp_path)
    produced = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert produced == gen_protos.generated_paths()
    for path in written:
        committed = REPO / path.relative_to(tmp_path)
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.relative_to(REPO)} is stale: run `make proto`")


def test_declared_messages_in_the_proto_sources_are_current():
    """worker.proto's WorkerConfig is written from engine_common/configuration/config.py by `make proto`."""
    for proto_file in gen_protos.DECLARED_MESSAGES:
        text = (REPO / "proto" / proto_file).read_text()
        assert gen_protos.render_declared_messages(proto_file, text) == text, \
            f"{proto_file} is stale: run `make proto`"


def test_stubs_target_the_pinned_grpc_and_an_older_protobuf():
    for module in (generation_pb2_grpc, worker_pb2_grpc, vllm_engine_pb2_grpc):
        assert module.GRPC_GENERATED_VERSION == gen_protos.GRPC_TOOLS_VERSION
    for module in (generation_pb2, worker_pb2, vllm_engine_pb2, smg_common_pb2):
        header = Path(module.__file__).read_text()
        gencode = re.search(r"# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", header).groups()
        runtime = google.protobuf.__version__.split(".")[:3]
        assert gencode[0] == runtime[0]
        assert tuple(map(int, gencode)) <= tuple(int(re.match(r"\d+", x).group()) for x in runtime)


def test_gen_protos_refuses_another_grpc_tools_version(monkeypatch):
    monkeypatch.setattr(gen_protos, "installed_grpc_tools_version", lambda: "9.9.9")
    with pytest.raises(gen_protos.GrpcToolsVersionError, match="grpcio-tools==1.84.0"):
        gen_protos.check_grpc_tools()


# -- (2) names are a contract -----------------------------------------------------------------

def _methods(module, service):
    desc = module.DESCRIPTOR.services_by_name[service]
    return {m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
            for m in desc.methods}


def test_generation_service_contract():
    assert GENERATION_SERVICE == "deltaserve.v1.Generation"
    assert generation_pb2.DESCRIPTOR.package == "deltaserve.v1"
    assert _methods(generation_pb2, "Generation") == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False, False),
        "GetServerStatus": ("GetServerStatusRequest", "GetServerStatusResponse", False, False),
        "Embed": ("EmbedRequest", "EmbedResponse", False, False),
        "Classify": ("ClassifyRequest", "ClassifyResponse", False, False),
        "Score": ("ScoreRequest", "ScoreResponse", False, False),
        "LoadLoraAdapter": ("LoadLoraAdapterRequest", "LoadLoraAdapterResponse", False, False),
        "UnloadLoraAdapter": ("UnloadLoraAdapterRequest", "UnloadLoraAdapterResponse", False,
                              False),
        "ListLoraAdapters": ("ListLoraAdaptersRequest", "ListLoraAdaptersResponse", False,
                             False),
    }


def test_worker_service_contract():
    assert WORKER_SERVICE == "deltaserve.v1.Worker"
    assert _methods(worker_pb2, "Worker") == {
        "Init": ("InitRequest", "InitResponse", False, False),
        "Step": ("StepRequest", "StepResponse", True, True),
        "Reset": ("ResetRequest", "ResetResponse", False, False),
        "LoadLora": ("LoadLoraRequest", "LoadLoraResponse", False, False),
        "UnloadLora": ("UnloadLoraRequest", "UnloadLoraResponse", False, False),
        "Health": ("HealthRequest", "HealthResponse", False, False),
        "Info": ("InfoRequest", "InfoResponse", False, False),
    }


def _field(module, message, name):
    return module.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]


def _is_repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == FD.LABEL_REPEATED


# (message, field, type, repeated, has presence) for the names clients depend on.
GENERATION_FIELDS = [
    ("GenerateRequest", "request_id", FD.TYPE_STRING, False, False),
    ("GenerateRequest", "text", FD.TYPE_STRING, False, True),
    ("GenerateRequest", "token_ids", FD.TYPE_UINT32, True, False),
    ("GenerateRequest", "sampling", FD.TYPE_MESSAGE, False, True),
    ("GenerateRequest", "stopping", FD.TYPE_MESSAGE, False, True),
    ("GenerateRequest", "logprobs", FD.TYPE_UINT32, False, False),
    ("GenerateRequest", "priority", FD.TYPE_INT32, False, False),
    *[("SamplingParams", n, t, False, True) for n, t in [
        ("temperature", FD.TYPE_DOUBLE), ("top_p", FD.TYPE_DOUBLE), ("top_k", FD.TYPE_INT32),
        ("min_p", FD.TYPE_DOUBLE), ("repetition_penalty", FD.TYPE_DOUBLE),
        ("presence_penalty", FD.TYPE_DOUBLE), ("frequency_penalty", FD.TYPE_DOUBLE),
        ("seed", FD.TYPE_UINT64)]],
    ("StoppingCriteria", "max_tokens", FD.TYPE_UINT32, False, True),
    ("StoppingCriteria", "min_tokens", FD.TYPE_UINT32, False, False),
    ("StoppingCriteria", "stop", FD.TYPE_STRING, True, False),
    ("StoppingCriteria", "stop_token_ids", FD.TYPE_UINT32, True, False),
    ("StoppingCriteria", "ignore_eos", FD.TYPE_BOOL, False, False),
    ("StoppingCriteria", "include_stop_str_in_output", FD.TYPE_BOOL, False, False),
    ("GenerateResponse", "request_id", FD.TYPE_STRING, False, False),
    ("GenerateResponse", "token_ids", FD.TYPE_UINT32, True, False),
    ("GenerateResponse", "text", FD.TYPE_STRING, False, False),
    ("GenerateResponse", "logprobs", FD.TYPE_MESSAGE, True, False),
    ("GenerateResponse", "usage", FD.TYPE_MESSAGE, False, True),
    ("GenerateResponse", "finish_reason", FD.TYPE_ENUM, False, False),
    ("GenerateResponse", "stop_token_id", FD.TYPE_UINT32, False, True),
    ("GenerateResponse", "stop_string", FD.TYPE_STRING, False, True),
    ("GenerateResponse", "timings", FD.TYPE_MESSAGE, False, True),
    ("Usage", "prompt_tokens", FD.TYPE_UINT32, False, False),
    ("Usage", "completion_tokens", FD.TYPE_UINT32, False, False),
    ("Usage", "cached_prompt_tokens", FD.TYPE_UINT32, False, False),
    ("AbortRequest", "request_ids", FD.TYPE_STRING, True, False),
    ("AbortResponse", "num_aborted", FD.TYPE_UINT32, False, False),
    ("TokenizeRequest", "text", FD.TYPE_STRING, False, False),
    ("TokenizeResponse", "token_ids", FD.TYPE_UINT32, True, False),
    ("TokenizeResponse", "num_tokens", FD.TYPE_UINT32, False, False),
    *[("GetModelInfoResponse", n, FD.TYPE_UINT32, False, False) for n in [
        "max_model_len", "vocab_size", "tp_size", "num_kv_blocks", "kv_block_size"]],
    ("GetModelInfoResponse", "model_name", FD.TYPE_STRING, False, False),
    ("GetModelInfoResponse", "eos_token_ids", FD.TYPE_UINT32, True, False),
    ("GetModelInfoResponse", "default_sampling", FD.TYPE_MESSAGE, False, True),
    *[("GetServerStatusResponse", n, FD.TYPE_UINT32, False, False) for n in [
        "num_waiting", "num_running", "num_workers_ready"]],
    *[("GetServerStatusResponse", n, FD.TYPE_DOUBLE, False, False) for n in [
        "kv_cache_usage", "prefix_cache_hit_rate", "generation_tokens_per_s",
        "prompt_tokens_per_s"]],
]

WORKER_FIELDS = [
    ("StepRequest", "epoch", FD.TYPE_UINT64, False, False),
    ("StepRequest", "step", FD.TYPE_UINT64, False, False),
    ("StepRequest", "payload", FD.TYPE_BYTES, False, False),
    ("StepRequest", "digest", FD.TYPE_BYTES, False, True),
    ("StepResponse", "payload", FD.TYPE_BYTES, False, False),
    ("StepResponse", "digest", FD.TYPE_BYTES, False, True),
    ("StepResponse", "error", FD.TYPE_MESSAGE, False, True),
    ("InitRequest", "config", FD.TYPE_MESSAGE, False, True),
    ("WorkerConfig", "model_dir", FD.TYPE_STRING, False, True),
    ("WorkerConfig", "kv_cache_bytes", FD.TYPE_INT64, False, True),
    ("WorkerConfig", "gpu_memory_utilization", FD.TYPE_DOUBLE, False, True),
    ("WorkerConfig", "fused_ops", FD.TYPE_BOOL, False, True),
    ("InitRequest", "layout", FD.TYPE_MESSAGE, False, True),
    ("InitRequest", "epoch", FD.TYPE_UINT64, False, False),
    ("InitResponse", "num_kv_blocks", FD.TYPE_UINT32, False, False),
    ("InitResponse", "devices", FD.TYPE_MESSAGE, True, False),
    ("ParallelLayout", "rendezvous_address", FD.TYPE_STRING, False, False),
    ("ResetRequest", "epoch", FD.TYPE_UINT64, False, False),
    ("HealthResponse", "ready", FD.TYPE_BOOL, False, False),
    ("HealthResponse", "reason", FD.TYPE_STRING, False, False),
    ("InfoResponse", "devices", FD.TYPE_MESSAGE, True, False),
]


@pytest.mark.parametrize("module,fields", [(generation_pb2, GENERATION_FIELDS),
                                           (worker_pb2, WORKER_FIELDS)])
def test_key_fields(module, fields):
    for message, name, type_, repeated, presence in fields:
        field = _field(module, message, name)
        assert (field.type, _is_repeated(field), field.has_presence) == (type_, repeated, presence), \
            f"{message}.{name}"


def test_finish_reasons_and_oneofs():
    values = generation_pb2.FinishReason.keys()
    assert values == ["FINISH_REASON_UNSPECIFIED", "LENGTH", "STOP_TOKEN", "STOP_STRING", "ABORT"]
    response = generation_pb2.GenerateResponse.DESCRIPTOR
    assert [f.name for f in response.oneofs_by_name["stop_reason"].fields] == [
        "stop_token_id", "stop_string"]


def test_vllm_engine_service_contract():
    """The vendored protocol keeps upstream's package names: the RPC paths the gateway calls."""
    assert VLLM_ENGINE_SERVICE == "vllm.grpc.engine.VllmEngine"
    assert smg_common_pb2.DESCRIPTOR.package == "smg.grpc.common"
    assert _methods(vllm_engine_pb2, "VllmEngine") == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "Embed": ("EmbedRequest", "EmbedResponse", False, False),
        "HealthCheck": ("HealthCheckRequest", "HealthCheckResponse", False, False),
        "FlushCache": ("FlushCacheRequest", "FlushCacheResponse", False, False),
        "StartProfile": ("StartProfileRequest", "ProfileResponse", False, False),
        "StopProfile": ("StopProfileRequest", "ProfileResponse", False, False),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False, False),
        "GetServerInfo": ("GetServerInfoRequest", "GetServerInfoResponse", False, False),
        "GetLoads": ("GetLoadsRequest", "GetLoadsResponse", False, False),
        "GetTokenizer": ("GetTokenizerRequest", "GetTokenizerChunk", False, True),
        "SubscribeKvEvents": ("SubscribeKvEventsRequest", "KvEventBatch", False, True),
    }
    assert list(vllm_engine_pb2.DESCRIPTOR.dependencies) == [smg_common_pb2.DESCRIPTOR]


def test_vendored_protos_differ_from_upstream_only_in_the_import_path_and_marked_fields():
    """proto/dswire/smg/README.md records the upstream sha256 of each file; the fields DeltaServe
    adds are each marked `// Added by DeltaServe` and leave upstream's untouched."""
    folder = REPO / "proto" / "dswire" / "smg"
    readme = (folder / "README.md").read_text()
    common = (folder / "common.proto").read_bytes()
    engine = (folder / "vllm_engine.proto").read_text()
    upstream_engine = re.sub(r'// Changed by DeltaServe:.*\n//.*\nimport "dswire/smg/common.proto";',
                             'import "common.proto";', engine)
    upstream_engine = re.sub(r' *// Added by DeltaServe.*\n(?: *//.*\n)* *[^/\n]*;\n', '',
                             upstream_engine)
    assert upstream_engine != engine
    for text in (common, upstream_engine.encode()):
        assert hashlib.sha256(text).hexdigest() in readme
    assert "Apache License" in (folder / "LICENSE").read_text()


def test_proto_files_are_independent():
    for module in (generation_pb2, worker_pb2):
        assert list(module.DESCRIPTOR.dependencies) == []


# -- documentation: every element has a comment that reflection can serve --------------------

def _undocumented(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    documented = {tuple(loc.path) for loc in file.source_code_info.location
                  if loc.leading_comments.strip()}
    missing = []

    def need(path, name):
        if tuple(path) not in documented:
            missing.append(name)

    def walk_enum(enum, path, prefix):
        need(path, prefix + enum.name)
        for i, value in enumerate(enum.value):
            need(path + [2, i], f"{prefix}{enum.name}.{value.name}")

    def walk_message(msg, path, prefix):
        if msg.options.map_entry:     # a map field's synthetic entry: documented by the field
            return
        need(path, prefix + msg.name)
        for i, field in enumerate(msg.field):
            need(path + [2, i], f"{prefix}{msg.name}.{field.name}")
        for i, nested in enumerate(msg.nested_type):
            walk_message(nested, path + [3, i], f"{prefix}{msg.name}.")
        for i, enum in enumerate(msg.enum_type):
            walk_enum(enum, path + [4, i], f"{prefix}{msg.name}.")

    for i, msg in enumerate(file.message_type):
        walk_message(msg, [4, i], "")
    for i, enum in enumerate(file.enum_type):
        walk_enum(enum, [5, i], "")
    for i, service in enumerate(file.service):
        need([6, i], service.name)
        for j, method in enumerate(service.method):
            need([6, i, 2, j], f"{service.name}.{method.name}")
    return missing


def test_every_element_is_documented():
    """Our own files; the vendored ones (dswire/smg) are upstream's as they are."""
    files = documented_file_descriptors()
    assert sorted(files) == ["dswire/smg/common.proto", "dswire/smg/vllm_engine.proto",
                             "dswire/v1/generation.proto", "dswire/v1/worker.proto"]
    for name, file in files.items():
        if name.startswith("dswire/v1/"):
            assert _undocumented(file) == [], name


def test_documented_descriptors_match_the_registered_ones():
    """Same schema as the _pb2 modules, only with comments added."""
    for module in (generation_pb2, worker_pb2):
        registered = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(registered)
        documented = documented_file_descriptors()[module.DESCRIPTOR.name]
        documented.ClearField("source_code_info")
        for msg in documented.message_type:   # protoc adds json_name; CopyToProto leaves it out
            _clear_json_names(msg)
        assert documented == registered


def _clear_json_names(msg: descriptor_pb2.DescriptorProto) -> None:
    for field in msg.field:
        field.ClearField("json_name")
    for nested in msg.nested_type:
        _clear_json_names(nested)


# -- (3) round trips --------------------------------------------------------------------------

def test_generate_request_round_trips_binary_and_json():
    req = generation_pb2.GenerateRequest(
        request_id="r1", token_ids=[1, 2, 4294967295], logprobs=5, priority=-3,
        sampling=generation_pb2.SamplingParams(temperature=0.0, top_k=-1, seed=2**63 - 1),
        stopping=generation_pb2.StoppingCriteria(max_tokens=8, stop=["\n\n"], ignore_eos=True))
    back = generation_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.sampling.HasField("temperature") and not back.sampling.HasField("top_p")
    assert not back.HasField("text")
    assert json_format.Parse(json_format.MessageToJson(req), generation_pb2.GenerateRequest()) == req


def test_grpcurl_style_json_body_parses():
    body = ('{"text": "Hello", "sampling": {"temperature": 0.7, "top_p": 0.9},'
            ' "stopping": {"max_tokens": 4, "stop": ["."]}, "logprobs": 2}')
    req = json_format.Parse(body, generation_pb2.GenerateRequest())
    assert (req.text, req.sampling.top_p, req.stopping.max_tokens, list(req.stopping.stop)) == (
        "Hello", 0.9, 4, ["."])
    assert not req.sampling.HasField("top_k")


def test_generate_response_round_trip_with_stop_oneof():
    resp = generation_pb2.GenerateResponse(
        request_id="r1", token_ids=[7, 8], text="hé",
        logprobs=[generation_pb2.TokenLogprob(token_id=7, logprob=-0.5, top_logprobs=[
            generation_pb2.TopLogprob(token_id=7, logprob=-0.5, text="h")])],
        usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=0),
        finish_reason=generation_pb2.STOP_STRING, stop_string="\n",
        timings=generation_pb2.Timings(queued_s=0.001, time_to_first_token_s=0.02, total_s=0.5))
    back = generation_pb2.GenerateResponse.FromString(resp.SerializeToString())
    assert back == resp and back.WhichOneof("stop_reason") == "stop_string"
    back.stop_token_id = 2
    assert back.WhichOneof("stop_reason") == "stop_token_id" and back.stop_string == ""


def test_worker_messages_round_trip():
    init = worker_pb2.InitRequest(
        config=worker_pb2.WorkerConfig(model_dir="/m", dtype="bfloat16", block_size=16,
                                       kv_cache_bytes=1 << 33), epoch=7,
        layout=worker_pb2.ParallelLayout(tp_size=4, node_rank=1, num_nodes=2, num_local_ranks=2,
                                         rendezvous_address="10.0.0.1:29500"))
    back = worker_pb2.InitRequest.FromString(init.SerializeToString())
    assert back == init and not back.config.HasField("gpu_memory_utilization")
    resp = worker_pb2.StepResponse(epoch=7, step=3, error=worker_pb2.StepError(
        code=worker_pb2.StepError.STEP_GAP, message="expected step 2, got 3"))
    back = worker_pb2.StepResponse.FromString(resp.SerializeToString())
    assert back.HasField("error") and not back.HasField("digest")
    assert back.error.code == worker_pb2.StepError.STEP_GAP


# -- the stubs work over a real channel ------------------------------------------------------

class _EchoGeneration(generation_pb2_grpc.GenerationServicer):
    def Generate(self, request, context):
        for i, token_id in enumerate(request.token_ids):
            yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[token_id],
                                                  usage=generation_pb2.Usage(completion_tokens=i + 1))


class _EchoWorker(worker_pb2_grpc.WorkerServicer):
    def Step(self, request_iterator, context):
        for req in request_iterator:
            yield worker_pb2.StepResponse(epoch=req.epoch, step=req.step, payload=req.payload[::-1])


def test_stubs_stream_over_loopback():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(_EchoGeneration(), server)
    worker_pb2_grpc.add_WorkerServicer_to_server(_EchoWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            gen = generation_pb2_grpc.GenerationStub(channel)
            outs = list(gen.Generate(generation_pb2.GenerateRequest(request_id="a", token_ids=[5, 6]),
                                     timeout=10))
            assert [(o.token_ids[0], o.usage.completion_tokens) for o in outs] == [(5, 1), (6, 2)]
            steps = (worker_pb2.StepRequest(epoch=1, step=s, payload=bytes([s, 9])) for s in range(3))
            replies = list(worker_pb2_grpc.WorkerStub(channel).Step(steps, timeout=10))
            assert [(r.step, r.payload) for r in replies] == [(s, bytes([9, s])) for s in range(3)]
    finally:
        server.stop(None)


def test_protos_import_without_torch():
    code = ("import sys, engine_common.wire.protos, scheduler_service.api.convert; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_admin_methods_name_real_methods():
    """api_keys.ADMIN_METHODS (the calls only `admin` keys may make) name methods the port
    serves: a typo there would leave LoadLoraAdapter open to every key."""
    from engine_common.wire.protos import vllm_engine_pb2
    from scheduler_service.api.api_keys import ADMIN_METHODS

    served = {f"/{svc.full_name}/{m.name}" for module in (generation_pb2, vllm_engine_pb2)
              for svc in module.DESCRIPTOR.services_by_name.values() for m in svc.methods}
    assert ADMIN_METHODS <= served
    assert {"/deltaserve.v1.Generation/LoadLoraAdapter",
            "/deltaserve.v1.Generation/UnloadLoraAdapter"} <= ADMIN_METHODS
