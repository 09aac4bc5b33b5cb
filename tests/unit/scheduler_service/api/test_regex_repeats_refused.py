"""Over the public port: a regex whose counted repetitions expand too far is INVALID_ARGUMENT at
admission, naming the field and the bound, on deltaserve.v1.Generation and VllmEngine; it never
reaches the worker, and the server serves on."""
from __future__ import annotations

import grpc
import pytest

from engine_common.request.diff_limits import MAX_REGEX_REPEAT_SIZE
from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.sim_server import SimServer, make_sim_model_dir
from tests.support.vllm_sim import PROMPT, generate, rpc_code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = SimServer(make_sim_model_dir(tmp_path_factory.mktemp("sim-model")))
    yield srv
    srv.close()


@pytest.mark.parametrize("regex", ["a{1000000}", "(a{1000}){1000}", "(a|b){5000}{5000}"])
def test_both_protocols_refuse_a_regex_that_expands_too_far(server, regex):
    limit = f"add at most {MAX_REGEX_REPEAT_SIZE} atoms to it"
    with grpc.insecure_channel(server.target) as ch:
        code, details = rpc_code(lambda: generation_pb2_grpc.GenerationStub(ch).Generate(
            gpb.GenerateRequest(token_ids=PROMPT, stopping=gpb.StoppingCriteria(max_tokens=4),
                                constraint=gpb.Constraint(regex=regex)), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"constraint.regex={regex!r} is invalid") and limit in details
        code, details = rpc_code(lambda: vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
            generate(max_tokens=4, regex=regex), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"sampling_params.regex={regex!r}") and limit in details
        (done,) = list(vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
            generate(request_id="ok", max_tokens=8, regex="[0-9]{3}"), timeout=30))
        assert done.complete.finish_reason == "stop" and len(done.complete.output_ids) == 4
    assert server.workers[-1].diffs and all(
        new.constraint is None or new.constraint.value == "[0-9]{3}"
        for diff in server.workers[-1].diffs for new in diff.new_requests)


@pytest.mark.parametrize("field, value, where", [
    ("grammar", 'start: A\nA: B{1000}\nB: "x"{1000}', "in terminal A"),
    ("grammar", "root ::= [a-z]{3} x\nx ::= \"ab\"{20000}", "in terminal X"),
    ("json_schema", '{"$ref": "#/x/s", "x": {"s": {"type": "string", "pattern": "^a{100000}$"}}}',
     "in pattern '^a{100000}$'"),
])
def test_regexes_hidden_in_grammars_and_schemas_are_refused_too(server, field, value, where):
    """A grammar's terminals and a pattern a `$ref` reaches under any key: INVALID_ARGUMENT on
    both protocols, naming where the expansion is."""
    with grpc.insecure_channel(server.target) as ch:
        code, details = rpc_code(lambda: generation_pb2_grpc.GenerationStub(ch).Generate(
            gpb.GenerateRequest(token_ids=PROMPT, stopping=gpb.StoppingCriteria(max_tokens=4),
                                constraint=gpb.Constraint(**{field: value})), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"constraint.{field}=") and f" {where} once" in details
        code, details = rpc_code(lambda: vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
            generate(max_tokens=4, **{field: value}), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"sampling_params.{field}=") and f" {where} once" in details
